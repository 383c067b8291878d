"""The grouped (one Triton kernel a parameter group) bf16-state AdamW update: its tables on CPU, and its kernel in
Triton's interpreter against the eager step when Triton is installed (the GPU run is physreason gpu-check's
bf16-state-grouped check)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from physreason.train import adamw
from physreason.train.adamw import AdamWBF16State, chunk_table


def test_the_chunk_table_names_every_chunk_of_every_tensor_once_in_order():
    table = chunk_table([1, 4, 5, 12, 0, 3], chunk=4).reshape(-1, 2).tolist()
    assert table == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2], [5, 0]]
    assert chunk_table([], chunk=4).numel() == 0


def _bucket(*members: tuple[torch.Tensor, ...]) -> adamw._Bucket:
    bucket = adamw._Bucket()
    for tensors in members:
        bucket.add(tensors, tuple(t.data_ptr() for t in tensors))
    return bucket


def test_the_tables_follow_the_pointers_and_keep_the_chunks_when_only_a_pointer_moves():
    first = (torch.zeros(6), torch.ones(6), *(torch.zeros(6, dtype=torch.bfloat16) for _ in range(2)))
    second = (torch.zeros(3), torch.ones(3), *(torch.zeros(3, dtype=torch.bfloat16) for _ in range(2)))
    tables = adamw._Tables(_bucket(first, second), aligned=True)
    expected = [t.data_ptr() for t in first] + [6] + [t.data_ptr() for t in second] + [3]
    assert tables.pointers.tolist() == expected == tables.rows and tables.programs == 2
    assert _bucket(first, second).rows == tables.rows  # the next step finds the same tables
    moved = (first[0], first[1].clone(), first[2], first[3])  # a gradient re-allocated
    assert _bucket(moved, second).rows != tables.rows and _bucket(first).rows != tables.rows
    again = adamw._Tables(_bucket(moved, second), aligned=True, previous=tables)
    assert again.pointers.tolist()[1] == moved[1].data_ptr() and again.chunks is tables.chunks
    grown = (torch.zeros(7), torch.ones(7), *(torch.zeros(7, dtype=torch.bfloat16) for _ in range(2)))
    assert adamw._Tables(_bucket(grown, second), aligned=True, previous=tables).chunks is not tables.chunks


def test_the_bucket_key_takes_contiguous_float32_or_bfloat16_and_refuses_the_rest():
    def key(param: torch.Tensor, grad: torch.Tensor | None = None):
        grad = torch.ones_like(param) if grad is None else grad
        moments = [torch.zeros(param.shape, dtype=torch.bfloat16) for _ in range(2)]
        found = adamw._bucket_key((param, grad, *moments), 3.0)
        return None if found is None else found[0]

    assert key(torch.zeros(4, 8)) == (-1, torch.float32, torch.float32, True, 3.0)
    assert key(torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4, 8))[1:3] == (torch.bfloat16, torch.float32)
    assert key(torch.zeros(8, 4).t()) is None  # not contiguous: the per-parameter path
    assert key(torch.zeros(4, 8, dtype=torch.float16)) is None
    assert key(torch.zeros(4, 8), torch.ones(5, 8)) is None  # sizes that differ: the kernel would read past one
    assert key(torch.zeros(9)[1:])[3] is False  # a view 4 bytes into its storage: no vectorised loads


@pytest.fixture
def interpreted(monkeypatch):
    """The grouped kernel on host tensors under Triton's interpreter, with small blocks so both paths run."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton; TRITON_INTERPRET=1 runs its kernels on CPU)")
    from triton.runtime import interpreter

    if not hasattr(getattr(interpreter, "InterpreterBuilder", None), "cast_impl"):
        pytest.skip("this Triton's interpreter has no InterpreterBuilder.cast_impl to round float32 -> bfloat16 with")

    def fp_trunc(builder, source, dtype):
        # Triton's interpreter truncates float32 -> bfloat16; the GPU rounds to nearest even (LLVM's fptrunc), as torch
        if source.dtype.scalar != interpreter.tl.float32 or dtype.scalar != interpreter.tl.bfloat16:
            return builder.cast_impl(source, dtype)
        rounded = torch.from_numpy(source.data.copy()).to(torch.bfloat16).view(torch.int16).numpy().view("uint16")
        return interpreter.TensorHandle(rounded, dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_trunc", fp_trunc)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(adamw, "_GROUPED_ON_CPU", True)
    monkeypatch.setattr(adamw, "BLOCK", 64)
    monkeypatch.setattr(adamw, "ITERS", 2)
    monkeypatch.setattr(adamw, "_KERNELS", {})
    monkeypatch.delitem(sys.modules, "physreason.train.adamw_triton", raising=False)  # jit again, interpreted
    yield
    sys.modules.pop("physreason.train.adamw_triton", None)  # the interpreted kernel stays with this test


def test_the_grouped_kernel_computes_adamw_bf16_update_over_three_steps(interpreted):
    torch.manual_seed(0)
    shapes = [(3, 100), (128,), (5, 7), (0, 4), (40, 6)]  # full chunks of 128 and masked tails; an empty shard
    start = [torch.randn(s) for s in shapes] + [torch.randn(16, 10).to(torch.bfloat16), torch.randn(12, 9).t()]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    grouped = AdamWBF16State(
        [{"params": ours[:4]}, {"params": ours[4:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    eager = AdamWBF16State([{"params": theirs[:4]}, {"params": theirs[4:], "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1,
                           grouped=False)  # fmt: skip
    # the reference: adamw_bf16_update (what one compiled kernel a parameter runs) of each tensor, at its own step
    reference = [t.clone() for t in start]
    moments = [[torch.zeros(t.shape, dtype=torch.bfloat16) for _ in range(2)] for t in start]
    steps = [0] * len(start)
    for step in range(3):
        grads = [torch.randn(t.shape).to(t.dtype) for t in start]
        for index, (a, b, g) in enumerate(zip(ours, theirs, grads)):
            if step == 1 and index == 1:  # no gradient at step 2: its step count falls behind, its own bucket
                a.grad = b.grad = None
                continue
            a.grad, b.grad = g.clone(), g.clone()
            steps[index] += 1
            decay = 0.1 if index < 4 else 0.0
            scalars = (1e-2, 0.9, 0.999, 1e-8, decay, 1 - 0.9 ** steps[index], (1 - 0.999 ** steps[index]) ** 0.5)
            adamw.adamw_bf16_update(reference[index], g, *moments[index], *adamw._scalar_tensors(scalars, g.device))
        grouped.step()
        eager.step()
    # group 0, float32 weights: one launch a step, two at the last (steps 3 and 2); group 1: one launch each for the
    # float32 and the bfloat16 weight, a step; the transposed parameter went the per-parameter way
    assert grouped.grouped_launches == (1 + 1 + 2) + 3 * 2 and grouped.per_parameter_updates == 3
    for index, param in enumerate(ours[:-1]):
        # float32 rounding order (fused multiply-adds) may move a bf16 moment one unit in its last place (2**-8
        # relative), and a float32 weight then by about lr x 2**-8 a step: a wrong formula moves it by about lr
        rtol = 2**-6 if param.dtype == torch.bfloat16 else 0.0  # bfloat16 weights: a unit or two in the last place
        gap = (param.float() - reference[index].float()).abs().amax(dim=None) if param.numel() else 0.0
        assert torch.allclose(param.float(), reference[index].float(), rtol=rtol, atol=1e-2 * 2**-7), (index, gap)
        for key, expected in zip(("exp_avg", "exp_avg_sq"), moments[index]):
            assert grouped.state[param][key].dtype == torch.bfloat16
            assert torch.allclose(grouped.state[param][key].float(), expected.float(), rtol=2**-7, atol=1e-12)
    assert all(not torch.equal(a.detach(), s) for a, s in zip(ours, start) if a.numel())
    assert torch.equal(ours[-1], theirs[-1])  # not contiguous: the eager update, in both
    # the state dict is the per-parameter update's: same groups, keys, dtypes and steps
    mine, other = grouped.state_dict(), eager.state_dict()
    assert mine["param_groups"] == other["param_groups"]
    assert mine["state"].keys() == other["state"].keys()
    for key, state in mine["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
            k: (v.dtype, v.shape) for k, v in other["state"][key].items()
        }
        assert torch.equal(state["step"], other["state"][key]["step"])


def test_a_grouped_kernel_that_fails_to_build_falls_back_to_a_kernel_a_parameter_and_says_so(monkeypatch, caplog):
    def broken(tables, scalars):
        raise RuntimeError("no ptxas for this GPU")

    monkeypatch.setattr(adamw, "_GROUPED_ON_CPU", True)
    monkeypatch.setattr(adamw, "_KERNELS", {"found": True})
    monkeypatch.setattr(adamw, "grouped_adamw_bf16_update", broken)
    monkeypatch.setattr(adamw, "_compiled_update", lambda: adamw.adamw_bf16_update)  # the compiled kernel's math
    torch.manual_seed(0)
    start, grad = torch.randn(4, 6), torch.randn(4, 6)
    param = torch.nn.Parameter(start.clone())
    param.grad = grad.clone()
    optimizer = AdamWBF16State([param], lr=1e-2, weight_decay=0.1)
    optimizer.step()
    assert "grouped Triton update failed to build (RuntimeError: no ptxas" in caplog.text
    assert not optimizer.grouped and optimizer.grouped_launches == 0 and optimizer.per_parameter_updates == 1
    expected, moments = start.clone(), [torch.zeros(4, 6, dtype=torch.bfloat16) for _ in range(2)]
    scalars = (1e-2, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, (1 - 0.999) ** 0.5)
    adamw.adamw_bf16_update(expected, grad, *moments, *adamw._scalar_tensors(scalars, expected.device))
    assert torch.equal(param.detach(), expected) and torch.equal(optimizer.state[param]["exp_avg"], moments[0])
    optimizer.grouped, optimizer.grouped_launches = True, 1  # once a grouped kernel ran, a failure is an error
    with pytest.raises(RuntimeError, match="no ptxas"):
        optimizer.step()


def test_the_step_keeps_its_pointer_tables_while_the_gradients_stay_and_rebuilds_them_when_one_moves(monkeypatch):
    # the grouped path on host tensors with the launch recorded instead of run: only the host-side bookkeeping
    launched: list[list[int]] = []
    monkeypatch.setattr(adamw, "_GROUPED_ON_CPU", True)
    monkeypatch.setattr(adamw, "_KERNELS", {"found": True})
    monkeypatch.setattr(adamw, "grouped_adamw_bf16_update", lambda tables, scalars: launched.append(tables.rows))
    params = [torch.nn.Parameter(torch.zeros(4, 8)), torch.nn.Parameter(torch.zeros(8))]
    optimizer = AdamWBF16State([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}])
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.step()  # the same gradients: both groups' tables found again
    assert optimizer.table_builds == 2 and optimizer.grouped_launches == 4 and optimizer.per_parameter_updates == 0
    assert launched[2:] == launched[:2]
    moved = torch.ones_like(params[0])
    params[0].grad = moved  # zero_grad(set_to_none=True) and a backward: a gradient at a new address
    optimizer.step()
    assert optimizer.table_builds == 3  # the moved group's table only
    assert launched[-2][1] == moved.data_ptr() and launched[-1] == launched[1]
    assert optimizer.state[params[0]]["step"].item() == 3.0
