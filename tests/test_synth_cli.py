"""`physreason data synth` writes the benchmark and SFT layout, decodable clips, resumes, and keeps splits apart."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from physreason.chat.mcq import format_mcq
from physreason.cli.data_cmd import app as data_app
from physreason.data.synth.generate import build_sample, generate_task
from physreason.data.synth.sample import split_of_seed
from physreason.data.synth.tasks import LETTER_TASK_NAMES
from physreason.errors import InputError

runner = CliRunner()


def _cli(*args: str):
    root = typer.Typer()
    root.add_typer(data_app, name="data")  # as app.py registers it
    return runner.invoke(root, ["data", "synth", *args])


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Eight samples of every task, written by the CLI in one process (24 samples in a few seconds)."""
    out = tmp_path_factory.mktemp("synth")
    result = _cli("--out", str(out), "--n", "8", "--split", "val", "--seed", "4", "--workers", "1", "--no-progress")
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("task", LETTER_TASK_NAMES)
def test_cli_writes_benchmark_sft_and_meta_files(written, task):
    folder = written / task
    qa = json.loads((folder / f"{task}_benchmark_qa_pairs.json").read_text())
    sft = [json.loads(line) for line in (folder / f"{task}_sft.jsonl").read_text().splitlines()]
    meta = json.loads((folder / "meta.json").read_text())
    assert len(qa) == len(sft) == meta["count"] == 8
    for item, line in zip(qa, sft):
        assert item["video"] == line["video"] and item["video"].startswith("clips/")
        assert (folder / item["video"]).resolve().is_relative_to(folder.resolve()) and (
            folder / item["video"]
        ).is_file()
        pairs = item["qa_pairs"]
        assert set(pairs) == {"question", "index2ans", "answer"} and pairs["answer"] in pairs["index2ans"]
        user, assistant = line["conversations"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert user["content"] == format_mcq(pairs["question"], pairs["index2ans"])
        assert assistant["content"].endswith(f"</think>\n\n<answer>\n{pairs['answer']}\n</answer>")
    assert (meta["split"], meta["base_seed"], meta["task"]) == ("val", 4, task)
    assert sum(meta["class_balance"].values()) == 8 and sum(meta["answer_balance"].values()) == 8
    assert split_of_seed(meta["scene_seeds"]["min"]) == split_of_seed(meta["scene_seeds"]["max"]) == "val"


def test_cli_balances_answer_letters(written):
    for task in ("arrow_of_time", "object_permanence", "spatial_puzzle"):
        balance = json.loads((written / task / "meta.json").read_text())["answer_balance"]
        assert len(set(balance.values())) == 1, (task, balance)


def test_clips_decode_with_pyav_to_every_frame_close_to_the_render(written):
    record = json.loads((written / "object_permanence" / "records" / "val_000002.json").read_text())
    with av.open(str(written / "object_permanence" / record["video"])) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.codec_context.pix_fmt) == ("h264", "yuv420p")
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        assert float(stream.average_rate) == 8
    _, sample = build_sample("object_permanence", "val", 4, 2)
    assert decoded.shape == sample.frames.shape == (24, 192, 256, 3)
    assert np.abs(decoded.astype(int) - sample.frames.astype(int)).mean() < 4


def test_rerun_skips_finished_samples_and_redoes_a_missing_clip(written):
    folder = written / "spatial_puzzle"
    clip = folder / "clips" / "val_000003.mp4"
    before = {p.name: p.stat().st_mtime_ns for p in (folder / "clips").iterdir() if p != clip}
    clip.unlink()
    summary = generate_task("spatial_puzzle", 8, written, "val", 4, workers=1, show_progress=False)
    assert (summary.generated, summary.reused) == (1, 7)
    assert clip.is_file()
    assert before == {p.name: p.stat().st_mtime_ns for p in (folder / "clips").iterdir() if p != clip}


def test_rerun_removes_the_temporary_files_a_killed_run_left_and_no_others(written, tmp_path):
    import os
    import time

    folder = written / "spatial_puzzle"
    stale = [folder / "clips" / ".val_000001.mp4.k3j2.partial", folder / "records" / ".val_000001.json.x9.partial"]
    fresh = folder / "clips" / ".val_000002.mp4.a1b2.partial"  # another process writing it right now
    outside = tmp_path / "outside.partial"
    outside.write_text("not the run's")
    link = folder / "clips" / ".linked.partial"
    link.symlink_to(outside)
    long_ago = time.time() - 3600
    for path in [*stale, fresh]:
        path.write_bytes(b"half a file")
    for path in stale:
        os.utime(path, (long_ago, long_ago))
    os.utime(link, (long_ago, long_ago), follow_symlinks=False)
    summary = generate_task("spatial_puzzle", 8, written, "val", 4, workers=1, show_progress=False)
    assert (summary.generated, summary.reused) == (0, 8)
    assert not any(path.exists() for path in stale)
    assert fresh.is_file() and link.is_symlink() and outside.read_text() == "not the run's"
    fresh.unlink()  # the folder is shared with the tests after this one
    link.unlink()


def test_rerun_with_another_seed_into_the_same_folder_is_refused(written):
    with pytest.raises(InputError, match="meta.json"):
        generate_task("arrow_of_time", 8, written, "val", 5, workers=1, show_progress=False)


def test_cli_rejects_unknown_task_with_a_clear_message(tmp_path):
    result = _cli("--out", str(tmp_path), "--task", "gravity")
    assert result.exit_code != 0 and "arrow_of_time" in str(result.exception)


def test_train_and_test_sets_share_no_scene(tmp_path):
    seeds = {}
    for split in ("train", "test"):
        generate_task("arrow_of_time", 4, tmp_path / split, split, 0, workers=1, show_progress=False)
        records = (tmp_path / split / "arrow_of_time" / "records").glob("*.json")
        seeds[split] = {json.loads(p.read_text())["seed"] for p in records}
    assert len(seeds["train"]) == len(seeds["test"]) == 4 and not seeds["train"] & seeds["test"]


@pytest.mark.slow
def test_parallel_workers_write_the_same_records_as_one_process(tmp_path):
    for workers, sub in ((1, "serial"), (2, "parallel")):
        generate_task("object_permanence", 6, tmp_path / sub, "train", 1, workers=workers, show_progress=False)
    for name in ("object_permanence_benchmark_qa_pairs.json", "object_permanence_sft.jsonl", "meta.json"):
        serial = (tmp_path / "serial" / "object_permanence" / name).read_text()
        assert serial == (tmp_path / "parallel" / "object_permanence" / name).read_text()


def test_cli_option_order_fixed_reaches_the_records(tmp_path):
    result = _cli("--out", str(tmp_path), "--task", "arrow_of_time", "--n", "4", "--workers", "1", "--no-progress",
                  "--option-order", "fixed")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "arrow_of_time" / "meta.json").read_text())["option_order"] == "fixed"
    pairs = json.loads((tmp_path / "arrow_of_time" / "arrow_of_time_benchmark_qa_pairs.json").read_text())
    assert len(pairs) == 4
    assert len({json.dumps(p["qa_pairs"]["index2ans"], sort_keys=True) for p in pairs}) == 1  # same options, same order


def test_cli_unknown_option_order_is_refused(tmp_path):
    result = _cli("--out", str(tmp_path), "--task", "arrow_of_time", "--n", "1", "--workers", "1", "--no-progress",
                  "--option-order", "sorted")
    assert result.exit_code != 0
    assert "sorted" in str(result.exception) + result.output
