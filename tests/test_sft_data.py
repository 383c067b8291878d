"""SFT data: record layouts, assistant-only labels, safe media paths, truncation that never splits vision tokens."""

from __future__ import annotations

import json

import pytest
import torch

from physreason.config import DatasetConfig
from physreason.data.collate import collate_padded, shifted_targets
from physreason.data.loaders import load_located_records, load_records, media_path_in_root
from physreason.data.sft import (
    IGNORE_INDEX,
    SFTDataset,
    SkippedSample,
    conversation_segments,
    normalize_conversation,
    tokenize_segments,
    truncation_problem,
)
from physreason.errors import InputError
from physreason.models.family import VisionTokens, read_vision_tokens
from physreason.models.positions import mrope_position_ids
from physreason.models.tiny import build_tiny_model, build_tiny_tokenizer

ANSWER = "<think>\nthe ball falls\n</think>\n\n<answer>\nyes\n</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _record(question: str = "Is the ball falling?") -> dict:
    return {"conversations": [{"role": "user", "content": question}, {"role": "assistant", "content": ANSWER}]}


def test_labels_are_exactly_the_assistant_reply_and_its_end_token(tokenizer):
    dataset = SFTDataset([_record()], ".", tokenizer, max_length=512)
    sample = dataset[0]
    labelled = sample.input_ids[sample.labels != IGNORE_INDEX]
    assert tokenizer.decode(labelled) == ANSWER + "<|im_end|>"
    assert torch.equal(sample.labels[sample.labels != IGNORE_INDEX], labelled)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the ball falling?"}, {"role": "assistant", "content": ANSWER}], tokenize=False
    )
    assert tokenizer.decode(sample.input_ids) == full


def test_every_assistant_turn_of_a_multi_turn_conversation_is_labelled(tokenizer):
    record = {"conversations": [
        {"from": "human", "value": "first?"}, {"from": "gpt", "value": "one"},
        {"from": "human", "value": "second?"}, {"from": "gpt", "value": "two"},
    ]}
    sample = SFTDataset([record], ".", tokenizer, max_length=512)[0]
    labelled = tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
    assert labelled == "one<|im_end|>two<|im_end|>"


def test_top_level_video_replaces_placeholder_in_user_text():
    record = {"video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "it falls"}]}
    messages = normalize_conversation(record, "conversations", "r0")
    assert messages[0]["content"] == [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What happens?"}]


def test_media_without_placeholder_goes_before_the_first_user_text():
    record = {"image": ["a.png"], "conversations": [
        {"role": "user", "content": "Describe."}, {"role": "assistant", "content": "a box"}]}
    messages = normalize_conversation(record, "conversations", "r0")
    assert messages[0]["content"][0] == {"type": "image", "image": "a.png"}


def test_vision_pads_never_carry_labels(tokenizer):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "a box"},
    ]
    segments = conversation_segments(tokenizer, messages, "r0")
    ids, labels = tokenize_segments(tokenizer, segments, [6], [])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == 6
    assert all(label != pad for label in labels)


def test_media_paths_outside_the_data_folder_are_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    with pytest.raises(InputError, match="outside the data folder"):
        media_path_in_root((tmp_path / "data").resolve(), "../secret.png", "record 0")
    with pytest.raises(InputError, match="outside the data folder"):
        media_path_in_root((tmp_path / "data").resolve(), str(tmp_path / "secret.png"), "record 0")


def test_too_long_sample_is_skipped_when_the_cut_would_split_vision_tokens():
    vision = VisionTokens(image_token_id=7, video_token_id=8)
    ids = [1, 2] + [8] * 10 + [3, 4, 5]
    labels = [IGNORE_INDEX] * 12 + [3, 4, 5]
    keep, reason = truncation_problem(ids, labels, max_length=8, vision=vision)
    assert keep == 0 and "visual tokens" in reason
    keep, reason = truncation_problem(ids, labels, max_length=14, vision=vision)
    assert keep == 14 and reason is None


def test_dataset_reports_skipped_samples_with_a_reason(tokenizer):
    dataset = SFTDataset([_record("word " * 200)], ".", tokenizer, max_length=16)
    item = dataset[0]
    assert isinstance(item, SkippedSample) and "no assistant tokens" in item.reason
    batch = collate_padded([item, SFTDataset([_record()], ".", tokenizer, max_length=512)[0]], 0, mrope=True)
    assert batch.num_samples == 1 and sum(batch.skipped.values()) == 1


def test_targets_are_shifted_within_the_sample():
    labels = torch.tensor([IGNORE_INDEX, IGNORE_INDEX, 5, 6])
    assert shifted_targets(labels).tolist() == [IGNORE_INDEX, 5, 6, IGNORE_INDEX]


def test_records_load_from_json_jsonl_parquet_and_load_from_disk(tmp_path):
    records = [_record(), _record("second")]
    (tmp_path / "d.json").write_text(json.dumps(records))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    for name in ("d.json", "d.jsonl", "hf", "d.parquet"):
        loaded, root = load_records(DatasetConfig(name=str(tmp_path / name)))
        assert [r["conversations"][0]["content"] for r in loaded] == ["Is the ball falling?", "second"]
    assert load_records(DatasetConfig(name=str(tmp_path / "d.json")))[1] == tmp_path.resolve()


def test_a_downloaded_dataset_folder_loads_the_split_files_the_hub_layout_names(tmp_path):
    # the layout `hf download --repo-type dataset ID --local-dir snap` writes: no state.json, data files by split
    snap = tmp_path / "snap"
    (snap / "data").mkdir(parents=True)
    (snap / "README.md").write_text("# a data set")
    (snap / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (_record(), _record("second"))))
    (snap / "data" / "test.jsonl").write_text(json.dumps(_record("held out")) + "\n")
    loaded, root, where = load_located_records(DatasetConfig(name=str(snap)))
    assert [r["conversations"][0]["content"] for r in loaded] == ["Is the ball falling?", "second"]
    assert root == snap.resolve() and where == [f"{snap / 'data' / 'train.jsonl'}:{line}" for line in (1, 2)]
    assert len(load_records(DatasetConfig(name=str(snap), split="test"))[0]) == 1
    (snap / "data" / "train.jsonl").write_text('["not", "a", "record"]\n')
    with pytest.raises(InputError, match=r"train.jsonl:1 is a JSON list, not an object"):
        load_records(DatasetConfig(name=str(snap)))


def test_a_folder_holding_no_data_set_is_an_input_error_naming_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("# not data")
    for folder in (tmp_path / "empty", tmp_path / "notes"):
        with pytest.raises(InputError) as raised:
            load_records(DatasetConfig(name=str(folder)))
        message = str(raised.value)
        assert message.startswith(f"data.dataset.name = {str(folder)!r}: the folder {folder} is neither")
        assert "set data.dataset.name to the data file, or to the folder that holds the data files" in message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state.json").write_text("{}")  # save_to_disk's marker, without the data it describes
    with pytest.raises(InputError, match=r"broken'?: .*broken cannot be read with datasets.load_from_disk"):
        load_records(DatasetConfig(name=str(broken)))


def test_a_hub_data_set_that_cannot_be_loaded_is_an_input_error_naming_the_key(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    name = "physreason-tests/no-such-data-set"
    with pytest.raises(InputError) as raised:
        load_records(DatasetConfig(name=name))
    message = str(raised.value)
    assert message.startswith(f"data.dataset.name = {name!r} is no local file or folder, and HF_HUB_OFFLINE is set")
    assert f"hf download --repo-type dataset {name} --local-dir DIR" in message

    def missing(*args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(InputError, match=r"is neither a local file or folder nor a Hub data set .*doesn't exist"):
        load_records(DatasetConfig(name=name))


def test_json_list_item_that_is_not_an_object_is_named_by_index(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([_record(), ["not", "a", "record"]]))
    with pytest.raises(InputError, match=r"d.json: record 1 of the list is a JSON list, not an object"):
        load_records(DatasetConfig(name=str(path)))


def test_mrope_positions_match_transformers_get_rope_index(tokenizer):
    model = build_tiny_model("qwen2_5_vl", tokenizer)
    config = model.config
    img, vid = config.image_token_id, config.video_token_id
    ids = torch.tensor([1, 2] + [img] * 4 + [3] + [vid] * 8 + [4, 5])
    image_grid = torch.tensor([[1, 4, 4]])
    video_grid = torch.tensor([[2, 4, 4]])
    seconds = torch.tensor([0.5])
    spec = read_vision_tokens(config)
    ours = mrope_position_ids(ids, img, vid, image_grid, video_grid, seconds, spec.spatial_merge_size, spec.tokens_per_second)
    types = torch.zeros_like(ids)
    types[ids == img] = 1
    types[ids == vid] = 2
    theirs, _ = model.model.get_rope_index(ids[None], types[None], image_grid, video_grid, seconds)
    assert torch.equal(ours, theirs[:, 0])


def test_a_media_path_with_a_nul_byte_is_a_named_record_problem_not_a_crash(tmp_path):
    (tmp_path / "ok.png").write_bytes(b"x")
    records = [
        {"conversations": [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "a"}],
         "image": "ok.png"},
        {"conversations": [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "a"}],
         "image": "o\x00k.png"},
    ]
    dataset = SFTDataset(records, tmp_path, None, max_length=64, vision_tokens=VisionTokens(7, 8),
                         locations=["train.jsonl:1", "train.jsonl:2"])
    problems = dataset.record_problems()
    assert len(problems) == 1 and problems[0].startswith("train.jsonl:2:") and "NUL byte" in problems[0]
    with pytest.raises(InputError, match="NUL byte"):
        media_path_in_root(tmp_path.resolve(), "clips/a\x00.mp4", "record 0")
    with pytest.raises(InputError, match="not a string"):
        media_path_in_root(tmp_path.resolve(), 5, "record 0")


def test_a_cut_counts_as_truncated_only_when_a_label_token_falls_past_it(tokenizer):
    """A sample longer than max_length trains on its first tokens; it is counted as truncated (its answer partly lost)
    only when a token with a label lies past the cut, not when the cut drops an unlabelled tail (found in review)."""
    whole = SFTDataset([_record()], ".", tokenizer, max_length=4096)[0]
    labels = whole.labels.tolist()
    last_label = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert not whole.truncated
    if last_label + 1 < len(labels):  # an unlabelled tail after the reply's end token: cut it alone
        tail_cut = SFTDataset([_record()], ".", tokenizer, max_length=last_label + 1)[0]
        assert len(tail_cut.input_ids) == last_label + 1 and not tail_cut.truncated
    answer_cut = SFTDataset([_record()], ".", tokenizer, max_length=last_label - 2)[0]
    assert answer_cut.truncated
    batch = collate_padded([whole, answer_cut], 0, mrope=True)
    assert batch.truncated == 1 and batch.to("cpu").truncated == 1
