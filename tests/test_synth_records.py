"""Training records built from generated tasks' benchmark records (physreason.data.synth.records): letter-answer and
JSON-answer SFT conversations and GRPO prompts, as the demo and the benches write them."""

from __future__ import annotations

import json

from physreason.data.synth.records import json_sft_records, letter_sft_records, rl_records
from physreason.data.synth.tasks import LETTER_TASK_NAMES as TASKS


def test_letter_records_answer_with_the_benchmark_letter(tmp_path):
    for task in TASKS:
        folder = tmp_path / task
        folder.mkdir()
        entry = {"video": "clips/x.mp4", "qa_pairs": {"question": "Which?", "index2ans": {"A": "up", "B": "down"}, "answer": "B"}}
        (folder / f"{task}_benchmark_qa_pairs.json").write_text(json.dumps([entry]))
    assert letter_sft_records(tmp_path, tmp_path / "sft.jsonl") == len(TASKS)
    first = json.loads((tmp_path / "sft.jsonl").read_text().splitlines()[0])
    assert first["video"] == f"{TASKS[0]}/clips/x.mp4"
    roles = [turn["role"] for turn in first["conversations"]]
    assert roles == ["system", "user", "assistant"]
    assert first["conversations"][2]["content"] == "B"
    assert "(A) up\n(B) down" in first["conversations"][1]["content"]
    # One task's records alone (the tower pre-training bench writes a single task's file).
    assert letter_sft_records(tmp_path, tmp_path / "one.jsonl", tasks=[TASKS[1]]) == 1
    assert json.loads((tmp_path / "one.jsonl").read_text())["video"] == f"{TASKS[1]}/clips/x.mp4"


def test_json_sft_records_ask_what_evaluation_and_grpo_ask_and_answer_with_the_json_alone(tmp_path):
    from physreason.chat.style import build_messages
    from physreason.data.mcq import parse_mcq_records
    from physreason.data.synth.generate import generate_task

    for task in ("grounding", "temporal_localization"):
        generate_task(task, 2, tmp_path, "train", 0, workers=1, show_progress=False)
    assert json_sft_records(tmp_path, tmp_path / "sft.jsonl") == 4
    assert rl_records(tmp_path, tmp_path / "rl.jsonl", ["grounding", "temporal_localization"]) == 4
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed over the target
    records = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    rl = [json.loads(line) for line in (tmp_path / "rl.jsonl").read_text().splitlines()]
    prompts = parse_mcq_records(rl, tmp_path, "rl.jsonl")
    for record, prompt in zip(records, prompts, strict=True):
        system, user, assistant = record["conversations"]
        assert record["video"].endswith(prompt.videos[0].name)
        # evaluation's request for a structured question (eval/runner.py) and GRPO's (data/mcq.py) are this prompt
        # (for Cosmos-Reason2's grid; SFT adds the pixel sentence to a box or point question for Reason1, as they do)
        evaluation = build_messages(user["content"], videos=["clip"], reasoning=False)
        assert ("coords" in record) == prompt.grounding_2d
        assert prompt.messages("grpo", "reason2") == [
            {"role": "system", "content": system["content"]},
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": user["content"]}]},
        ]
        assert [m["content"] for m in evaluation][0] == system["content"]
        assert evaluation[1]["content"][-1]["text"] == user["content"]
        assert assistant["content"] == prompt.answer and assistant["content"].startswith("[{")
