"""torchrun worker for tests/test_weight_sync_gather.py: full_named_parameters on an FSDP2 policy over 2 gloo ranks.

argv: model kinds ("qwen2_5_vl,qwen3_vl"), output JSON path. Per kind every rank builds the tiny model twice (same
seed): one whole in this process, the other wrapped in CausalLMLoss and sharded by apply_fsdp2 with float32 masters,
as a run lays it out. Each walk is checked against the whole model cast to the push dtype and against the
per-parameter gather (each shard cast, then DTensor.full_tensor), name by name, bitwise, with its all-gathers counted
by CommDebugMode. Rank 0 writes, per kind and case, the checks and counts; the test asserts them.

Cases: "bf16" (param_dtype bf16, push dtype bf16) walks before the first forward (the root around the model is not
reachable yet), after a forward/backward, closed early and interrupted by an exception, and with the root left
gathered by a no-grad forward; the loss and gradients of a forward/backward after the walks must equal the ones
before. "fp32_push" (param_dtype bf16, dtype None: a gathered unit would be rounded) and "fp32_compute"
(param_dtype fp32, push bf16: gathered in fp32, then cast) walk once each, and so does "tp2" (tensor parallel over
both ranks, FSDP2 over a mesh of one: a unit's parameters stay DTensors on the tp mesh after its unshard).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from cp_worker import grads, text_sample, video_sample
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from physreason.data.collate import collate_padded
from physreason.models.parallelize import apply_fsdp2, apply_tensor_parallel, build_mesh, unit_param_groups
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer
from physreason.train.model import CausalLMLoss
from physreason.train.weight_sync import full_named_parameters


def per_parameter(model: torch.nn.Module, dtype: torch.dtype | None) -> list[tuple[str, torch.Tensor]]:
    """The gather before units: each shard cast to `dtype`, then gathered whole on its own."""
    out = []
    for name, parameter in model.named_parameters():
        tensor = parameter.detach() if dtype is None else parameter.detach().to(dtype)
        out.append((name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor))
    return out


def same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> bool:
    """Same names in the same order, same dtypes and shapes, bitwise-equal values, plain tensors."""
    return [n for n, _ in got] == [n for n, _ in want] and all(
        not isinstance(g, DTensor) and g.dtype == w.dtype and torch.equal(g, w)
        for (_, g), (_, w) in zip(got, want, strict=True)
    )


def units(wrapper: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in wrapper.modules() if isinstance(m, FSDPModule)]


def gathered(wrapper: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units whose parameters are unsharded now."""
    return [u for u in units(wrapper) if any(g.is_unsharded for g in unit_param_groups(u))]


def all_sharded(wrapper: torch.nn.Module) -> bool:
    groups = [g for u in units(wrapper) for g in unit_param_groups(u)]
    return all(g.is_sharded for g in groups) and all(isinstance(p, DTensor) for p in wrapper.parameters())


def counted(walk: Callable[[], list]) -> tuple[list, int]:
    """The walk's result and the all-gathers it made (FSDP2's unit gathers and DTensor's per-parameter ones)."""
    counter = CommDebugMode()
    with counter:
        result = walk()
    return result, counter.get_total_counts()


def walk_watching(wrapper: torch.nn.Module, walk: Iterator[tuple[str, torch.Tensor]]) -> tuple[list, int]:
    """Consume a walk, noting the most units gathered at once while a tensor is handed out."""
    out, most = [], 0
    for item in walk:
        most = max(most, len(gathered(wrapper)))
        out.append(item)
    return out, most


def loss_and_grads(wrapper: torch.nn.Module, model: torch.nn.Module, batch) -> tuple[float, dict[str, torch.Tensor]]:
    loss = wrapper(batch)
    loss.backward()
    result = float(loss), grads(model)
    wrapper.zero_grad(set_to_none=True)
    return result


def build(kind: str, param_dtype: torch.dtype, tp: int = 1) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(whole model, sharded model, its CausalLMLoss wrapper = the FSDP2 root), the same weights; `tp` > 1: tensor
    parallel over that many ranks first, FSDP2 over the rest, as a run lays it out."""
    tokenizer = build_tiny_tokenizer()
    whole = build_tiny_model(kind, tokenizer, seed=0)
    model = build_tiny_model(kind, tokenizer, seed=0).train()
    mesh = build_mesh("cpu", dist.get_world_size(), tp)
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    wrapper = CausalLMLoss(model)
    apply_fsdp2(wrapper, model, mesh["dp"], param_dtype=param_dtype)
    return whole, model, wrapper


def bf16_case(kind: str) -> dict:
    whole, model, wrapper = build(kind, torch.bfloat16)
    truth = [(n, p.detach().to(torch.bfloat16)) for n, p in whole.named_parameters()]
    blocks = units(model)  # every unit but the root (the wrapper)
    in_blocks = {id(p) for u in blocks for p in u.parameters()}
    root_params = sum(id(p) not in in_blocks for p in model.parameters())
    block_names = {n for n, p in model.named_parameters() if id(p) in in_blocks}

    def into_a_block(walk: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Take from the walk up to the first parameter of a block (the root's first ones come before it)."""
        taken = [next(walk)]
        while taken[-1][0] not in block_names:
            taken.append(next(walk))
        return taken

    result: dict = {
        "params": len(truth),
        "units": len(units(wrapper)),
        "blocks": len(blocks),
        "root_params": root_params,
    }

    walked, result["gathers_before_forward"] = counted(lambda: list(full_named_parameters(model, torch.bfloat16)))
    result["same_before_forward"] = same(walked, truth) and same(walked, per_parameter(model, torch.bfloat16))
    result["sharded_after_walk_before_forward"] = all_sharded(wrapper)
    walked, result["gathers_before_forward_root_given"] = counted(
        lambda: list(full_named_parameters(model, torch.bfloat16, fsdp_root=wrapper))
    )
    result["same_before_forward_root_given"] = same(walked, truth)
    result["sharded_after_walk_root_given"] = all_sharded(wrapper)

    samples = [video_sample(whole, 4, 3, 7, seed=1), text_sample(whole, 14, 6, seed=2)]
    batch = collate_padded(samples, build_tiny_tokenizer().pad_token_id, mrope=True)
    loss_before, grads_before = loss_and_grads(wrapper, model, batch)
    result["sharded_after_backward"] = all_sharded(wrapper)

    (walked, most), result["gathers"] = counted(
        lambda: walk_watching(wrapper, full_named_parameters(model, torch.bfloat16))
    )
    result["same"] = same(walked, truth) and same(walked, per_parameter(model, torch.bfloat16))
    result["most_gathered_at_once"] = most
    result["sharded_after_walk"] = all_sharded(wrapper)

    walk = full_named_parameters(model, torch.bfloat16)
    first = into_a_block(walk)
    result["gathered_mid_walk"] = len(gathered(wrapper))
    walk.close()
    result["sharded_after_close"] = all_sharded(wrapper)
    result["same_prefix_before_close"] = same(first, truth[: len(first)])

    walk = full_named_parameters(model, torch.bfloat16)
    into_a_block(walk)
    try:
        walk.throw(RuntimeError("the consumer failed"))
    except RuntimeError as error:
        result["raised"] = str(error)
    result["sharded_after_exception"] = all_sharded(wrapper)

    loss_after, grads_after = loss_and_grads(wrapper, model, batch)
    result["loss_before"], result["loss_after"] = loss_before, loss_after
    result["grads_equal"] = grads_before.keys() == grads_after.keys() and all(
        torch.equal(grads_before[n], grads_after[n]) for n in grads_before
    )
    result["grads"] = len(grads_before)

    with torch.no_grad():
        wrapper(batch)  # an FSDP2 root keeps its parameters gathered after a forward until a backward reshards them
    result["gathered_before_walk_after_nograd_forward"] = len(gathered(wrapper))
    walked = list(full_named_parameters(model, torch.bfloat16))
    result["same_with_root_left_gathered"] = same(walked, per_parameter(model, torch.bfloat16))
    result["gathered_after_walk_after_nograd_forward"] = len(gathered(wrapper))
    wrapper.reshard()
    return result


def one_walk_case(kind: str, param_dtype: torch.dtype, dtype: torch.dtype | None, tp: int = 1) -> dict:
    whole, model, wrapper = build(kind, param_dtype, tp)
    truth = [(n, p.detach() if dtype is None else p.detach().to(dtype)) for n, p in whole.named_parameters()]
    walked, gathers = counted(lambda: list(full_named_parameters(model, dtype)))
    same_values = same(walked, truth) and same(walked, per_parameter(model, dtype))
    return {"same": same_values, "gathers": gathers, "sharded_after_walk": all_sharded(wrapper)}


def main() -> None:
    kinds, out = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    results = {
        kind: {
            "bf16": bf16_case(kind),
            "fp32_push": one_walk_case(kind, torch.bfloat16, None),
            "fp32_compute": one_walk_case(kind, torch.float32, torch.bfloat16),
            "tp2": one_walk_case(kind, torch.bfloat16, torch.bfloat16, tp=2),
        }
        for kind in kinds
    }
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
