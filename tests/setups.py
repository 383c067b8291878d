"""Set-ups shared by the SFT, FSDP and GRPO tests and their LoRA variants: records, base recipes, the torchrun worker;
and the loader of bench/ scripts for their tests.

Each test module adds its own settings (learning rate, LoRA, checkpoints) to these bases: sft_recipe and grpo_recipe
for in-process runs, the *_overrides lists for torchrun workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from physreason.config import Config, load_config
from physreason.net import free_port
from physreason.rewards import register_reward

BENCH = Path(__file__).resolve().parents[1] / "bench"
ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"


def write_chat_records(folder: Path, count: int = 8, question: str = "Does the box slide {i}?") -> Path:
    """`count` one-turn conversations (`question` with {i} numbered, answered with ANSWER) in folder/train.jsonl."""
    records = [
        {"conversations": [{"role": "user", "content": question.format(i=i)}, {"role": "assistant", "content": ANSWER}]}
        for i in range(count)
    ]
    path = folder / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def sft_overrides(model: Path, data: Path, out: Path, lr: str, logger: str) -> list[str]:
    """The in-process SFT tests' base: batches of 4 in micro-batches of 2, one warm-up step, float32."""
    return [
        f"model.model_name_or_path='{model}'",
        f"data.dataset.name='{data}'",
        f"train.output_dir='{out}'",
        "train.train_batch_per_replica=4",
        "train.mini_batch=2",
        f"train.optm_lr={lr}",
        "train.optm_warmup_steps=1",
        "train.param_dtype='float32'",
        "data.num_workers=0",
        f"logging.logger={logger}",
    ]


def sft_recipe(model: Path, data: Path, out: Path, *settings: str, lr: str, logger: str) -> Config:
    """The recipe of an in-process SFT test: sft_overrides, then the test's own `settings` (later ones win)."""
    return load_config(None, [*sft_overrides(model, data, out, lr, logger), *settings])


def fsdp_overrides(model: Path, data: Path, out: Path, lr: str) -> list[str]:
    """The FSDP tests' base: 3 steps of micro-batches of 1, float32, one float32 safetensors export at step 3."""
    return [
        f"model.model_name_or_path='{model}'", f"data.dataset.name='{data}'", f"train.output_dir='{out}'",
        "train.train_batch_per_replica=4", "train.mini_batch=1", "train.max_steps=3", f"train.optm_lr={lr}",
        "train.param_dtype='float32'", "data.num_workers=0", "logging.logger=['jsonl']",
        # export in float32: a bf16 export would turn last-bit differences of the reduction order into 1-ulp flips
        "model.dtype='float32'",
        "train.ckpt.save_freq=3", "train.ckpt.export_safetensors=true", "train.ckpt.max_keep=1",
    ]  # fmt: skip


SFT_WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from physreason.config import load_config
    from physreason.train.sft import run_sft
    result = run_sft(load_config(None, json.loads(sys.argv[1])))
    if dist.get_rank() == 0:
        json.dump(result.losses, open(sys.argv[2], "w"))
    dist.destroy_process_group()
    """
)


# A torchrun child on gloo that aborts in C++ without a Python error: seen once in a full CI suite on 2 cores, early in
# a CPU-offload run (before its weights loaded), never in 76 runs of the same test alone or beside busy loops.
CXX_ABORT = "terminate called without an active exception"


def run_torchrun(command: list[str], env: dict[str, str], clean: Iterable[Path] = (), timeout: float = 300):
    """Run a torchrun `command`; run it once more (after removing the folders in `clean`) when a child aborted in C++
    with CXX_ABORT, warning with that attempt's stderr: Python's fault handler prints every thread's stack there, so
    the warnings summary of the suite says where it happened. Any other failure is returned as it is."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and CXX_ABORT in done.stderr:
        warnings.warn(f"a torchrun child aborted ({CXX_ABORT}); running it once more. Its stderr:\n{done.stderr[-8000:]}",
                      stacklevel=2)
        for folder in clean:
            shutil.rmtree(folder, ignore_errors=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    return done


def torchrun_sft(folder: Path, nproc: int, port: int, overrides: list[str]) -> list[float]:
    """Run SFT with `overrides` in `nproc` torchrun processes (gloo on CPU); return rank 0's losses.

    `port` is kept for the callers; the rendezvous takes a port free now (a fixed one collides with any other
    torchrun on the machine, such as a second test run)."""
    port = free_port()
    script = folder / "worker.py"
    script.write_text(SFT_WORKER)
    losses_file = folder / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
               str(script), json.dumps(overrides), str(losses_file)]  # fmt: skip
    done = run_torchrun(command, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(losses_file.read_text())


@register_reward("test_mentions_b")
def mentions_b(completion: str, **sample) -> float:
    """1 when the completion contains the letter B: a task a random tiny model can discover and learn."""
    return 1.0 if "B" in completion else 0.0


def write_mcq_file(folder: Path) -> Path:
    """Eight multiple-choice prompts whose answer is always B, in folder/mcq.jsonl."""
    records = [{"question": f"Which way does ball {i} go?", "options": ["up", "down", "left", "right"], "answer": "B"}
               for i in range(8)]  # fmt: skip
    path = folder / "mcq.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def grpo_overrides(model: Path, data: Path, out: Path, reward: str, lr: str) -> list[str]:
    """The GRPO tests' base on the hf engine: 2 prompts x 8 completions of 6 tokens a step, rewarded by `reward`."""
    return [
        f"model.model_name_or_path='{model}'", "model.dtype='float32'", f"data.dataset.name='{data}'",
        f"train.output_dir='{out}'", "engine.backend='hf'", "engine.batch_size=16",
        "train.train_batch_per_replica=16", "rollout.n_generation=8", "rollout.batch_size=2",
        "rollout.max_response_length=6", "grpo.mini_batch=8", f"grpo.reward_function={{{reward} = 1.0}}",
        f"train.optm_lr={lr}", "train.optm_weight_decay=0", "train.optm_decay_type='constant'",
        "train.param_dtype='float32'",
    ]  # fmt: skip


def grpo_recipe(model: Path, data: Path, out: Path, *settings: str, lr: str, reward: str = "test_mentions_b") -> Config:
    """The recipe of a GRPO test: grpo_overrides, then the test's own `settings` (later ones win)."""
    return load_config(None, [*grpo_overrides(model, data, out, reward, lr), *settings])


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py imported as module `name`, registered in sys.modules (processes it spawns import it by name).

    bench/ stays on sys.path, as for a script run from there: the scripts import shapes, harness and each other by name,
    some of them inside functions.
    """
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Another process holding a lock as a run does (physreason.train.runlock), until it is killed.
_LOCK_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from physreason.train.runlock import LOCK_NAME, lock_file
    path = Path(sys.argv[1])
    assert lock_file(path if path.suffix == ".lock" else path / LOCK_NAME, "held", "by the test")
    print("held", flush=True)
    time.sleep(100)
    """
)


def lock_holder(path: Path) -> subprocess.Popen:
    """Another process holding `path` as a run holds its folder (or, given a `.lock` file, that lock); kill it to end."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                               env=env)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process
