"""Physical AI Bench: its published layout loads, evaluates on a tiny Qwen3-VL, and reports the board's columns."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from media import write_clip
from typer.testing import CliRunner

from physreason.cli.eval_cmd import app
from physreason.config import VisionConfig, load_config
from physreason.errors import InputError
from physreason.eval import board_column, board_counts, collect_boards, load_benchmark, model_slug, run_eval
from physreason.eval.benchmark import PAI_BENCH
from physreason.eval.runner import build_eval_request
from physreason.models.inputs import patch_factor


@pytest.mark.parametrize(
    ("category", "subcategory", "column"),
    [
        ("space", "relative position", "Space"),
        ("space_relationship", "", "Space"),
        ("Time", "order", "Time"),
        ("time_ordering", "", "Time"),
        ("Physical World", "gravity", "Physical World"),
        ("common sense: physics", "", "Physical World"),
        ("AV", "lane change", "AV"),
        ("autonomous driving", "", "AV"),
        ("agibot", "grasp", "Agibot"),
        ("HoloAssist", "next step", "HoloAssist"),
        ("robo_fail", "failure", "RoboFail"),
        ("RoboVQA", "planning", "RoboVQA"),
        ("BridgeData V2", "pick", "BridgeData V2"),
        ("embodied", "robovqa", "RoboVQA"),  # the category names no column: the subcategory decides
        ("gravity", "falling", "gravity"),  # holds the letters "av" but not the word: a column of its own
        ("Spatial Puzzle", "", "Spatial Puzzle"),  # "spatial" does not start with "space"
        ("", "", "(no category)"),
    ],
)
def test_board_column_rules(category, subcategory, column):
    assert board_column(category, subcategory) == column


def test_groups_pool_their_columns_and_overall_counts_every_scored_sample():
    records = [
        {"id": "1", "category": "space", "is_correct": True},
        {"id": "2", "category": "space", "is_correct": False},
        {"id": "3", "category": "time", "is_correct": True},
        {"id": "4", "category": "AV", "is_correct": True},
        {"id": "5", "category": "robovqa", "is_correct": False},
        {"id": "6", "category": "robovqa", "is_correct": False},
        {"id": "7", "category": "mystery", "is_correct": True},
        {"id": "8", "category": "space", "error": "corrupt clip"},  # failed: counted nowhere
    ]
    counts = board_counts(records)
    assert (counts["Space"].correct, counts["Space"].scored) == (1, 2)
    assert (counts["Common Sense"].correct, counts["Common Sense"].scored) == (2, 3)  # pooled, not the mean of columns
    assert (counts["Embodied Reasoning"].correct, counts["Embodied Reasoning"].scored) == (1, 3)
    assert (counts["mystery"].correct, counts["mystery"].scored) == (1, 1)
    assert (counts["Overall"].correct, counts["Overall"].scored) == (4, 7)


# (category, subcategory) of each test-split record; record 9's clip is missing, so it fails.
SPLIT = [
    ("space", "relative position"),
    ("space", "distance"),
    ("time", "order"),
    ("Physical World", "gravity"),
    ("AV", "lane change"),
    ("agibot", "grasp"),
    ("RoboVQA", "planning"),
    ("embodied", "robovqa"),
    ("gravity", "falling"),
    ("AV", "merge"),
]
CORRECT = {0, 2, 3, 4, 6, 8}  # the answers the test marks right before reporting


def pai_record(index: int, category: str, subcategory: str) -> dict:
    return {
        "question": f"What happens in clip {index}?",
        "index2ans": {"A": "it falls", "B": "it rises", "C": "it stays", "D": None},
        "video_path": f"videos/clip{index}.mp4",
        "answer": "A",
        "category": category,
        "subcategory": subcategory,
    }


@pytest.fixture(scope="module")
def pai_snapshot(tmp_path_factory) -> Path:
    """A Hub snapshot folder in the published layout: parquet splits under data/, clips under videos/."""
    import datasets

    folder = tmp_path_factory.mktemp("pai") / "physical-ai-bench-reason"
    for index in range(len(SPLIT) - 1):
        write_clip(folder / "videos" / f"clip{index}.mp4", n_frames=8, fps=4, size=(64, 64), seed=index)
    (folder / "data").mkdir(parents=True)
    records = [pai_record(i, *pair) for i, pair in enumerate(SPLIT)]
    datasets.Dataset.from_list(records).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    other = [pai_record(99, "space", "not in the test split")]
    datasets.Dataset.from_list(other).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    (folder / "README.md").write_text("# synthetic copy\n")
    return folder


def test_snapshot_folder_loads_the_test_split_with_categories_and_none_options_dropped(pai_snapshot):
    benchmark = load_benchmark(str(pai_snapshot), "")
    assert benchmark.name == "physical-ai-bench-reason"
    assert benchmark.board == PAI_BENCH
    assert benchmark.media_root == pai_snapshot.resolve()
    assert [s.id for s in benchmark.samples] == [f"videos/clip{i}.mp4#0" for i in range(len(SPLIT))]
    first = benchmark.samples[0]
    assert first.options == {"A": "it falls", "B": "it rises", "C": "it stays"}
    assert (first.category, first.subcategory, first.answer) == ("space", "relative position", "A")
    assert all(s.error is None for s in benchmark.samples)
    # Found by name under benchmark_root as well.
    assert load_benchmark(pai_snapshot.name, pai_snapshot.parent).samples == benchmark.samples


def test_load_from_disk_folder_and_malformed_records(tmp_path):
    import datasets

    records = [pai_record(0, "space", "x"), {**pai_record(1, "time", "y"), "question": ""}]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    samples = load_benchmark(str(tmp_path / "saved"), "").samples
    assert samples[0].error is None and samples[0].category == "space"
    assert "has no 'question' text" in samples[1].error and "row" not in samples[1].id


def test_missing_split_is_an_error_naming_the_splits(tmp_path):
    import datasets

    (tmp_path / "snap" / "data").mkdir(parents=True)
    datasets.Dataset.from_list([pai_record(0, "space", "x")]).to_parquet(str(tmp_path / "snap" / "data" / "train.parquet"))
    with pytest.raises(InputError, match="no 'test' data file.*train"):
        load_benchmark(str(tmp_path / "snap"), "")


def test_reason2_request_asks_in_cosmos_reason2_style(pai_snapshot):
    benchmark = load_benchmark(str(pai_snapshot), "")
    vision = VisionConfig(min_pixels=4096, max_pixels=4096, total_pixels=16384)
    request = build_eval_request(benchmark.samples[0], benchmark, vision, "letter", 32, style="reason2")
    system, user = request.messages
    assert system == {"role": "system", "content": "You are a helpful assistant."}
    assert user["content"] == [
        {"type": "video"},
        {
            "type": "text",
            "text": "What happens in clip 0?\n(A) it falls\n(B) it rises\n(C) it stays\n"
            "Answer with the option's letter from the given choices directly.",
        },
    ]
    bare = build_eval_request(benchmark.samples[0], benchmark, vision, "letter", 32, style="reason2", system_prompt="")
    assert [m["role"] for m in bare.messages] == ["user"]


@pytest.mark.slow
def test_synthetic_copy_evaluates_and_reports_the_board(tmp_path, pai_snapshot, tiny_model_dirs):
    model = tiny_model_dirs["qwen3_vl"]
    results = tmp_path / "results"
    overrides = [
        f"model.model_name_or_path={json.dumps(str(model))}",
        "model.dtype='float32'",
        "engine.backend='hf'",
        "engine.batch_size=4",
        "vision.min_pixels=4096",
        "vision.max_pixels=4096",
        "vision.total_pixels=16384",
        "generation.temperature=0.0",
        "generation.max_tokens=4",
        f"eval.datasets=[{json.dumps(str(pai_snapshot))}]",
        f"eval.results_dir={json.dumps(str(results))}",
    ]
    first = run_eval(load_config(None, [*overrides, "eval.limit=4"]), show_progress=False)
    assert [(r.answered, r.failed) for r in first.runs] == [(4, 0)]
    outcome = run_eval(load_config(None, overrides), show_progress=False)
    assert outcome.resumed == 4  # resumed, not redone
    assert [(r.answered, r.failed, r.missing) for r in outcome.runs] == [(9, 1, 0)]
    # A Qwen3-VL checkpoint gets Cosmos-Reason2's style, whose default mode is non-reasoning: the "letter" folder.
    run = results / model_slug(str(model)) / "letter" / "physical-ai-bench-reason" / "seed_1"
    lines = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert [(r["category"], r["subcategory"]) for r in lines] == SPLIT
    assert "does not exist" in lines[9]["error"]

    info = json.loads((run / "run.json").read_text())
    assert info["board"] == PAI_BENCH
    settings = info["settings"]
    assert (settings["prompt_style"], settings["reasoning"], settings["seed"]) == ("reason2", False, 1)
    # Reason2's non-reasoning defaults where the recipe is silent; the recipe's values where it spoke.
    assert (settings["top_p"], settings["top_k"], settings["presence_penalty"]) == (0.8, 20, 1.5)
    assert (settings["temperature"], settings["max_tokens"]) == (0.0, 4)
    assert (settings["min_pixels"], settings["max_pixels"], settings["total_pixels"]) == (4096, 4096, 16384)
    assert settings["patch_factor"] == patch_factor(str(model))
    assert settings["model"] == str(model.resolve())
    # The stored config holds the resolved settings, so shard processes that read it ask the same way.
    stored = load_config(run.parent.parent / "config.toml")
    assert (stored.prompt.style, stored.prompt.reasoning, stored.generation.presence_penalty) == ("reason2", False, 1.5)

    # Mark the answers by hand so the board's numbers are known, then report.
    for index, line in enumerate(lines):
        if "error" not in line:
            line["is_correct"] = index in CORRECT
    (run / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (board,) = collect_boards(results)
    expected = {  # correct / scored per column, counted by hand from SPLIT and CORRECT
        "Space": (1, 2), "Time": (1, 1), "Physical World": (1, 1), "Common Sense": (3, 4),
        "AV": (1, 1), "Agibot": (0, 1), "RoboVQA": (1, 2), "Embodied Reasoning": (2, 4),
        "gravity": (1, 1), "Overall": (6, 9), "HoloAssist": (0, 0), "RoboFail": (0, 0), "BridgeData V2": (0, 0),
    }
    assert board.columns()[:12] == ["Overall", "Embodied Reasoning", "Common Sense", "AV", "Physical World", "Time",
                                     "Space", "Agibot", "HoloAssist", "RoboFail", "RoboVQA", "BridgeData V2"]
    assert board.columns()[12:] == ["gravity"]
    for column, (correct, scored) in expected.items():
        mean, std, samples = board.column_stats(column)
        assert samples == scored, column
        assert mean == (pytest.approx(correct / scored) if scored else None), column
        assert std is None

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", str(results), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "prompt: reason2, reasoning off" in result.output
    assert "Physical AI Bench" in result.output and "66.67" in result.output
    report = (out / "report.md").read_text()
    assert "- prompt: reason2, reasoning off" in report
    assert "presence 1.5" in report and "seeds: 1 (" in report
    assert "| 1 | 66.67 | 50.00 | 75.00 | 100.00 | 100.00 | 100.00 | 50.00 | 0.00 | - | - | 50.00 | - | 100.00 |" in report
    rows = {r["column"]: r for r in csv.DictReader((out / "board.csv").open())}
    assert rows["Overall"]["accuracy_pct_mean"] == "66.6667" and rows["Overall"]["samples"] == "9"
