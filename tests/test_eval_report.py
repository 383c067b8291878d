"""Scoring and reports on hand-made result files: accuracy math, mean ± std over repeats, failures, CSV/markdown."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from physreason.cli.eval_cmd import app
from physreason.errors import InputError
from physreason.eval import collect_reports, csv_text, markdown_table, mean_std, merge_shards, model_slug, report_rows
from physreason.eval.results import model_label, read_run, results_model_dir, run_dir, write_run_info


def write_run(
    base: Path,
    dataset: str,
    seed: int,
    *,
    correct: int,
    wrong: int,
    failed: int = 0,
    total: int | None = None,
    file: str = "results.jsonl",
    start: int = 0,
) -> Path:
    """A run folder with `correct` right answers, `wrong` wrong ones and `failed` error lines."""
    run = run_dir(base, dataset, seed)
    run.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"q{start + i}", "is_correct": True, "prediction": "A"} for i in range(correct)]
    records += [{"id": f"q{start + correct + i}", "is_correct": False, "prediction": "B"} for i in range(wrong)]
    records += [{"id": f"q{start + correct + wrong + i}", "error": "video x.mp4: corrupt"} for i in range(failed)]
    with (run / file).open("a", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    if total is not None:
        write_run_info(run, {"dataset": dataset, "seed": seed, "total": total})
    return run


def row_for(rows, dataset):
    return next(r for r in rows if r.dataset == dataset)


def test_accuracy_is_correct_over_scored_with_failures_counted_apart(tmp_path):
    base = tmp_path / "results" / "my-model" / "reasoning"
    write_run(base, "robovqa", 1, correct=3, wrong=1, failed=2, total=6)
    (row,) = report_rows(collect_reports(tmp_path / "results"))
    assert (row.model, row.answer_type, row.dataset) == ("my-model", "reasoning", "robovqa")
    assert row.mean == pytest.approx(0.75)
    assert row.std is None  # one repeat has no spread
    assert (row.samples, row.scored, row.correct, row.failed, row.missing) == (6, 4, 3, 2, 0)


def test_mean_and_sample_std_over_repeats(tmp_path):
    base = tmp_path / "m" / "letter"
    for seed, correct in zip((1, 2, 3), (2, 3, 4)):
        write_run(base, "av", seed, correct=correct, wrong=4 - correct)
    (row,) = report_rows(collect_reports(tmp_path))
    # accuracies 0.5, 0.75, 1.0: mean 0.75, sample std sqrt(((-.25)^2 + 0 + .25^2) / 2) = 0.25
    assert row.repeats == 3 and row.seeds == "1,2,3"
    assert row.per_repeat == pytest.approx([0.5, 0.75, 1.0])
    assert row.mean == pytest.approx(0.75)
    assert row.std == pytest.approx(0.25)


def test_mean_std_uses_n_minus_one():
    mean, std = mean_std([0.2, 0.4])
    assert mean == pytest.approx(0.3)
    assert std == pytest.approx(math.sqrt(0.02))
    assert mean_std([]) == (None, None)


def test_seeds_sort_numerically(tmp_path):
    base = tmp_path / "m" / "letter"
    for seed in (2, 10, 1):
        write_run(base, "av", seed, correct=1, wrong=0)
    (row,) = report_rows(collect_reports(tmp_path))
    assert row.seeds == "1,2,10"


def test_missing_counts_questions_without_a_result(tmp_path):
    base = tmp_path / "m" / "reasoning"
    write_run(base, "bridgev2", 1, correct=5, wrong=1, total=10)
    (row,) = report_rows(collect_reports(tmp_path))
    assert row.missing == 4
    assert row.mean == pytest.approx(5 / 6)


def test_average_row_is_macro_mean_over_datasets_per_repeat(tmp_path):
    base = tmp_path / "m" / "reasoning"
    write_run(base, "a", 1, correct=1, wrong=1)  # 0.5
    write_run(base, "a", 2, correct=2, wrong=0)  # 1.0
    write_run(base, "b", 1, correct=1, wrong=3)  # 0.25
    write_run(base, "b", 2, correct=3, wrong=1)  # 0.75
    write_run(base, "b", 3, correct=4, wrong=0)  # seed 3 is only in b: left out of the average
    average = row_for(report_rows(collect_reports(tmp_path)), "average")
    # per-seed macro averages: seed 1 -> 0.375, seed 2 -> 0.875
    assert average.repeats == 2
    assert average.mean == pytest.approx(0.625)
    assert average.std == pytest.approx(math.sqrt(2 * 0.25**2))


def test_csv_holds_percentages_and_counts(tmp_path):
    base = tmp_path / "m" / "reasoning"
    write_run(base, "av", 1, correct=1, wrong=3, failed=1, total=5)
    write_run(base, "av", 2, correct=3, wrong=1, failed=0, total=5)  # one question not yet answered
    rows = list(csv.DictReader(io.StringIO(csv_text(report_rows(collect_reports(tmp_path))))))
    (row,) = rows
    assert row["dataset"] == "av" and row["seeds"] == "1,2"
    assert (row["samples"], row["scored"], row["correct"], row["failed"], row["missing"]) == ("5", "8", "4", "1", "1")
    assert row["accuracy_pct_mean"] == "50.0000"
    assert float(row["accuracy_pct_std"]) == pytest.approx(100 * math.sqrt(2 * 0.25**2), abs=1e-4)
    assert row["accuracy_pct_per_repeat"] == "25.0000;75.0000"


def test_markdown_table_shows_mean_plus_minus_std(tmp_path):
    base = tmp_path / "m" / "reasoning"
    write_run(base, "av", 1, correct=1, wrong=1)
    write_run(base, "av", 2, correct=1, wrong=0)
    text = markdown_table(report_rows(collect_reports(tmp_path)))
    assert text.splitlines()[0].startswith("| model | answer type | dataset |")
    assert "| m | reasoning | av | 2 |" in text
    assert "75.00 ± 35.36" in text


def test_unmerged_shard_files_count_each_sample_once(tmp_path):
    base = tmp_path / "m" / "reasoning"
    run = write_run(base, "av", 1, correct=2, wrong=0, file="results.jsonl")
    # A kill between the merge's rename and its deletion leaves the same ids in a shard file too.
    write_run(base, "av", 1, correct=2, wrong=1, file="shard-0-of-2.jsonl")
    write_run(base, "av", 1, correct=1, wrong=0, file="shard-1-of-2.jsonl", start=10)
    assert sorted(read_run(run)) == ["q0", "q1", "q10", "q2"]
    assert merge_shards(run, order=["q10", "q0"]) == 4
    assert not list(run.glob("shard-*"))
    ids = [json.loads(line)["id"] for line in (run / "results.jsonl").read_text().splitlines()]
    assert ids == ["q10", "q0", "q1", "q2"]


def test_torn_last_line_is_ignored(tmp_path):
    run = write_run(tmp_path / "m" / "letter", "av", 1, correct=1, wrong=1)
    with (run / "results.jsonl").open("a") as handle:
        handle.write('{"id": "q9", "is_corr')
    (row,) = report_rows(collect_reports(tmp_path))
    assert (row.scored, row.failed) == (2, 0)



def test_a_shard_cut_inside_a_character_merges_with_every_finished_sample(tmp_path):
    from physreason.eval.results import finished_in_run

    run = run_dir(tmp_path / "m" / "letter", "av", 1)
    run.mkdir(parents=True)
    lines = [json.dumps({"id": f"q{i}", "is_correct": True, "prediction": "é"}, ensure_ascii=False) for i in range(3)]
    # a garbled byte inside a complete line, then a kill inside the next line's two-byte character
    text = "\n".join(lines).encode().replace("é".encode(), b"\xff", 1) + b"\n" + lines[0].replace("q0", "q3").encode()
    (run / "shard-0-of-2.jsonl").write_bytes(text[: text.rindex("é".encode()) + 1])
    assert sorted(read_run(run)) == sorted(finished_in_run(run)) == ["q0", "q1", "q2"]
    assert merge_shards(run) == 3
    assert sorted(json.loads(line)["id"] for line in (run / "results.jsonl").read_text().splitlines()) == ["q0", "q1", "q2"]

def test_no_results_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(InputError, match="no results under"):
        collect_reports(tmp_path)


def test_report_command_prints_and_writes_markdown_and_csv(tmp_path):
    base = tmp_path / "results" / "m" / "reasoning"
    write_run(base, "robovqa", 1, correct=3, wrong=1, failed=1, total=5)
    write_run(base, "av", 1, correct=1, wrong=1, total=2)
    result = CliRunner().invoke(app, ["report", str(tmp_path / "results"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "75.00" in result.output and "62.50" in result.output  # robovqa and the average
    csv_rows = list(csv.DictReader((tmp_path / "out" / "report.csv").open()))
    assert [r["dataset"] for r in csv_rows] == ["av", "robovqa", "average"]
    assert csv_rows[2]["accuracy_pct_mean"] == "62.5000"
    # chance (empty: these hand-written runs recorded none) stands beside the accuracy
    assert "| m | reasoning | robovqa | 1 | 5 | 1 | 0 | 0 |  | 75.00 |" in (tmp_path / "out" / "report.md").read_text()


def test_completions_with_no_readable_option_are_counted_as_unparsed(tmp_path):
    run = write_run(tmp_path / "results" / "m" / "letter", "av", 1, correct=2, wrong=1, total=4)
    with (run / "results.jsonl").open("a") as handle:
        handle.write(json.dumps({"id": "q9", "is_correct": False, "prediction": None}) + "\n")
    (row,) = report_rows(collect_reports(tmp_path / "results"))
    assert (row.scored, row.unparsed, row.mean) == (4, 1, 0.5)
    assert "| m | letter | av | 1 | 4 | 0 | 0 | 1 (25%) |  | 50.00 |" in markdown_table([row])
    (line,) = csv.DictReader(io.StringIO(csv_text([row])))
    assert (line["unparsed"], line["unparsed_pct"], line["chance_pct"]) == ("1", "25.0000", "")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "results")])
    assert result.exit_code == 0, result.output
    assert "unparsed" in result.output and "1 (25%)" in result.output


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("nvidia/Cosmos-Reason1-7B", "nvidia--Cosmos-Reason1-7B"),
        ("org/model name:v2", "org--model_name_v2"),
        ("/", "model"),
    ],
)
def test_model_slug_is_a_safe_folder_name(name, slug):
    assert model_slug(name) == slug


def test_model_slug_of_a_local_folder_is_its_name(tmp_path):
    folder = tmp_path / "checkpoints" / "step_100"
    folder.mkdir(parents=True)
    assert model_slug(str(folder) + "/") == "step_100"


def test_a_step_folder_is_labelled_with_its_run_and_two_runs_never_share_a_label(tmp_path):
    first = tmp_path / "a" / "sft" / "safetensors" / "step_20"
    second = tmp_path / "b" / "sft" / "safetensors" / "step_20"
    for folder in (first, second, tmp_path / "named-model", tmp_path / "sft-lr3" / "checkpoint-500"):
        folder.mkdir(parents=True)
    assert model_label(str(first)) == model_label(str(second)) == "sft-step_20"
    assert model_label(str(tmp_path / "sft-lr3" / "checkpoint-500")) == "sft-lr3-checkpoint-500"
    assert model_label(str(tmp_path / "named-model")) == "named-model"
    assert model_label("nvidia/Cosmos-Reason1-7B") == "nvidia--Cosmos-Reason1-7B"
    results = tmp_path / "results"
    assert results_model_dir(results, str(first)) == results / "sft-step_20"
    (results / "sft-step_20" / "letter").mkdir(parents=True)
    (results / "sft-step_20" / "letter" / "config.toml").write_text(f'[model]\nmodel_name_or_path = "{first}"\n')
    # the same model finds its folder again; another run's step_20 gets the next free label
    assert results_model_dir(results, str(first) + "/") == results / "sft-step_20"
    assert results_model_dir(results, str(second)) == results / "sft-step_20-2"
    assert results_model_dir(results, str(second), name="mine") == results / "mine"


def test_a_model_finds_its_own_results_folder_after_a_folder_before_it_is_freed(tmp_path):
    # `model` held another model's results when this one was given `model-2`; that model's folder was emptied since
    # (its failed evaluation removed its config.toml). A rerun goes back to its own results, not to the freed folder.
    first, second = tmp_path / "x" / "model", tmp_path / "y" / "model"
    for folder in (first, second):
        folder.mkdir(parents=True)
    results = tmp_path / "results"
    (results / "model" / "letter").mkdir(parents=True)  # only lock files left there
    (results / "model" / "letter" / ".physreason.lock").write_text("")
    (results / "model-2" / "reasoning").mkdir(parents=True)
    (results / "model-2" / "reasoning" / "config.toml").write_text(f'[model]\nmodel_name_or_path = "{second}"\n')
    assert results_model_dir(results, str(second)) == results / "model-2"
    assert results_model_dir(results, str(first)) == results / "model"  # a new model takes the first free folder


def test_report_table_fits_80_columns_without_cutting_names(tmp_path):
    results = tmp_path / "results"
    for model in ("nvidia--Cosmos-Reason1-7B", "my-finetune-step-1200"):
        write_run(results / model / "reasoning", "object_permanence", 1, correct=1, wrong=2, failed=1, total=4)
        write_run(results / model / "reasoning", "spatial_puzzle", 1, correct=2, wrong=2, total=5)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    result = subprocess.run([sys.executable, "-m", "physreason", "eval", "report", str(results)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    table_lines = [line for line in result.stdout.splitlines() if not line.startswith("wrote ")]
    assert max(len(line) for line in table_lines) <= 80
    for name in ("nvidia--Cosmos-Reason1-7B (reasoning)", "my-finetune-step-1200 (reasoning)", "object_permanence",
                 "spatial_puzzle", "33.33", "missing"):
        assert name in result.stdout


def test_report_out_never_replaces_files_there_without_overwrite(tmp_path):
    write_run(tmp_path / "results" / "m" / "reasoning", "av", 1, correct=1, wrong=1, total=2)
    out = tmp_path / "notes"
    out.mkdir()
    (out / "report.md").write_text("my own notes")

    def report(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "physreason", "eval", "report", str(tmp_path / "results"), "--out", *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    refused = report(str(out))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip() == (
        f"error: {out} already holds report.md: give a new folder, or pass --overwrite to replace them"
    )
    assert (out / "report.md").read_text() == "my own notes" and not (out / "report.csv").exists()
    (tmp_path / "a-file").write_text("x")
    refused = report(str(tmp_path / "a-file"))
    assert refused.returncode == 2 and "is a file: give the folder" in refused.stderr, refused.stderr
    for flag in ("--overwrite", "--force"):  # --force: the older name, as every --overwrite has it
        replaced = report(str(out), flag)
        assert replaced.returncode == 0, replaced.stderr
        assert "| m | reasoning | av |" in (out / "report.md").read_text() and (out / "report.csv").is_file()


def test_report_overwrite_replaces_a_link_in_place_of_a_report_file_and_leaves_its_target_alone(tmp_path):
    write_run(tmp_path / "results" / "m" / "reasoning", "av", 1, correct=1, wrong=1, total=2)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.md", "accuracy.png"):
        (tmp_path / f"mine-{name}").write_text("my own file")
        (out / name).symlink_to(tmp_path / f"mine-{name}")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "results"), "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    for name in ("report.md", "accuracy.png"):
        assert (tmp_path / f"mine-{name}").read_text() == "my own file"  # never written through the link
        assert not (out / name).is_symlink()
    assert "| m | reasoning | av |" in (out / "report.md").read_text()
    assert (out / "accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in out.iterdir()) == [".physreason-report.json", "accuracy.png", "report.csv", "report.md"]  # no temporary left


def test_report_overwrite_removes_an_earlier_reports_files_it_does_not_write_and_nothing_else(tmp_path):
    write_run(tmp_path / "results" / "m" / "reasoning", "av", 1, correct=1, wrong=1, total=2)  # no Physical AI Bench
    out = tmp_path / "out"
    out.mkdir()
    (out / "board.csv").write_text("column,accuracy_pct_mean\nOverall,99.0\n")  # an earlier report's board
    (out / "notes.txt").write_text("mine")
    (out / "old").mkdir()
    result = CliRunner().invoke(app, ["report", str(tmp_path / "results"), "--out", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [".physreason-report.json", "accuracy.png", "notes.txt", "old", "report.csv", "report.md"]
    assert (out / "notes.txt").read_text() == "mine"


def test_report_into_the_results_folder_replaces_only_what_an_earlier_report_wrote(tmp_path):
    results = tmp_path / "proj"
    write_run(results / "results" / "m" / "reasoning", "av", 1, correct=1, wrong=1, total=2)
    (results / "report.md").write_text("my own notes")
    (results / "accuracy.png").write_bytes(b"my own chart")

    def report(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "physreason", "eval", "report", str(results), *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    refused = report()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip() == (
        f"error: {results} holds report.md, accuracy.png, which no earlier `physreason eval report` recorded writing "
        "there (in .physreason-report.json): pass --overwrite to replace them, or --out a folder for the report"
    )
    assert (results / "report.md").read_text() == "my own notes" and (results / "accuracy.png").read_bytes() == b"my own chart"
    assert report("--overwrite").returncode == 0
    assert "| m | reasoning | av |" in (results / "report.md").read_text()
    again = report()  # its own earlier report is replaced without --overwrite
    assert again.returncode == 0, again.stderr
    assert json.loads((results / ".physreason-report.json").read_text())["files"] == [
        "report.md", "report.csv", "accuracy.png"]  # fmt: skip


def test_values_of_the_wrong_type_in_a_run_are_not_scores(tmp_path):
    from physreason.eval.pai_bench import NO_CATEGORY, OVERALL, board_counts

    base = tmp_path / "results" / "my-model" / "reasoning"
    run = run_dir(base, "grounding", 1)
    run.mkdir(parents=True)
    records = [{"id": "a", "is_correct": True, "prediction": "x", "iou": 0.5},
               {"id": "b", "is_correct": False, "prediction": "y", "iou": "high"},
               {"id": "c", "is_correct": False, "prediction": "z", "iou": float("nan")},
               {"id": "d", "is_correct": True, "prediction": "w", "iou": 1e308}]  # fmt: skip
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run_info(run, {"dataset": "grounding", "seed": 1, "total": "ten"})
    (row,) = report_rows(collect_reports(tmp_path / "results"))
    assert row.samples == 4  # a total that is not a count: the results' own number
    assert row.mean == pytest.approx(0.5) and row.iou_mean == pytest.approx(0.5)  # only the one real IoU
    counts = board_counts([{"is_correct": True, "category": ["not", "text"]}, {"is_correct": False, "category": 7}])
    assert counts[OVERALL].scored == 2 and counts[NO_CATEGORY] == counts[OVERALL]  # a category that is not text: none
