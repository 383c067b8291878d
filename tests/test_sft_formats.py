"""SFT data in the layouts Cosmos-Reason2 users already have: the LLaVA / ShareGPT JSON of its cosmos-rl examples
(llava_sft.py) and a Hugging Face dataset of transformers `messages` (hf_sft.py); bad records named by place."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from media import write_clip, write_image

from physreason.config import DatasetConfig, load_config
from physreason.data.loaders import load_located_records
from physreason.data.sft import IGNORE_INDEX, SFTDataset, normalize_conversation
from physreason.errors import InputError
from physreason.models.family import read_vision_tokens
from physreason.models.inputs import load_processor_params
from physreason.models.tiny import build_tiny_tokenizer
from physreason.train.sft import build_datasets, run_sft

ANSWER = "<think>\nthe cup tips over\n</think>\n\nIt falls."


def llava_records(count: int) -> list[dict]:
    """Records as llava_sft.py reads them: `conversations` of human/gpt turns, media under image/images/video."""
    records = []
    for i in range(count):
        record: dict = {"id": f"s{i}", "conversations": [
            {"from": "human", "value": f"<video>\nWhat happens to the cup {i}?"},
            {"from": "gpt", "value": ANSWER},
        ]}
        record["video"] = f"clips/c{i % 2}.mp4"
        if i % 2:
            record["images"] = ["frames/a.png"]
            record["conversations"][0]["value"] = "<image>\n" + record["conversations"][0]["value"]
        records.append(record)
    return records


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    for i in range(2):
        write_clip(root / "clips" / f"c{i}.mp4", n_frames=8, fps=4, size=(64, 64), seed=i)
    write_image(root / "frames" / "a.png", size=(64, 64))
    return root


def test_llava_images_key_and_placeholders_give_media_in_text_order():
    record = llava_records(2)[1]
    messages = normalize_conversation(record, "conversations", "x.json record 1")
    assert messages[0]["content"] == [
        {"type": "image", "image": "frames/a.png"},
        {"type": "video", "video": "clips/c1.mp4"},
        {"type": "text", "text": "What happens to the cup 1?"},
    ]
    both = {**record, "image": "frames/b.png"}
    with pytest.raises(InputError, match="record 1: the record has both 'image' and 'images'"):
        normalize_conversation(both, "conversations", "x.json record 1")


@pytest.mark.slow
def test_llava_json_file_trains_a_tiny_qwen3_vl(tmp_path, media_root, tiny_model_dirs):
    data = tmp_path / "annotations" / "train.json"  # media live elsewhere: data.dataset.media_root
    data.parent.mkdir()
    data.write_text(json.dumps(llava_records(4)))
    config = load_config(None, [
        f"model.model_name_or_path={json.dumps(str(tiny_model_dirs['qwen3_vl']))}",
        f"data.dataset.name={json.dumps(str(data))}",
        f"data.dataset.media_root={json.dumps(str(media_root))}",
        f"train.output_dir={json.dumps(str(tmp_path / 'out'))}",
        "train.train_batch_per_replica=2", "train.mini_batch=1", "train.max_steps=3", "train.optm_warmup_steps=1",
        "train.param_dtype='float32'", "train.ckpt.enable_checkpoint=false", "train.ckpt.export_safetensors=false",
        "data.num_workers=0", "logging.logger=['jsonl']",
        "vision.min_pixels=4096", "vision.max_pixels=4096", "vision.total_pixels=16384",
        "vision.image_min_pixels=4096", "vision.image_max_pixels=4096",
    ])
    result = run_sft(config)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))


def messages_rows(count: int) -> list[dict]:
    """Rows as hf_sft.py trains on: transformers messages, every content a list of parts (one Arrow type)."""
    return [{"messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
        {"role": "user", "content": [{"type": "video", "video": f"clips/c{i % 2}.mp4"},
                                     {"type": "text", "text": f"What happens {i}?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
    ]} for i in range(count)]


def test_hf_dataset_of_messages_is_read_from_its_messages_column(tmp_path, media_root, tiny_model_dirs, caplog):
    import datasets

    folder = media_root / "hf_sft"  # a load_from_disk folder; media paths relative to its media root
    datasets.Dataset.from_list(messages_rows(3)).save_to_disk(str(folder))
    records, root, where = load_located_records(DatasetConfig(name=str(folder), media_root=str(media_root)))
    # Arrow gives every part the union of the parts' keys: a text part arrives with "video": None.
    assert records[0]["messages"][1]["content"][1]["video"] is None
    model = tiny_model_dirs["qwen3_vl"]
    from transformers import AutoConfig, AutoTokenizer

    vision = read_vision_tokens(AutoConfig.from_pretrained(model))
    with caplog.at_level(logging.INFO, logger="physreason.data.sft"):
        dataset = SFTDataset(records, root, AutoTokenizer.from_pretrained(model), max_length=4096,
                             vision_tokens=vision, processor_params=load_processor_params(str(model)),
                             source=str(folder), locations=where)
    assert dataset.column == "messages"
    assert sum("reading the 'messages' column" in r.message for r in caplog.records) == 1
    assert dataset.record_problems() == []
    sample = dataset[0]
    assert sample.visuals is not None and sample.visuals.video_grid_thw.shape == (1, 3)
    reply = AutoTokenizer.from_pretrained(model).decode(sample.input_ids[sample.labels != IGNORE_INDEX])
    assert reply == ANSWER + "<|im_end|>"
    text = AutoTokenizer.from_pretrained(model).decode(sample.input_ids)
    assert text.count("<|vision_start|>") >= 1 and "You are a helpful assistant." in text


def test_messages_stored_as_json_text_read_the_same(tmp_path):
    tokenizer = build_tiny_tokenizer()
    rows = [{"conversations": json.dumps(row["messages"][:1] + [
        {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Because."}]},
    ])} for row in messages_rows(1)]
    sample = SFTDataset(rows, tmp_path, tokenizer, max_length=512)[0]
    assert tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX]) == "Because.<|im_end|>"


def test_bad_records_are_named_by_file_and_index(tmp_path, media_root, tiny_model_dirs):
    import datasets

    records = llava_records(3)
    records[1]["video"] = "clips/missing.mp4"
    records[2]["conversations"] = [{"from": "human", "value": "only a question"}]
    data = tmp_path / "train.json"
    data.write_text(json.dumps(records))
    config = load_config(None, [
        f"model.model_name_or_path={json.dumps(str(tiny_model_dirs['qwen3_vl']))}",
        f"data.dataset.name={json.dumps(str(data))}",
        f"data.dataset.media_root={json.dumps(str(media_root))}",
    ])
    from transformers import AutoConfig, AutoTokenizer

    model = tiny_model_dirs["qwen3_vl"]
    with pytest.raises(InputError) as failure:
        build_datasets(config, AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model))
    message = str(failure.value)
    assert "2 of 3 SFT records cannot be used" in message
    assert f"{data} record 1: media file" in message and "missing.mp4 does not exist" in message
    assert f"{data} record 2: the conversation has no assistant turn" in message

    rows = [{"messages": json.dumps(messages_rows(1)[0]["messages"])}, {"messages": "{not json"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    records, root, where = load_located_records(DatasetConfig(name=str(tmp_path / "hf"), media_root=str(media_root)))
    problems = SFTDataset(records, root, build_tiny_tokenizer(), max_length=512, locations=where).record_problems()
    assert len(problems) == 2  # row 0 has a video but the text-only tokenizer's model has no vision tower
    assert problems[1].startswith(f"{tmp_path / 'hf'} row 1: 'messages' holds text that is not valid JSON")


def test_a_custom_column_that_no_record_has_is_not_replaced(tmp_path):
    rows = messages_rows(1)
    problems = SFTDataset(rows, tmp_path, build_tiny_tokenizer(), max_length=512, conversation_column="dialog",
                          source="mine.jsonl").record_problems()
    assert problems == ["mine.jsonl record 0: no list of turns under 'dialog'; set data.conversation_column_name"]


def _turns(layout: str, user, answer="It falls.") -> dict:
    """One record in a layout build_datasets reads: physreason's role/content, LLaVA from/value, HF messages parts."""
    if layout == "llava":
        return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}
    if layout == "messages":
        parts = [{"type": "text", "text": user}] if isinstance(user, str) else user
        return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
    return {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


@pytest.mark.parametrize("layout", ["physreason", "llava", "messages"])
def test_every_malformed_record_is_a_counted_problem_naming_its_line_and_key(tmp_path, tiny_model_dirs, layout):
    from transformers import AutoConfig, AutoTokenizer

    (tmp_path / "clip.mp4").write_bytes(b"not decoded by the checks")
    good = _turns(layout, "<video> What happens?")
    good["video"] = "clip.mp4"
    content_key = "value" if layout == "llava" else "content"
    bad_content = _turns(layout, "q")
    turns = bad_content["messages" if layout == "messages" else "conversations"]
    turns[0][content_key] = 5
    lines = [
        json.dumps(good),
        json.dumps(bad_content),  # 2: "content": 5
        json.dumps({**good, "video": 123}),  # 3
        json.dumps(good).replace('"video": "clip.mp4"', '"video": "clip.mp4", "video_start": ' + "9" * 400),  # 4
        json.dumps({**good, "note": "\xff"}, ensure_ascii=False),  # 5: written below as the byte 0xff
        json.dumps({**good, "deep": None}).replace("null", "[" * 5000 + "]" * 5000),  # 6
        json.dumps({**good, "id": None}).replace("null", "7" * 5000),  # 7
        json.dumps(good),
    ]
    data = tmp_path / "train.jsonl"
    data.write_bytes(b"\n".join(line.encode().replace("\xff".encode(), b"\xff") for line in lines) + b"\n")
    model = tiny_model_dirs["qwen3_vl"]
    config = load_config(None, [
        f"model.model_name_or_path={json.dumps(str(model))}", f"data.dataset.name={json.dumps(str(data))}",
    ] + (["data.conversation_column_name=messages"] if layout == "messages" else []))
    with pytest.raises(InputError) as failure:
        build_datasets(config, AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model))
    message = str(failure.value)
    assert message.startswith("6 of 8 SFT records cannot be used: ") and message.endswith("; and 1 more. Fix or remove them")
    column = lines[4].index(chr(0xff)) + 1
    for problem in [
        f"{data}:5 is not UTF-8 text (byte 0xff at column {column}): save it as UTF-8",
        f"{data}:6 is not valid JSON (values nested deeper than the JSON reader can follow): write one JSON record per line",
        f"{data}:7 is not valid JSON (a number of more than 4300 digits): write one JSON record per line",
        f"{data}:2: turn 0's {content_key!r} is a JSON number; write the text, or a list of {{'type': ...}} parts",
        f"{data}:3: 'video' must be a path or a list of paths, got a JSON number",
    ]:
        assert problem in message
    records, root, where = load_located_records(config.data.dataset, unreadable=[])
    dataset = SFTDataset(records, root, None, max_length=64, vision_tokens=read_vision_tokens(AutoConfig.from_pretrained(
        model)), conversation_column=config.data.conversation_column_name, locations=where)
    assert dataset.record_problems()[2] == (
        f"{data}:4: video_start must be a number of seconds >= 0, got {'9' * 20}... (400 characters)"
    )



def test_a_byte_order_mark_at_the_start_of_a_data_file_is_not_data(tmp_path):
    # Notepad and Excel save "UTF-8" with a leading BOM; only the first line may carry it, elsewhere it is an error.
    record = _turns("physreason", "q")
    bom = "\ufeff"
    for name, text in [("a.jsonl", f"{bom}{json.dumps(record)}\n\n"), ("a.json", bom + json.dumps([record]))]:
        (tmp_path / name).write_text(text, encoding="utf-8")
        records, _, where = load_located_records(DatasetConfig(name=str(tmp_path / name)))
        assert records == [record] and where[0].endswith(("a.jsonl:1", "a.json record 0"))
    (tmp_path / "b.jsonl").write_text(f"{json.dumps(record)}\n{bom}{json.dumps(record)}\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"{tmp_path / 'b.jsonl'}:2 is not valid JSON"):
        load_located_records(DatasetConfig(name=str(tmp_path / "b.jsonl")))

def test_a_json_file_that_the_parser_refuses_is_named_with_the_line(tmp_path):
    records = [_turns("physreason", "q"), {**_turns("physreason", "q"), "id": None}]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(records, indent=1).replace("null", "7" * 5000))
    line = path.read_text().splitlines().index(next(ln for ln in path.read_text().splitlines() if "7777" in ln)) + 1
    with pytest.raises(InputError, match=rf"{path} at line {line} is not valid JSON \(a number of more than 4300"):
        load_located_records(DatasetConfig(name=str(path)))
    path.write_text(json.dumps(records).replace("null", "[" * 5000 + "]" * 5000))
    with pytest.raises(InputError, match=rf"{path} is not valid JSON \(values nested deeper"):
        load_located_records(DatasetConfig(name=str(path)))
    path.write_bytes(b'[{"a": "\n\xff"}]')
    with pytest.raises(InputError, match=rf"{path} is not UTF-8 text \(byte 0xff at line 2, column 1\)"):
        load_located_records(DatasetConfig(name=str(path)))
    path.write_text(json.dumps([records[0], 5, records[0]]))
    unreadable: list[str] = []
    kept, _, where = load_located_records(DatasetConfig(name=str(path)), unreadable=unreadable)
    assert len(kept) == 2 and where == [f"{path} record 0", f"{path} record 2"]
    assert unreadable == [f"{path}: record 1 of the list is a JSON number, not an object: "
                          'each record must be an object such as {"question": ..., "video": ...}']


def test_messages_stored_as_json_text_that_the_parser_refuses_are_named(tmp_path):
    rows = [{"messages": "[" * 5000 + "]" * 5000}, {"messages": '[{"role": "user", "content": ' + "1" * 5000 + "}]"},
            {"messages": json.dumps([{"role": "user", "content": {"type": "text"}}, {"role": "assistant", "content": "a"}])}]
    problems = SFTDataset(rows, tmp_path, build_tiny_tokenizer(), max_length=512, source="hf").record_problems()
    assert problems == [
        "hf record 0: 'messages' holds text that is not valid JSON (values nested deeper than the JSON reader can "
        "follow): store a list of turns",
        "hf record 1: 'messages' holds text that is not valid JSON (a number of more than 4300 digits): "
        "store a list of turns",
        "hf record 2: turn 0's 'content' is a JSON object; write the text, or a list of {'type': ...} parts",
    ]


def test_a_control_token_written_in_a_records_text_is_refused_before_training(tmp_path):
    def record(user: str, answer: str = "It falls.") -> dict:
        return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}

    rows = [record("Does the ball fall?"), record("see <|video_pad|> here"), record("Why?", "Because.<|im_end|>more"),
            record("Where is <|box_start|>the ball<|box_end|>?"),  # a grounding token is the data's to use
            {"conversations": [{"role": "user", "content": [{"type": "text", "text": "a <|vision_start|> b"}]},
                               {"role": "assistant", "content": "No."}]}]  # fmt: skip
    locations = [f"mine.jsonl:{n}" for n in range(1, 6)]
    problems = SFTDataset(rows, tmp_path, build_tiny_tokenizer(), max_length=512, locations=locations).record_problems()
    assert len(problems) == 3
    assert problems[0].startswith("mine.jsonl:2: turn 0 (user) has '<|video_pad|>' in its text, a control token")
    assert problems[1].startswith("mine.jsonl:3: turn 1 (assistant) has '<|im_end|>'")
    assert problems[2].startswith("mine.jsonl:5: turn 0 (user) has '<|vision_start|>'")
