"""Export a (possibly FSDP2-sharded) model as a Hugging Face folder that transformers and vLLM load as is."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from physreason.files import replace_folder
from physreason.models.loading import DTYPES

# Everything besides weights and config.json that a model folder carries and serving needs.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
)


def _side_file(source: str, name: str) -> Path | None:
    folder = Path(source)
    if folder.is_dir():
        path = folder / name
        return path if path.is_file() else None
    from transformers.utils import cached_file

    found = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
    return Path(found) if found else None


def export_safetensors(
    model: nn.Module,
    source: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    state: dict[str, torch.Tensor] | None = None,
    extra: Callable[[Path], None] | None = None,
    mark: Callable[[Path], None] | None = None,
) -> Path:
    """Gather full weights on rank 0 and write safetensors + config, copying tokenizer/processor files from source.

    Every rank must call this (the gather is collective); only rank 0 writes. dtype is the saved
    parameter dtype ('auto' keeps the training dtype). state: the full Hugging Face-named weights to
    write instead of the model's own (a LoRA model's merged weights; read on rank 0 only). extra: called on
    rank 0 with the staging folder to add more files (a PEFT adapter subfolder); mark: called on rank 0 with the
    staging folder before anything else is written into it (`physreason export`'s manifest, so even a cut-short
    folder is known as its own). The folder is written under a temporary name and renamed when complete.
    """
    out_dir = Path(out_dir)
    if state is None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        target = DTYPES.get(dtype)
        if target is not None:
            state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
        staging = out_dir.with_name(out_dir.name + ".tmp")
        if staging.is_symlink():
            staging.unlink()  # never written through: the staging folder is made anew
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if mark is not None:
            mark(staging)
        config = model.config
        saved_dtype = getattr(config, "dtype", None)
        if target is not None:
            config.dtype = target
        try:
            model.save_pretrained(staging, state_dict=state, safe_serialization=True)
        finally:
            config.dtype = saved_dtype
        for name in SIDE_FILES:
            path = _side_file(source, name)
            if path is not None:
                shutil.copy2(path, staging / name)
        if extra is not None:
            extra(staging)
        replace_folder(staging, out_dir)  # a link someone put in place of this folder: replaced, its target kept
    if dist.is_initialized():
        dist.barrier()
    return out_dir


def export_trained(
    model: nn.Module,
    peft_model: nn.Module | None,
    source: str,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    mark: Callable[[Path], None] | None = None,
) -> Path:
    """export_safetensors of a trained model; with LoRA (peft_model, the PeftModel around `model`) the merged model.

    A LoRA folder holds base + adapters merged under the plain Hugging Face names, so it loads like a full export,
    and, in its `adapter` subfolder, the PEFT adapter alone. Every rank must call this (gathers are collective).
    mark: see export_safetensors.
    """
    if peft_model is None:
        return export_safetensors(model, source, out_dir, dtype, mark=mark)
    from physreason.models.lora import adapter_state, merged_named_tensors, save_adapter

    # Gathered one tensor at a time on every rank (collective); kept on rank 0 alone.
    main = not dist.is_initialized() or dist.get_rank() == 0
    merged = {}
    for name, tensor in merged_named_tensors(model):
        if main:
            merged[name] = tensor.cpu()
    adapter = adapter_state(peft_model)

    def add_adapter(folder: Path) -> None:
        save_adapter(peft_model, folder / "adapter", adapter)

    return export_safetensors(model, source, out_dir, dtype, state=merged, extra=add_adapter, mark=mark)
