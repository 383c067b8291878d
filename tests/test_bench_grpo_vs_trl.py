"""bench/grpo_vs_trl.py on CPU: its arguments, the prompts both sides get, its timers and summary.

The script's own `--tiny` dry run (five runs in fresh processes, TRL among them) takes one to two minutes on two
cores, too long for a unit test; these tests cover what it computes before and after the runs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from physreason.config import DatasetConfig, ModelConfig
from physreason.data.mcq import load_mcq_prompts

BENCH_FILE = Path(__file__).resolve().parents[1] / "bench" / "grpo_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grpo_vs_trl", BENCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prepared(bench, tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("grpo-vs-trl")
    return work, bench.prepare_data(work, tiny_model_dir, clips=2, text_words=12, tiny=True, workers=1)


def test_sizes_default_to_the_gpu_or_tiny_run_and_flags_win(bench):
    gpu = bench.parse_args([])
    assert (gpu.prompts, gpu.n, gpu.response_len, gpu.mini_batch, gpu.steps) == (8, 8, 256, 8, 3)
    assert gpu.workloads == ["video", "image", "text"] and gpu.sides == ["trl", "physreason"]
    tiny = bench.parse_args(["--tiny", "--response-len", "5", "--workloads", "text"])
    assert (tiny.prompts, tiny.n, tiny.response_len, tiny.warmup) == (2, 2, 5, 0)
    assert tiny.workloads == ["text"]
    assert gpu.checkpoint_every == "1" and bench.parse_args(["--checkpoint-every", "03"]).checkpoint_every == "3"
    assert bench.parse_args(["--checkpoint-every", "auto"]).checkpoint_every == "auto"
    # a compiled GPU run leaves its compiling and recompiling steps untimed unless --warmup says otherwise
    assert gpu.warmup == 1 and bench.parse_args(["--compile"]).warmup == bench.COMPILE_WARMUP == 3
    assert bench.parse_args(["--compile", "--warmup", "1"]).warmup == 1
    assert bench.parse_args(["--compile", "--tiny"]).warmup == 0
    assert not gpu.trl_no_recompute and bench.parse_args(["--trl-no-recompute"]).trl_no_recompute


def test_the_first_line_says_what_each_side_recomputes(bench):
    gpu = {"bf16": True, "recompute": True}
    assert bench.recompute_words(gpu) == "physreason every block, TRL every block"
    assert bench.recompute_words({**gpu, "checkpoint_every": "auto", "trl_no_recompute": True}) == (
        "physreason blocks as its plan chooses (checkpoint_every auto), TRL nothing"
    )
    assert bench.recompute_words({**gpu, "checkpoint_every": "4"}) == (
        "physreason one block in 4 (checkpoint_every 4), TRL every block"
    )
    assert bench.recompute_words({**gpu, "recompute": False}) == "physreason nothing, TRL nothing"
    assert bench.recompute_words({"bf16": False}) == "physreason nothing, TRL nothing"  # CPU: neither side


@pytest.mark.parametrize(
    "argv",
    [["--workloads", "audio"], ["--sides", "verl"], ["--n", "1"], ["--prompts", "3", "--mini-batch", "5"],
     ["--checkpoint-every", "0"], ["--checkpoint-every", "often"]],
)
def test_bad_arguments_are_usage_errors(bench, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("frames", [12, 7])
def test_contact_sheet_has_one_tile_per_temporal_patch(bench, frames):
    clip = np.arange(frames, dtype=np.uint8)[:, None, None, None] * np.ones((1, 56, 84, 3), dtype=np.uint8)
    sheet = bench.contact_sheet(clip)  # [rows*56, cols*84, 3]
    tiles = -(-frames // 2)
    rows, cols = sheet.shape[0] // 56, sheet.shape[1] // 84
    assert rows * cols == tiles and sheet.shape[0] % 56 == 0 and sheet.shape[1] % 84 == 0
    firsts = sorted(int(sheet[r * 56, c * 84, 0]) for r in range(rows) for c in range(cols))
    assert firsts == list(range(0, frames, 2))  # each temporal patch's first frame, once


def test_workloads_ask_the_same_questions_and_the_sheet_matches_the_clip_tokens(prepared):
    work, data = prepared
    assert data["clips"] == 2
    assert data["image_tokens"] == data["video_tokens"] > 0
    by_workload = {name: load_mcq_prompts(DatasetConfig(name=path)) for name, path in data["files"].items()}
    video, image, text = by_workload["video"], by_workload["image"], by_workload["text"]
    assert [len(p.videos) for p in video] == [1, 1] and [len(p.images) for p in image] == [1, 1]
    assert not any(p.videos or p.images for p in text)
    for v, i, t in zip(video, image, text, strict=True):
        assert v.question == i.question and t.question.endswith(". " + v.question)
        assert v.options == i.options == t.options and v.answer == i.answer == t.answer
        assert v.videos[0].is_relative_to(work) and i.images[0].is_relative_to(work)


def test_summary_takes_medians_after_warmup_and_shares_of_the_step(bench):
    def step(seconds, generate):
        return {
            "step_s": seconds,
            "generate_s": generate,
            "score_s": 0.0,
            "train_s": seconds - generate - 0.5,
            "sync_s": 0.5,
            "samples": 8,
            "prompt_tokens": 800.0,
            "completion_tokens": 160.0,
        }

    summary = bench.summarise([step(100.0, 90.0), step(4.0, 1.0), step(2.0, 1.0), step(3.0, 1.0)], warmup=1)
    assert summary["step_s"] == 3.0 and summary["samples_per_s"] == pytest.approx(8 / 3)
    assert summary["tokens_per_s"] == pytest.approx(960 / 3)
    assert summary["completion_tokens_per_sample"] == 20.0
    assert summary["generate_share"] == pytest.approx(1 / 3) and summary["sync_share"] == pytest.approx(0.5 / 3)
    with pytest.raises(ValueError, match="no timed step"):
        bench.summarise([step(1.0, 0.5)], warmup=1)


def test_sections_count_each_wrapped_call_without_its_wrapped_callees(bench, monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))

    class Trainer:
        def outer(self):
            return self.inner() + 1

        def inner(self):
            return 1

    trainer, sections, seen = Trainer(), bench.Sections(), []
    sections.wrap(trainer, "outer", "score", after=seen.append)
    sections.wrap(trainer, "inner", "generate")
    assert trainer.outer() == 2 and seen == [2]
    # outer runs from t=0 to t=3, inner from t=1 to t=2: score gets 3 - 1, generate 1.
    assert dict(sections.totals) == {"generate": 1.0, "score": 2.0}


def test_trl_reward_is_physreasons_accuracy_plus_format(bench):
    good = "<think>\nit rolls back\n</think>\n\n<answer>\nA\n</answer>"
    rewards = bench.mcq_total_reward(
        [[{"role": "assistant", "content": good}], [{"role": "assistant", "content": "B"}]],
        answer=["A", "A"],
        options=[json.dumps({"A": "forwards", "B": "backwards"})] * 2,
    )
    assert rewards == [2.0, 0.0]


def test_physreason_config_sets_the_shared_recipe(bench, prepared, tmp_path):
    _, data = prepared
    spec = {
        "model": "m",
        "engine": "hf",
        "bf16": False,
        "gpu_memory": 0.3,
        "data": data,
        "prompts": 2,
        "n": 4,
        "response_len": 16,
        "mini_batch": 4,
        "mini_batch_tokens": 300,
        "steps": 2,
        "warmup": 1,
    }
    config = bench.physreason_config(spec, "video", tmp_path)
    assert config.rollout.sampling_config.ignore_eos and config.rollout.max_response_length == 16
    assert config.rollout.sampling_config.suppress_vision_tokens
    assert config.train.train_batch_per_replica == 8 and config.train.max_steps == 3
    assert (config.grpo.loss_agg_mode, config.grpo.kl_beta, config.grpo.mu_iterations) == ("token-mean", 0.0, 1)
    assert config.vision.fps == data["vision"]["fps"] and config.data.dataset.name == data["files"]["video"]
    assert (config.grpo.pack_completions, config.grpo.mini_batch, config.grpo.mini_batch_tokens) == (True, 8, 300)
    padded = bench.physreason_config(spec, "video", tmp_path, packed=False)
    assert (padded.grpo.pack_completions, padded.grpo.mini_batch, padded.grpo.mini_batch_tokens) == (False, 4, 0)
    # --no-recompute reaches both sides through the spec; without the key (older specs) recompute follows bf16
    assert not config.train.gradient_checkpointing
    for recompute in (True, False):
        spec_r = {**spec, "recompute": recompute}
        assert bench.physreason_config(spec_r, "video", tmp_path).train.gradient_checkpointing is recompute
    # --trl-no-recompute turns TRL's recomputation off, not physreason's
    trl_keeps = {**spec, "recompute": True, "trl_no_recompute": True}
    assert bench.physreason_config(trl_keeps, "text", tmp_path).train.gradient_checkpointing
    # --packed-attention reaches the packed side only (the padded side has no packed rows); the default is the mask
    assert config.grpo.packed_attention == "mask"
    spans = {**spec, "packed_attention": "spans"}
    assert bench.physreason_config(spans, "video", tmp_path).grpo.packed_attention == "spans"
    assert bench.physreason_config(spans, "video", tmp_path, packed=False).grpo.packed_attention == "mask"
    # --checkpoint-every reaches physreason's train.checkpoint_every (TRL recomputes every block or none)
    assert config.train.checkpoint_every == 1
    for every, expected in (("3", 3), ("auto", "auto")):
        assert bench.physreason_config({**spec, "checkpoint_every": every}, "text", tmp_path).train.checkpoint_every == expected
    # --compile: the decoder blocks on every workload, the vision blocks where there are visuals; off without it
    assert not (config.train.compile or config.train.compile_vision)
    for workload, vision in (("video", True), ("image", True), ("text", False)):
        compiled = bench.physreason_config({**spec, "compile": True}, workload, tmp_path).train
        assert compiled.compile and compiled.compile_vision is vision


def test_ratios_compare_each_physreason_side_with_trl_and_video_with_trl_images(bench):
    def row(workload, side, samples_per_s):
        return {"workload": workload, "side": side, "summary": {"samples_per_s": samples_per_s}}

    rows = [row("video", "physreason", 6.0), row("video", "physreason-padded", 3.0), row("image", "trl", 2.0)]
    rows += [row("image", "physreason", 8.0), {"workload": "text", "side": "trl", "error": "exit code 1"}]
    assert bench.samples_per_s_ratios(rows) == {
        "physreason image / trl image": 4.0,
        "physreason video / trl image": 3.0,
        "physreason-padded video / trl image": 1.5,
        "physreason video / physreason-padded video": 2.0,
    }


@pytest.mark.slow
def test_trl_gets_the_prompt_tokens_physreason_renders(bench, prepared, tiny_model_dir):
    pytest.importorskip("trl")
    from trl.data_utils import prepare_multimodal_messages

    from physreason.models import loading
    from physreason.models.inputs import encode_visuals, expand_vision_placeholders, load_processor_params
    from physreason.train.rollout import mcq_request

    _, data = prepared
    spec = {"data": data}
    processor = bench.trl_processor(str(tiny_model_dir))
    tokenizer = loading.load_tokenizer(ModelConfig(model_name_or_path=str(tiny_model_dir)))
    params = load_processor_params(str(tiny_model_dir))
    vision = bench.vision_settings(tiny=True)
    for workload in ("image", "text"):
        rows = bench.trl_dataset(spec, workload)
        prompts = load_mcq_prompts(DatasetConfig(name=data["files"][workload]))
        for row, prompt in zip(rows, prompts, strict=True):
            images = [row["image"]] if "image" in row else []
            messages = prepare_multimodal_messages(row["prompt"], images=images)
            theirs = processor.apply_chat_template(
                [messages], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"][0]
            request = mcq_request(prompt, vision)
            visuals = encode_visuals(request.images, request.videos, params)
            text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
            text = expand_vision_placeholders(text, visuals.image_token_counts, visuals.video_token_counts)
            assert list(theirs) == tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_trl_never_samples_the_vision_tokens_physreason_suppresses(bench, prepared, tmp_path, engine):
    _, data = prepared
    spec = {
        "model": "m", "work": str(tmp_path), "engine": engine, "bf16": False, "gpu_memory": 0.3, "data": data,
        "prompts": 2, "n": 2, "response_len": 16, "mini_batch": 2, "steps": 1, "warmup": 0,
        "vision_token_ids": [3, 5],
    }  # fmt: skip
    kwargs = bench.trl_config(spec, tmp_path).generation_kwargs
    assert not bench.trl_config(spec, tmp_path).gradient_checkpointing
    assert bench.trl_config({**spec, "recompute": True}, tmp_path).gradient_checkpointing
    # --trl-no-recompute: TRL keeps its activations while physreason still recomputes
    assert not bench.trl_config({**spec, "recompute": True, "trl_no_recompute": True}, tmp_path).gradient_checkpointing
    assert not bench.trl_config(spec, tmp_path).torch_compile  # --compile: both sides, or neither
    assert bench.trl_config({**spec, "compile": True}, tmp_path).torch_compile
    if engine == "vllm":
        assert kwargs == {"ignore_eos": True, "logit_bias": {3: -100.0, 5: -100.0}}
    else:
        assert kwargs == {"min_new_tokens": 16, "suppress_tokens": [3, 5]}


def test_trl_policy_gets_physreasons_grouped_vision_attention_with_the_same_output(bench, tiny_model_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    from physreason.models import loading
    from physreason.models.patch_embed import LinearPatchEmbed

    assert bench.parse_args([]).trl_vision_attention == "varlen"
    # The model as TRL builds it (its own from_pretrained), then switched as run_trl switches it.
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tower = model.model.visual
    grid = torch.tensor([[2, 8, 12]])  # one 2-frame patch of 8 x 12 patches: several windows
    patches = torch.randn(int(grid.prod()), tower.config.in_channels * 2 * tower.config.patch_size**2)
    with torch.no_grad():
        native_out = tower(patches, grid_thw=grid).pooler_output
    assert bench.set_vision_attention(model, "native") == "sdpa per-window loop"
    assert not isinstance(tower.patch_embed, LinearPatchEmbed)  # native: transformers' Conv3d
    assert bench.set_vision_attention(model, "varlen") == "grouped sdpa (varlen)"
    assert isinstance(tower.patch_embed, LinearPatchEmbed)  # varlen: the patch embedding as physreason runs it
    with torch.no_grad():
        grouped_out = tower(patches, grid_thw=grid).pooler_output
    torch.testing.assert_close(grouped_out, native_out, rtol=1e-5, atol=1e-5)
    # physreason's own loader gives its policy the same attention.
    ours = loading.load_model(ModelConfig(model_name_or_path=str(tiny_model_dir)), torch.float32)
    assert bench.vision_attention_of(ours) == "grouped sdpa (varlen)"
    assert isinstance(ours.model.visual.patch_embed, LinearPatchEmbed)
    assert bench.vision_attention_of(torch.nn.Linear(2, 2)) == "no vision tower"


def _run(workload, side, round_index, seconds, ok=True):
    steps = [{"step_s": s, "samples": 64, "prompt_tokens": 500, "completion_tokens": 500, "generate_s": s / 2,
              "score_s": 0.0, "train_s": s / 2, "sync_s": 0.0} for s in seconds]  # fmt: skip
    return {"workload": workload, "side": side, "round": round_index, "ok": ok, "steps": steps, "peak_gib": 10.0,
            "setup_s": 5.0, "vision_attention": "grouped sdpa (varlen)"}  # fmt: skip


def test_append_pools_the_rounds_of_earlier_calls_and_refuses_another_setup(bench, tmp_path, monkeypatch):
    args = bench.parse_args(["--workloads", "text", "--append"])
    setup = {"device": "NVIDIA H200", "engine": "vllm", "data": {"clips": 32}, "args": bench.setup_args(args)}
    path = tmp_path / "grpo_vs_trl.json"
    assert bench.earlier_runs(path, setup) == []  # no file yet: the first call starts the pool
    earlier = [_run("text", "trl", 0, [9.0, 5.0, 5.5, 5.0]), _run("text", "physreason", 0, [9.0, 3.0, 3.5, 3.0])]
    path.write_text(json.dumps({"device": "NVIDIA H200", "engine": "vllm", "data": {"clips": 32},
                                "setup": bench.setup_args(args), "runs": earlier}))  # fmt: skip
    assert bench.earlier_runs(path, setup) == earlier

    # a second call's round, pooled with the first: medians over every timed step (the warm-up step left out)
    runs = [*earlier, _run("text", "physreason", 1, [9.0, 2.5, 2.5, 2.5]), _run("text", "trl", 1, [9.0, 6.0, 6.0, 6.0])]
    rows = bench.table_rows(runs, ["text"], ["trl", "physreason"], warmup=1)
    assert [r["summary"]["step_s"] for r in rows] == [pytest.approx(5.75), pytest.approx(2.75)]

    for other in ({**setup, "device": "NVIDIA H100 80GB HBM3"},
                  {**setup, "args": {**setup["args"], "trl_vision_attention": "native"}}):  # fmt: skip
        with pytest.raises(SystemExit, match="--append: .* was measured with another"):
            bench.earlier_runs(path, other)
    with pytest.raises(SystemExit, match=r"another args \(\{'trl_vision_attention': 'varlen'\}, this call \{'trl_vision_attention': 'native'\}\)"):
        bench.earlier_runs(path, {**setup, "args": {**setup["args"], "trl_vision_attention": "native"}})
    with pytest.raises(SystemExit, match="--append needs the JSON's place"):
        bench.earlier_runs(None, setup)
    # a JSON written before --compile existed pools with uncompiled calls only
    old_setup = {k: v for k, v in bench.setup_args(args).items() if k != "compile"}
    path.write_text(json.dumps({"device": "NVIDIA H200", "engine": "vllm", "data": {"clips": 32}, "setup": old_setup,
                                "runs": earlier}))  # fmt: skip
    assert bench.earlier_runs(path, setup) == earlier
    compiled = bench.setup_args(bench.parse_args(["--workloads", "text", "--append", "--compile"]))
    with pytest.raises(SystemExit, match=r"another args \(\{'compile': False, 'warmup': 1\}, this call \{'compile': True, 'warmup': 3\}\)"):
        bench.earlier_runs(path, {**setup, "args": compiled})
    # nor with a call where TRL keeps its activations
    trl_keeps = bench.setup_args(bench.parse_args(["--workloads", "text", "--append", "--trl-no-recompute"]))
    with pytest.raises(SystemExit, match=r"another args \(\{'trl_no_recompute': False\}, this call \{'trl_no_recompute': True\}\)"):
        bench.earlier_runs(path, {**setup, "args": trl_keeps})
    # nor across allocator settings (the default allocator ran out of memory where expandable segments did not)
    expandable = {**setup, "allocator": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}
    with pytest.raises(SystemExit, match=r"another allocator \(None, this call 'PYTORCH_CUDA_ALLOC_CONF=expandable"):
        bench.earlier_runs(path, expandable)
    path.write_text(json.dumps({"device": "NVIDIA H200", "engine": "vllm", "data": {"clips": 32}, "runs": earlier,
                                "setup": bench.setup_args(args), "allocator": expandable["allocator"]}))  # fmt: skip
    assert bench.earlier_runs(path, expandable) == earlier
