"""The SFT micro-batch stream: worker processes give exactly the single-process batches, across epochs and seeks."""

from __future__ import annotations

import functools

import pytest
import torch

from physreason.data.collate import collate_padded
from physreason.data.sampler import StepSampler
from physreason.data.sft import SFTDataset
from physreason.models.tiny import build_tiny_tokenizer
from physreason.train.sft import MicroBatches, _loader_worker_init

pytestmark = pytest.mark.slow  # spawning worker processes imports torch in each (several seconds on 2 cores)


def _stream(workers: int) -> MicroBatches:
    records = [
        {"conversations": [{"role": "user", "content": f"question {k} " * (1 + k % 3)},
                           {"role": "assistant", "content": f"answer {k}"}]}
        for k in range(10)
    ]
    dataset = SFTDataset(records, ".", build_tiny_tokenizer(), max_length=128)
    sampler = StepSampler(len(records), global_batch=4, rank=0, world_size=1, seed=3)
    collate = functools.partial(collate_padded, pad_token_id=0, mrope=False)
    return MicroBatches(dataset, sampler, 2, collate, workers)


def _ids(stream: MicroBatches, count: int) -> list[torch.Tensor]:
    return [batch.input_ids for batch in stream.take(count)]


def test_spawned_workers_give_the_same_batches_across_an_epoch_end_and_a_seek():
    single, spawned = _stream(0), _stream(2)
    # 10 samples, 4 per step: 2 steps per epoch, so 6 micro-batches of 2 cross an epoch boundary.
    for expected, got in zip(_ids(single, 6), _ids(spawned, 6), strict=True):
        assert torch.equal(expected, got)
    single.seek(1)
    spawned.seek(1)
    for expected, got in zip(_ids(single, 4), _ids(spawned, 4), strict=True):
        assert torch.equal(expected, got)
    loader = spawned._loader
    assert loader.multiprocessing_context.get_start_method() == "spawn" and loader.persistent_workers


def test_close_stops_the_worker_processes_and_a_later_take_starts_new_ones():
    import multiprocessing

    others = {p.pid for p in multiprocessing.active_children()}
    stream = _stream(2)
    first = _ids(stream, 2)
    workers = {p.pid for p in multiprocessing.active_children()} - others
    assert len(workers) == 2
    stream.close()  # run_sft calls this when training ends or fails
    assert not workers & {p.pid for p in multiprocessing.active_children()}
    stream.seek(0)
    for expected, got in zip(first, _ids(stream, 2), strict=True):
        assert torch.equal(expected, got)


def test_loader_workers_leave_at_exit_before_the_interpreter_finalises():
    # The worker-side hook that keeps a feeder thread's send from being force-unwound at shutdown (see
    # _loader_worker_init): at exit the process ends at once, status 0, its output flushed.
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('finaliser ran'))\n"  # registered earlier, so it would run later: it must not
        "from physreason.train.sft import _loader_worker_init\n"
        "_loader_worker_init(0)\n"
        "print('flushed', end='')\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "flushed"
    stream = _stream(2)
    assert len(_ids(stream, 1)) == 1  # spawned workers accept the hook (a module-level, picklable function)
    assert stream._loader.worker_init_fn is _loader_worker_init
    stream.close()


def test_loader_workers_ignore_stop_signals_from_their_first_moment_and_keep_serving():
    # Ctrl-C, GNU timeout and schedulers signal the whole process group. A worker ended by it would make torch raise
    # in the trainer mid-step ("DataLoader worker is killed by signal"); the trainer must finish its step instead.
    import multiprocessing
    import os
    import signal

    others = {p.pid for p in multiprocessing.active_children()}
    stream = _stream(2)
    stream._iterator = stream._open()  # the workers are starting: still importing torch, long before worker_init_fn
    try:
        workers = [p for p in multiprocessing.active_children() if p.pid not in others]
        assert len(workers) == 2
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGINT)
        batches = stream.take(3)
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)  # and once they serve
        batches += stream.take(3)
        assert len(batches) == 6 and all(worker.is_alive() for worker in workers)
    finally:
        stream.close()
    assert not any(worker.is_alive() for worker in workers)  # closing the loader still ends them
