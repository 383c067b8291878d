"""SFT data in the wrong answer layout for the model, its conversion, and LLaVA records with extra placeholders."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from physreason.config import load_config
from physreason.data.convert import convert_records, to_reason2
from physreason.data.sft import SFTDataset, normalize_conversation
from physreason.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
REASON1 = "<think>\nthe ball falls\n</think>\n\n<answer>\nB\n</answer>"


def llava(answer: str = REASON1, question: str = "<video>\nDoes it fall?") -> dict:
    return {"video": "clip.mp4", "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def test_reason1_replies_become_reason2_and_others_stay():
    assert to_reason2(REASON1) == "<think>\nthe ball falls\n</think>\n\nB"
    assert to_reason2("<answer>A</answer>") == "A"
    assert to_reason2("<think>\nx\n</think>\n\nB") == "<think>\nx\n</think>\n\nB"


def test_data_convert_rewrites_every_layout_and_keeps_the_rest(tmp_path):
    records = [
        llava(),
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": REASON1}]}], "id": 7},
        llava(answer="<think>\nok\n</think>\n\nA"),
    ]
    source, target = tmp_path / "r1.jsonl", tmp_path / "r2.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = subprocess.run([sys.executable, "-m", "physreason", "data", "convert", str(source), str(target),
                             "--style", "reason2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert f"2 of 3 records rewritten in Cosmos-Reason2's layout into {target}" in result.stdout
    written = [json.loads(line) for line in target.read_text().splitlines()]
    assert written[0]["conversations"][1]["value"] == "<think>\nthe ball falls\n</think>\n\nB"
    assert written[0]["video"] == "clip.mp4" and written[1]["id"] == 7
    assert written[1]["messages"][1]["content"][0]["text"].endswith("</think>\n\nB")
    assert written[2] == records[2]



def test_data_convert_counts_only_the_records_whose_text_changed(tmp_path):
    no_final_block = "<answer></answer>x" * 3  # tags, but text after the last </answer>: kept as it is
    as_text = json.dumps([{"from": "gpt", "value": "<answer>A</answer> then more"}], indent=1)  # spacing kept too
    records = [llava(answer=no_final_block), {"conversations": as_text}, llava()]
    source, target = tmp_path / "r1.jsonl", tmp_path / "r2.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert convert_records(source, target) == (1, 3)
    written = [json.loads(line) for line in target.read_text().splitlines()]
    assert written[:2] == records[:2]
    assert written[2]["conversations"][1]["value"] == "<think>\nthe ball falls\n</think>\n\nB"


def test_data_convert_keeps_a_conversation_text_the_json_parser_refuses_as_written(tmp_path):
    from physreason.data.convert import convert_records

    refused = ["[" + "9" * 5000 + "]", "[" * 5000 + "]" * 5000, "not json"]  # too many digits, too deep, not JSON
    records = [{"conversations": text, "id": k} for k, text in enumerate(refused)] + [llava()]
    source, target = tmp_path / "r1.jsonl", tmp_path / "r2.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert convert_records(source, target) == (1, 4)
    written = [json.loads(line) for line in target.read_text().splitlines()]
    assert written[:3] == records[:3]
    assert written[3]["conversations"][1]["value"] == "<think>\nthe ball falls\n</think>\n\nB"


def test_data_convert_never_replaces_an_existing_file_unasked(tmp_path):
    from typer.testing import CliRunner

    from physreason.cli import app

    source, target = tmp_path / "r1.jsonl", tmp_path / "other_set.jsonl"
    source.write_text(json.dumps(llava()) + "\n")
    target.write_text('{"id": "someone else\'s record"}\n')
    refused = CliRunner().invoke(app, ["data", "convert", str(source), str(target), "--style", "reason2"])
    assert isinstance(refused.exception, InputError)  # exit 2 through physreason's main
    assert f"{target} already exists: give a new file, or pass --overwrite" in str(refused.exception)
    assert "someone else" in target.read_text()
    with pytest.raises(InputError, match="is a folder"):
        convert_records(source, tmp_path, overwrite=True)
    replaced = CliRunner().invoke(app, ["data", "convert", str(source), str(target), "--style", "reason2", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(target.read_text())["conversations"][1]["value"].endswith("</think>\n\nB")


def test_data_convert_overwrite_replaces_a_link_or_hard_link_and_leaves_what_it_shares_alone(tmp_path):
    source = tmp_path / "r1.jsonl"
    source.write_text(json.dumps(llava()) + "\n")
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text('{"id": "their record"}\n')
    linked, hard = tmp_path / "linked.jsonl", tmp_path / "hard.jsonl"
    linked.symlink_to(theirs)
    hard.hardlink_to(source)  # the same file as the input under another name
    for target in (linked, hard):
        convert_records(source, target, overwrite=True)
        assert not target.is_symlink() and json.loads(target.read_text())["conversations"][1]["value"].endswith("B")
    assert theirs.read_text() == '{"id": "their record"}\n'
    assert json.loads(source.read_text()) == llava()  # the input, shared with the hard link, is unchanged


def test_reason1_records_for_a_reason2_model_are_named_in_one_warning(tiny_model_dirs, caplog):
    from transformers import AutoConfig

    from physreason.train.sft import warn_reason1_layout

    records = [llava(), llava(answer="<think>\nok\n</think>\n\nA")]
    dataset = SFTDataset(records, Path("."), tokenizer=None, max_length=64)
    for kind, warned in (("qwen3_vl", True), ("qwen2_5_vl", False)):
        model = tiny_model_dirs[kind]
        config = load_config(None, [f"model.model_name_or_path='{model}'", "data.dataset.name='demo.jsonl'"])
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_reason1_layout(config, AutoConfig.from_pretrained(model), dataset)
        lines = [r.getMessage() for r in caplog.records]
        assert bool(lines) == warned
        if warned:
            assert len(lines) == 1 and lines[0].startswith("1 of 2 records of demo.jsonl answer in Cosmos-Reason1's")
            assert "physreason data convert --style reason2 IN OUT" in lines[0]


def test_an_extra_video_placeholder_is_a_record_error_not_training_text():
    record = llava(question="<video>\nDoes it fall? Compare with <video>")
    with pytest.raises(InputError, match=r"data.jsonl:3: the user text has more <video> placeholders than the record's 1 video"):
        normalize_conversation(record, "conversations", "data.jsonl:3")
    parts = normalize_conversation(llava(), "conversations", "data.jsonl:1")[0]["content"]
    assert parts == [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "Does it fall?"}]


@pytest.mark.parametrize("text", ["[" + "9" * 5000 + "]", "[" * 5000 + "]" * 5000])
def test_a_conversation_text_the_json_parser_refuses_is_unreadable_not_a_traceback(text):
    from physreason.data.convert import count_reason1_records
    from physreason.data.sft import record_layout

    records = [{"conversations": text}, llava()]
    assert count_reason1_records(records, "conversations") == 1
    assert record_layout(records[0], "conversations") == "unreadable"
