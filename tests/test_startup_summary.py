"""The start-up summary of infer, eval, sft and grpo (printed before the work), and what eval reports say about
the run that made them: system prompt, a local model's content hash, chance, the IoU rule, the folder's task type."""

from __future__ import annotations

import json

import pytest
from media import write_clip
from setups import grpo_recipe, sft_overrides
from typer.testing import CliRunner

from physreason.cli.app import app
from physreason.config import load_config
from physreason.eval import collect_reports, markdown_report, settings_header
from physreason.eval.benchmark import Benchmark, EvalSample
from physreason.eval.results import run_dir, write_run_info

BOX = json.dumps({"box_2d": [100, 200, 300, 400], "label": "ball"})


def summary_block(text: str, title: str) -> dict[str, str]:
    """The `name: value` lines under the summary's title line."""
    lines = text.splitlines()
    start = lines.index(title)
    block = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or ":" not in line:
            break
        name, value = line.strip().split(":", 1)
        block[name] = value.strip()
    return block


def test_infer_print_prompt_starts_with_model_family_style_mode_dtype_and_sampling(tiny_model_dirs):
    model = tiny_model_dirs["qwen3_vl"]
    result = CliRunner().invoke(
        app, ["infer", "-m", str(model), "-q", "Is it falling?", "--engine", "hf", "--print-prompt", "--max-tokens", "64"]
    )
    assert result.exit_code == 0, result.output
    block = summary_block(result.stdout, "physreason infer")
    assert block["model"] == f"{model.resolve()} (local folder)"
    assert block["family"] == "Qwen3-VL (Cosmos-Reason2)"
    assert block["prompt"] == "reason2, reasoning off"
    assert block["device"].startswith("bfloat16 on ") and block["device"].endswith(", engine hf")
    # Cosmos-Reason2's non-reasoning defaults, with the flag's max_tokens
    assert block["sampling"] == (
        "temperature 0.7, top_p 0.8, top_k 20, repetition 1, presence 1.5, frequency 0, max_tokens 64, seed 3407"
    )
    assert result.stdout.index("physreason infer") < result.stdout.index("<|im_start|>")  # before the prompt


def test_infer_json_keeps_stdout_for_the_json_and_puts_the_summary_on_stderr(tiny_model_dirs):
    args = ["infer", "-m", str(tiny_model_dirs["qwen2_5_vl"]), "-q", "Is it falling?", "--engine", "hf", "--json",
            "--max-tokens", "2", "--no-reasoning", "--set", "model.dtype='float32'"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outputs"]  # stdout is the JSON alone
    block = summary_block(result.stderr, "physreason infer")
    assert block["prompt"] == "reason1, reasoning off" and block["device"].startswith("float32 on ")
    assert block["sampling"].startswith("temperature 0.6, top_p 0.95, top_k -1, repetition 1.05")


def write_grounding_benchmark(root, clips: int = 2):
    folder = root / "balls"
    for i in range(clips):
        write_clip(folder / f"c{i}.mp4", n_frames=4, seed=i)
    records = [{"video": f"c{i}.mp4", "qa_pairs": {"question": "Where is the ball? Answer with box_2d JSON.",
                                                    "answer": BOX}} for i in range(clips)]
    (folder / "balls_benchmark_qa_pairs.json").write_text(json.dumps(records))


def test_eval_summary_comes_first_and_the_report_names_system_prompt_hash_chance_and_the_iou_rule(
    tiny_model_dirs, tmp_path
):
    from physreason.eval.settings import model_fingerprint

    model = tiny_model_dirs["qwen2_5_vl"]
    write_grounding_benchmark(tmp_path / "bench")
    args = ["eval", "-m", str(model), "--benchmark-root", str(tmp_path / "bench"), "-d", "balls", "--engine", "hf",
            "--results-dir", str(tmp_path / "r"), "--no-reasoning", "--num-repeats", "2", "--seed", "5",
            "--set", "model.dtype='float32'", "--set", "generation.max_tokens=2", "--set", "vision.max_frames=2", "--set", "vision.min_frames=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.stdout
    block = summary_block(out, "physreason eval")
    fingerprint = model_fingerprint(model)
    assert block["model"] == f"{model.resolve()} (local folder, content hash {fingerprint})"
    assert block["family"] == "Qwen2.5-VL (Cosmos-Reason1)"
    assert block["prompt"] == "reason1, reasoning off, system prompt 'Answer the questions.' (the style's)"
    assert block["seeds"] == "5, 6" and block["data sets"] == "balls (2 questions)"
    # a grounding data set without reasoning: its folder says so, not "letter"
    assert block["results"] == str(tmp_path / "r" / model.name / "grounding")
    assert out.index("physreason eval") < out.index("answered,")  # before the run, not after
    # each repeat's progress names its own seed
    assert "balls seed 5" in out and "balls seed 6" in out

    report = CliRunner().invoke(app, ["eval", "report", str(tmp_path / "r")])
    assert report.exit_code == 0, report.output
    assert "accuracy % (IoU >= 0.5)" in report.stdout
    text = (tmp_path / "r" / "report.md").read_text()
    assert f"- model: {model.resolve()} (local folder, content hash {fingerprint})" in text
    assert "@ default branch" not in text
    assert "system prompt 'Answer the questions.' (the style's)" in text
    assert f"### {model.name} (grounding)" in text
    assert "| chance % | accuracy % (IoU >= 0.5) | mean IoU % |" in text


def test_report_markdown_shows_chance_beside_accuracy(tmp_path):
    run = run_dir(tmp_path / "m" / "letter", "av", 1)
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text(
        "".join(json.dumps({"id": f"q{i}", "is_correct": i < 3, "prediction": "A"}) + "\n" for i in range(4))
    )
    write_run_info(run, {"dataset": "av", "seed": 1, "total": 4, "chance": 0.25})
    table = markdown_report(collect_reports(tmp_path)).split("## Accuracy\n\n", 1)[1].splitlines()
    assert table[0] == (
        "| model | answer type | dataset | repeats | samples | failed | missing | unparsed | chance % | accuracy % |"
    )
    assert table[2] == "| m | letter | av | 1 | 4 | 0 | 0 | 0 | 25.00 | 75.00 |"


def test_header_of_older_results_keeps_its_lines(tmp_path):
    # run.json written before the content hash and the resolved system prompt were recorded
    run = run_dir(tmp_path / "m" / "letter", "av", 1)
    run.mkdir(parents=True)
    (run / "results.jsonl").write_text(json.dumps({"id": "q0", "is_correct": True}) + "\n")
    settings = {"model": "nvidia/Cosmos-Reason2-8B", "model_revision": None, "prompt_style": "reason2",
                "reasoning": False, "system_prompt": None, "seed": 1}
    write_run_info(run, {"dataset": "av", "seed": 1, "total": 1, "settings": settings})
    header = dict(settings_header(collect_reports(tmp_path)))
    assert header["model"] == "nvidia/Cosmos-Reason2-8B @ default branch"
    assert header["prompt"] == "reason2, reasoning off"


def test_model_fingerprint_follows_the_folder_content_not_its_path(tmp_path, tiny_model_dir):
    import shutil

    from physreason.eval.settings import model_fingerprint

    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert model_fingerprint(copy) == model_fingerprint(tiny_model_dir)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"physreason_test": 1}))
    assert model_fingerprint(copy) != model_fingerprint(tiny_model_dir)


def sample(answer: str | None = None, options: dict | None = None, error: str | None = None) -> EvalSample:
    return EvalSample(id="c#0", video="c.mp4", question="?", options=options, answer=answer or "", error=error)


@pytest.mark.parametrize(
    ("answer_type", "samples", "label"),
    [
        ("reasoning", [sample(BOX)], "reasoning"),
        ("letter", [sample("A", {"A": "x", "B": "y"})], "letter"),
        ("letter", [sample(BOX), sample(error="corrupt clip")], "grounding"),
        ("letter", [sample(json.dumps({"point_2d": [5, 6]}))], "grounding"),
        ("letter", [sample(json.dumps({"start": "00:01.00", "end": "00:02.50"}))], "localization"),
        ("letter", [sample(BOX), sample("A", {"A": "x", "B": "y"})], "grounding-letter"),
        ("letter", [], "letter"),
    ],
)
def test_results_folder_of_a_run_without_reasoning_is_named_by_task_type(tmp_path, answer_type, samples, label):
    from physreason.eval.launch import results_label

    assert results_label(answer_type, [Benchmark("b", tmp_path, samples)]) == label


def test_sft_summary_names_model_family_style_and_detected_data_format(tiny_model_dirs, tmp_path, capsys):
    from physreason.train.sft import run_sft

    data = tmp_path / "llava.jsonl"
    turns = [{"from": "human", "value": "Does it fall?"}, {"from": "gpt", "value": "yes"}]
    data.write_text("".join(json.dumps({"conversations": turns}) + "\n" for _ in range(4)))
    model = tiny_model_dirs["qwen3_vl"]
    overrides = [*sft_overrides(model, data, tmp_path / "run", "1e-3", "[]"), "train.max_steps=1",
                 "train.ckpt.enable_checkpoint=false", "train.ckpt.export_safetensors=false", "data.val_fraction=0"]
    run_sft(load_config(None, overrides))
    block = summary_block(capsys.readouterr().out, "physreason sft")
    assert block["model"] == f"{model.resolve()} (local folder)"
    assert block["family"] == "Qwen3-VL (Cosmos-Reason2)"
    assert block["prompt"] == "reason2; records without a system turn get 'You are a helpful assistant.'"
    assert block["data"] == f"{data}: 4 records; LLaVA/ShareGPT from/value turns under 'conversations'"
    assert block["device"].startswith("float32 compute on ")
    assert (block["steps"], block["output"]) == ("1", str(tmp_path / "run"))


def test_grpo_summary_names_prompts_answer_type_and_rollout_sampling(tiny_text, mcq_file, tmp_path, capsys):
    from physreason.train.grpo import run_grpo

    recipe = grpo_recipe(tiny_text, mcq_file, tmp_path / "run", "train.max_steps=1", "train.ckpt.enable_checkpoint=false",
                         "train.ckpt.export_safetensors=false", lr="1e-3")
    run_grpo(recipe)
    block = summary_block(capsys.readouterr().out, "physreason grpo")
    assert block["model"] == f"{tiny_text.resolve()} (local folder)"
    assert block["prompt"] == f"reason1, answer type {recipe.grpo.answer_type}"
    assert block["data"] == f"{mcq_file}: 8 prompts"
    assert block["sampling"].endswith("max_tokens 6, n 8, seed none; 8 completions per prompt on the hf engine")
    assert block["steps"] == "1"


def test_accuracy_by_dataset_averages_only_the_seeds_this_run_evaluated(tmp_path, monkeypatch):
    # a demo or bench folder holding an earlier run's seed_1 beside this run's seed_5
    from physreason.eval import launch

    base = tmp_path / "r" / "m" / "letter"
    for dataset, seed, right in (("av", 1, True), ("av", 5, False), ("old", 5, True)):
        run = run_dir(base, dataset, seed)
        run.mkdir(parents=True)
        (run / "results.jsonl").write_text(json.dumps({"id": "q0", "is_correct": right, "prediction": "A"}) + "\n")
    outcome = launch.EvalOutcome(base=base, runs=[launch.RunStatus("av", 5, 1, 1, 0)])
    monkeypatch.setattr(launch, "run_eval", lambda cfg, show_progress=True: outcome)
    cfg = load_config(None, ["eval.seed=5"])
    assert launch.accuracy_by_dataset(cfg, tmp_path / "r", show_progress=False) == {"av": 0.0}
