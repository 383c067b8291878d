"""`data synth` output loads as it is in eval (benchmark layout), SFT (conversations) and GRPO (MCQ prompts)."""

from __future__ import annotations

import json

import pytest

from physreason.config.schema import DatasetConfig
from physreason.data.loaders import load_records
from physreason.data.mcq import load_mcq_prompts
from physreason.data.synth.generate import generate_task
from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS
from physreason.eval import load_benchmark


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    for task in TASKS:
        generate_task(task, 2, root, "val", workers=1, show_progress=False)
    return root


@pytest.mark.parametrize("task", TASKS)
def test_eval_reads_the_task_folder_as_a_benchmark(synth_root, task):
    benchmark = load_benchmark(task, synth_root)
    truth = json.loads((synth_root / task / f"{task}_benchmark_qa_pairs.json").read_text())
    assert [s.answer for s in benchmark.samples] == [entry["qa_pairs"]["answer"] for entry in truth]
    for sample, entry in zip(benchmark.samples, truth):
        assert sample.options == entry["qa_pairs"]["index2ans"]
        assert (benchmark.media_root / entry["video"]).is_file()


@pytest.mark.parametrize("task", TASKS)
def test_sft_reads_the_conversations_with_clips_under_the_file_folder(synth_root, task):
    records, root = load_records(DatasetConfig(name=str(synth_root / task / f"{task}_sft.jsonl")))
    assert len(records) == 2
    for record in records:
        assert (root / record["video"]).is_file()
        roles = [turn["role"] for turn in record["conversations"]]
        assert roles == ["user", "assistant"] and "<answer>" in record["conversations"][1]["content"]


@pytest.mark.parametrize("task", TASKS)
def test_grpo_reads_the_benchmark_file_as_mcq_prompts(synth_root, task):
    prompts = load_mcq_prompts(DatasetConfig(name=str(synth_root / task / f"{task}_benchmark_qa_pairs.json")))
    truth = json.loads((synth_root / task / f"{task}_benchmark_qa_pairs.json").read_text())
    assert [p.answer for p in prompts] == [entry["qa_pairs"]["answer"] for entry in truth]
    for prompt in prompts:
        assert prompt.answer in prompt.options and len(prompt.videos) == 1 and prompt.videos[0].is_file()
