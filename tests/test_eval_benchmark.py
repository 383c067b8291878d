"""Reading the Cosmos-Reason1 benchmark layout (and JSONL of the same records) into one sample per question."""

from __future__ import annotations

import json

import pytest

from physreason.errors import InputError
from physreason.eval import benchmark_file, load_benchmark
from physreason.eval.runner import build_eval_request, shard_samples

RECORDS = [
    {
        "video": "clips/a.mp4",
        "qa_pairs": {"question": "Is it falling?", "index2ans": {"A": "yes", "B": "no"}, "answer": "A"},
    },
    {
        "video": "clips/b.mp4",
        "qa_pairs": [
            {"question": "What moves?", "index2ans": {"A": "cup", "B": "ball", "C": "box"}, "correct_answer": "B"},
            {"question": "Where to?", "index2ans": {"A": "left", "B": "right"}, "answer": "right"},
        ],
    },
    {"video": "clips/a.mp4", "qa_pairs": {"question": "Again?", "index2ans": {"A": "y", "B": "n"}, "answer": "B"}},
]


def write_benchmark(root, name, records):
    path = benchmark_file(root, name)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(records))
    return path


def test_reference_layout_gives_one_sample_per_question_with_stable_ids(tmp_path):
    path = write_benchmark(tmp_path, "robovqa", RECORDS)
    assert path == tmp_path / "robovqa" / "robovqa_benchmark_qa_pairs.json"
    benchmark = load_benchmark("robovqa", tmp_path)
    assert benchmark.name == "robovqa"
    assert benchmark.media_root == (tmp_path / "robovqa").resolve()
    # A video listed twice keeps counting its questions, so ids stay unique.
    assert [s.id for s in benchmark.samples] == ["clips/a.mp4#0", "clips/b.mp4#0", "clips/b.mp4#1", "clips/a.mp4#1"]
    assert [s.answer for s in benchmark.samples] == ["A", "B", "right", "B"]
    assert benchmark.samples[1].options == {"A": "cup", "B": "ball", "C": "box"}
    assert all(s.error is None for s in benchmark.samples)


def test_jsonl_of_the_same_records_reads_the_same(tmp_path):
    write_benchmark(tmp_path, "av", RECORDS)
    jsonl = tmp_path / "mine" / "av_subset.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    from_json = load_benchmark("av", tmp_path)
    from_jsonl = load_benchmark(str(jsonl), tmp_path)
    assert from_jsonl.name == "av_subset"
    assert from_jsonl.media_root == jsonl.parent.resolve()
    assert from_jsonl.samples == from_json.samples


def test_malformed_questions_become_failed_samples_not_exceptions(tmp_path):
    records = [
        {"video": "clips/a.mp4", "qa_pairs": {"index2ans": {"A": "x"}, "answer": "A"}},
        {"video": "clips/a.mp4", "qa_pairs": {"question": "q", "answer": "A"}},
        {"video": "clips/a.mp4", "qa_pairs": {"question": "q", "index2ans": {"A": "x"}}},
        {"qa_pairs": {"question": "q", "index2ans": {"A": "x"}, "answer": "A"}},
        "not an object",
    ]
    write_benchmark(tmp_path, "bad", records)
    samples = load_benchmark("bad", tmp_path).samples
    assert len(samples) == 5
    assert len({s.id for s in samples}) == 5
    reasons = [s.error for s in samples]
    assert "no 'question'" in reasons[0]
    assert "no 'index2ans'" in reasons[1]
    assert "no 'answer'" in reasons[2]
    assert "no 'video'" in reasons[3]
    assert "not an object" in reasons[4]


def test_missing_data_set_names_the_expected_file(tmp_path):
    with pytest.raises(InputError, match="holoassist_benchmark_qa_pairs.json does not exist"):
        load_benchmark("holoassist", tmp_path)


def test_shards_take_every_kth_sample_and_cover_all_once(tmp_path):
    write_benchmark(tmp_path, "robovqa", RECORDS * 3)
    samples = load_benchmark("robovqa", tmp_path).samples
    shards = [shard_samples(samples, k, 4) for k in range(4)]
    assert shards[1] == samples[1::4]
    assert sorted(s.id for shard in shards for s in shard) == sorted(s.id for s in samples)


def test_request_carries_the_reference_benchmark_prompt_and_refuses_escaping_paths(tmp_path):
    records = [{"video": "../outside.mp4", "qa_pairs": RECORDS[0]["qa_pairs"]}]
    write_benchmark(tmp_path, "esc", records)
    (tmp_path / "outside.mp4").write_bytes(b"")
    benchmark = load_benchmark("esc", tmp_path)
    with pytest.raises(InputError, match="leads outside the data folder"):
        build_eval_request(benchmark.samples[0], benchmark, vision=None, answer_type="reasoning")


def test_request_messages_match_the_reference_benchmark(tmp_path):
    from media import write_clip

    from physreason.config import VisionConfig

    write_benchmark(tmp_path, "robovqa", RECORDS[:1])
    write_clip(tmp_path / "robovqa" / "clips" / "a.mp4", n_frames=8, size=(56, 56))
    benchmark = load_benchmark("robovqa", tmp_path)
    request = build_eval_request(benchmark.samples[0], benchmark, VisionConfig(), answer_type="letter")
    system, user = request.messages
    assert system == {"role": "system", "content": "Answer the questions."}
    assert user["content"][0] == {"type": "video"}
    assert user["content"][1]["text"] == (
        "Is it falling?\n(A) yes\n(B) no\nAnswer with the option's letter from the given choices directly."
    )
    assert len(request.videos) == 1 and request.request_id == "clips/a.mp4#0"


def _grounding_record(answer, **beside) -> dict:
    return {"video": "clips/g.mp4", "qa_pairs": {"question": "Where is the cup?", "answer": json.dumps(answer), **beside}}


@pytest.mark.parametrize(
    ("answer", "beside", "problem"),
    [
        ([{"box_2d": [300, 300, 100, 100]}], {}, "the answer's box_2d [300, 300, 100, 100] is reversed or empty"),
        ({"box_2d": [-5, 10, 100, 100]}, {}, "the answer's box_2d [-5, 10, 100, 100] has a negative coordinate"),
        ({"bbox_2d": [10, 10, 100]}, {}, "the answer's bbox_2d [10, 10, 100] is not four numbers [x1, y1, x2, y2]"),
        ({"box_2d": [float("nan"), 10, 100, 100]}, {}, "the answer's box_2d [NaN, 10, 100, 100] holds nan, not a finite"),
        ({"box_2d": [10, 10, 10, 100]}, {}, "the answer's box_2d [10, 10, 10, 100] is reversed or empty"),
        ({"point_2d": [5, "x"]}, {}, "the answer's point_2d [5, \"x\"] holds 'x', not a finite number >= 0"),
        ({"point_2d": [5, 6]}, {"box_2d": [9, 9, 1, 1]}, "its 'box_2d' [9, 9, 1, 1] is reversed or empty"),
        ({"start": "00:03.00", "end": "00:01.00"}, {}, "the answer's span ends (00:01.00) no later than it starts"),
        ({"start": "3 s", "end": "00:01.00"}, {}, "the answer's start '3 s' is not a time mm:ss.ff"),
    ],
)
def test_an_unusable_grounding_reference_is_refused_naming_the_record(tmp_path, answer, beside, problem):
    good = _grounding_record([{"box_2d": [100, 100, 300, 300]}])
    write_benchmark(tmp_path, "grounding", [good, _grounding_record(answer, **beside)])
    with pytest.raises(InputError) as refused:
        load_benchmark("grounding", tmp_path)
    where = f"{benchmark_file(tmp_path, 'grounding')} record 1 (clips/g.mp4#1): "
    assert str(refused.value).startswith(where + problem)
    assert "index2ans" not in str(refused.value) and "\n" not in str(refused.value)


def test_usable_grounding_references_load_as_structured_questions(tmp_path):
    records = [_grounding_record([{"box_2d": [100, 100, 300, 300]}]), _grounding_record({"point_2d": [0, 5]},
               box_2d=[0, 0, 10, 10]), _grounding_record({"start": "00:01.00", "end": "00:02.50"})]
    write_benchmark(tmp_path, "grounding", records)
    samples = load_benchmark("grounding", tmp_path).samples
    assert [s.structured for s in samples] == [True, True, True]
    assert samples[1].reference == {"box_2d": [0, 0, 10, 10]}


def test_eval_with_an_unusable_reference_exits_2_before_loading_a_model(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import sys

    from physreason.cli.app import main

    write_benchmark(tmp_path, "grounding", [_grounding_record({"box_2d": [300, 300, 100, 100]})])
    monkeypatch.setattr("physreason.engines.create_engine", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "argv", ["physreason", "eval", "--model", str(tiny_model_dir), "--benchmark-root",
                                      str(tmp_path), "--dataset", "grounding", "--results-dir", str(tmp_path / "r")])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "record 0 (clips/g.mp4#0): the answer's box_2d [300, 300, 100, 100] is reversed or empty" in err
    assert not (tmp_path / "r").exists()
