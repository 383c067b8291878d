"""A training step that runs out of GPU memory ends with one message that says why and what to change.

torch's own error is a stack trace ending in the bytes it could not get. The trainers (SFT, GRPO) turn it into
OutOfGPUMemory (exit 2, as every user-fixable error): what the tensors held, what the allocator held beyond them (the
fragmentation expandable segments prevent, physreason.train.allocator), what the memory plan had said, the settings
that lower the peak, and the command that continues from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from physreason.config import Config
from physreason.errors import PhysReasonError
from physreason.train.allocator import EXPANDABLE_SEGMENTS, expandable_segments, user_alloc_conf
from physreason.train.checkpoint import checkpoint_dirs
from physreason.train.loop import resume_command
from physreason.train.memory import GIB
from physreason.train.memory_report import Job, mini_batch_key

# Reserved-but-unused memory above this share of the GPU at the failure is called fragmentation in the message.
FRAGMENTED_SHARE = 0.05


class OutOfGPUMemory(PhysReasonError):
    """A training step ran out of GPU memory; the message says what was held, the plan, and what to change."""


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def out_of_memory_message(
    config: Config,
    job: Job,
    step: int,
    held: tuple[int, int, int],
    planned: int | None,
    checkpoint: Path | None,
    argv: list[str],
) -> str:
    """The message for step `step` (1-based) failing with `held` = (allocated, reserved, GPU total) bytes."""
    allocated, reserved, total = held
    unused = max(reserved - allocated, 0)
    text = (
        f"step {step} ran out of GPU memory: tensors held {_gib(allocated)} GiB and the allocator {_gib(unused)} GiB "
        f"more of the GPU's {_gib(total)} GiB"
    )
    if planned is not None:
        text += f"; the memory plan was {_gib(planned)} GiB"
        if config.train.skip_memory_check:
            text += " (train.skip_memory_check started it without the check)"
    conf = user_alloc_conf()
    if total and unused > FRAGMENTED_SHARE * total and conf is not None and not expandable_segments(conf[1]):
        text += (
            f". The {_gib(unused)} GiB held but unused is fragmentation: {conf[0]}={conf[1]} leaves expandable "
            f"segments off; unset it (training then uses {EXPANDABLE_SEGMENTS}) or add that to it"
        )
    train = config.train
    changes = []
    if not train.gradient_checkpointing:
        changes.append("--set train.gradient_checkpointing=true (recompute activations)")
    elif train.checkpoint_every != 1:
        changes.append("--set train.checkpoint_every=1 (recompute every block)")
    changes.append(f"a smaller {mini_batch_key(job)}")
    if not train.cpu_offload and job == "sft":
        changes.append("--set train.cpu_offload=true")
    text += f". To lower the peak: {'; '.join(changes)}; `physreason plan` lists the layouts that fit this GPU"
    if checkpoint is not None:
        command = resume_command(argv)
        text += f". The last checkpoint is {checkpoint}; with the change, this continues from it:\n  {command}"
    else:
        text += ". No checkpoint was saved before it, so a rerun starts from step 0"
    return text


@contextlib.contextmanager
def explains_out_of_memory(
    config: Config, job: Job, device: torch.device, planned: int | None, step: Callable[[], int]
) -> Iterator[None]:
    """Turn torch.OutOfMemoryError inside the block into OutOfGPUMemory; `step()` is the step that was running
    (1-based). The newest complete checkpoint of train.output_dir is the one the message resumes from."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        held = (0, 0, 0)
        if device.type == "cuda":
            # The failed step's tensors are still referenced by the traceback's frames: these are its figures.
            total = torch.cuda.get_device_properties(device).total_memory
            held = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), total)
        found = checkpoint_dirs(config.train.output_dir)
        message = out_of_memory_message(
            config, job, step(), held, planned, found[-1] if found else None, list(sys.argv[1:])
        )
        raise OutOfGPUMemory(message) from exc
