"""physreason/train/profiling.py on CPU: work placed in its phase (backward included) and sorted into categories."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from physreason.train import phases, profiling


class _Toy(nn.Module):
    """A model laid out like transformers' VL models: model.visual (the tower) inside model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.visual = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.model.decoder = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with phases.phase(phases.LANGUAGE_MODEL):
            hidden = self.model.decoder(torch.cat([self.model.visual(pixels), tokens]))  # [n, 32]
        with phases.phase(phases.LOSS):
            return nn.functional.cross_entropy(self.lm_head(hidden), targets)


def test_work_is_attributed_to_the_phase_whose_forward_made_it_backward_included(tmp_path):
    torch.manual_seed(0)
    model = _Toy()
    assert phases.mark_vision_tower(model) and phases.mark_vision_tower(model)  # hooks installed once
    optimizer = torch.optim.AdamW(model.parameters())
    pixels, tokens, targets = torch.randn(64, 32), torch.randn(64, 32), torch.randint(0, 64, (128,))
    with profiling.Profiled(tmp_path, "toy", torch.device("cpu")) as profiler:
        for _ in range(2):
            loss = model(pixels, tokens, targets)
            with phases.phase(phases.BACKWARD):
                loss.backward()
            with phases.phase(phases.OPTIMIZER):
                optimizer.step()
                optimizer.zero_grad()
            profiler.step()
    result = profiler.result
    assert (tmp_path / "toy.trace.json").is_file() and (tmp_path / "toy.profile.json").is_file()
    for phase in ("vision_tower", "language_model", "loss"):
        assert result.by_phase[f"{phase} (forward)"] > 0, phase
        assert result.by_phase[f"{phase} (backward)"] > 0, phase  # placed through autograd sequence numbers
    assert result.by_phase["optimizer (forward)"] > 0
    categories = result.by_category
    assert categories["vision tower"] > 0 and categories["loss/logits"] > 0 and categories["optimizer"] > 0
    assert categories["GEMMs"] > 0  # the decoder's linear, outside the tower and the loss
    assert categories["communication"] == 0
    assert sum(categories.values()) == pytest.approx(sum(result.by_phase.values()))
    text = profiling.format_breakdown(result, steps=2)
    assert "vision tower" in text and "ms/step" in text
    # Each phase category split once more by kind: the parts add up to the category, the tower's linears are GEMMs.
    for sort in ("vision tower", "loss/logits", "optimizer"):
        assert sum(result.inside[sort].values()) == pytest.approx(categories[sort]), sort
        assert sum(result.inside_top[sort].values()) == pytest.approx(categories[sort]), sort
    assert result.inside["vision tower"]["GEMMs"] > 0 and result.inside["vision tower"]["other"] > 0
    assert "GEMMs" not in result.inside  # the name-sorted categories are not split again
    shown = profiling.format_breakdown(result, steps=2, inside_share=0.0)
    assert "inside vision tower, by kind" in shown and "heaviest ops inside vision tower" in shown
    hidden = profiling.format_breakdown(result, steps=2, inside_share=1.01)
    assert "inside vision tower" not in hidden
    summary = profiling.summary_json(result, steps=2)["inside_ms_per_step"]["vision tower"]
    assert summary["by_kind"]["GEMMs"] == pytest.approx(result.inside["vision tower"]["GEMMs"] / 2e3)


@pytest.mark.parametrize(
    "name, phase, callers, expected",
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "language_model", (), "communication"),
        ("void at::native::elementwise_kernel<128, 4>", None, ("aten::copy_", "FSDP::all_gather_copy_out"),
         "communication"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "vision_tower", (), "vision tower"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "language_model", (), "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", None, (), "attention"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "language_model", (), "GEMMs"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward", "loss", (), "loss/logits"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer", (), "optimizer"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "language_model", (), "other"),
    ],
)  # fmt: skip
def test_kernels_fall_into_their_categories(name, phase, callers, expected):
    assert profiling.category(name, phase, callers) == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64", "attention"),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "GEMMs"),
        ("aten::addmm", "GEMMs"),
        ("void at::native::elementwise_kernel<128, 2>", "other"),
    ],
)
def test_kind_sorts_by_name_alone(name, expected):
    assert profiling.kind(name) == expected


def test_a_few_sft_steps_profiled_through_on_step_split_by_phase(tmp_path, tiny_model_dir):
    """The README's recipe: run_sft's on_step opens the window after a warm-up step and steps it; the tables fill."""
    from setups import sft_recipe, write_chat_records

    from physreason.train.sft import run_sft

    config = sft_recipe(tiny_model_dir, write_chat_records(tmp_path), tmp_path / "run", "train.max_steps=3",
                        "train.ckpt.enable_checkpoint=false", lr="1e-3", logger="[]")  # fmt: skip
    profiler = profiling.Profiled(tmp_path / "profile", "sft", torch.device("cpu"))
    seen = []

    def on_step(step: int) -> None:
        seen.append(step)
        if step == 1:
            profiler.__enter__()
        elif step > 1:
            profiler.step()
            if step == 3:
                profiler.__exit__(None, None, None)

    run_sft(config, on_step=on_step)
    assert seen == [1, 2, 3] and profiler.steps == 2
    result = profiler.result
    assert (tmp_path / "profile" / "sft.profile.json").is_file()
    for phase in ("language_model", "loss"):
        assert result.by_phase[f"{phase} (forward)"] > 0 and result.by_phase[f"{phase} (backward)"] > 0, phase
    assert result.by_category["optimizer"] > 0 and result.by_category["loss/logits"] > 0
    assert result.by_category["GEMMs"] > 0


def test_launches_are_counted_under_their_innermost_named_range():
    from torch.profiler import profile, record_function

    x = torch.ones(8)
    with profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with record_function("outer"):
            torch.add(x, 1)
            with record_function("inner"):
                torch.mul(x, 2)
                torch.mul(x, 3)
        torch.sub(x, 1)  # under neither range
    counts = profiling.launches_under(list(prof.events()), ("outer", "inner"), "cpu")
    assert counts == {"outer": 1, "inner": 2}


def _device_event(start: float, end: float, name: str = "kernel"):
    from types import SimpleNamespace

    return SimpleNamespace(device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=False, name=name,
                           time_range=SimpleNamespace(start=start, end=end))  # fmt: skip


def test_device_busy_is_the_union_of_device_intervals_beside_their_sum():
    """Overlapping device intervals (impossible on one stream) show as a sum above the time the device was busy."""
    events = [_device_event(0, 10), _device_event(5, 20), _device_event(30, 40), _device_event(32, 35),
              _device_event(0, 100, "ProfilerStep#1")]  # fmt: skip
    assert profiling.device_busy_us(events) == (38.0, 30.0, 15.0)
    assert profiling.device_busy_us(events[2:3]) == (10.0, 10.0, 10.0)
    assert profiling.device_busy_us([]) == (0.0, 0.0, 0.0)


def test_optimizer_steps_counts_torch_optims_step_ranges_in_the_window(tmp_path):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    with profiling.Profiled(tmp_path, "steps", torch.device("cpu"), echo=False) as profiler:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()
    assert profiling.optimizer_steps(list(profiler.profiler.events())) == 3


def test_gpu_kernels_of_the_other_kind_are_also_listed_by_the_op_that_launched_them():
    """On a GPU the generic kernels (elementwise, copies, cats: names that say little) are summed by their CPU op, in
    the whole step and inside a phase category; GEMM and attention kernels are not."""
    from types import SimpleNamespace

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def span(start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)

    def op(name: str, parent, start: float, kernels: list[tuple[str, float]]) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, device_type=cpu, sequence_nr=-1, thread=1, cpu_parent=parent, time_range=span(start, start + 5),
            kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels], is_user_annotation=False,
        )  # fmt: skip

    tower = op(phases.PREFIX + phases.VISION_TOWER, None, 0, [])
    tower.time_range = span(0, 100)
    ops = [
        tower,
        op("aten::copy_", tower, 10, [("void at::native::elementwise_kernel<128, 2>", 30.0)]),
        op("aten::mm", tower, 20, [("nvjet_sm90_tst_192x192", 50.0)]),
        op("aten::cat", None, 200, [("CatArrayBatchedCopy", 20.0)]),
        op("aten::copy_", None, 300, [("void at::native::elementwise_kernel<128, 2>", 5.0)]),
    ]
    kernels = [SimpleNamespace(name="k", device_type=cuda, time_range=span(0, d), is_user_annotation=False)
               for d in (30.0, 50.0, 20.0, 5.0)]  # fmt: skip
    result = profiling.breakdown(ops + kernels, "cuda")
    assert dict(result.other_ops) == {"aten::copy_": 35.0, "aten::cat": 20.0}
    assert dict(result.inside_other_ops["vision tower"]) == {"aten::copy_": 30.0}
    assert result.by_category["vision tower"] == 80.0 and result.unattributed_us == 0.0
    text = profiling.format_breakdown(result, steps=1, inside_share=0.0)
    assert "ops behind the 'other' kernels" in text and "ops behind 'other' inside vision tower" in text
    summary = profiling.summary_json(result, steps=1)
    assert summary["other_by_op_ms_per_step"] == {"aten::copy_": 0.035, "aten::cat": 0.02}
    assert summary["inside_ms_per_step"]["vision tower"]["other_by_op"] == {"aten::copy_": 0.03}
