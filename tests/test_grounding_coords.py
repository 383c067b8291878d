"""2D grounding per model family: Cosmos-Reason1 (Qwen2.5-VL) answers in pixels of the frame it sees, Cosmos-Reason2
(Qwen3-VL) on a 0-1000 grid; prompts, rewards, GRPO, evaluation and SFT each use the right grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from media import write_clip

from physreason.chat.prompts import GROUNDING_PROMPT
from physreason.chat.structured import NORM_1000, CoordSpace, regrid_answer
from physreason.chat.style import Prompting, coord_space, style_for_family
from physreason.config import SamplingConfig, VisionConfig
from physreason.data.mcq import MCQPrompt, PromptStream
from physreason.data.sft import SFTDataset, regrid_conversation
from physreason.engines import Completion, Engine, GenerationResult
from physreason.errors import InputError
from physreason.eval.benchmark import Benchmark, EvalSample
from physreason.eval.runner import evaluate_shard
from physreason.eval.scoring import score_completion
from physreason.rewards.localization import box_iou_reward, localization_reward, point_in_box_reward
from physreason.rewards.rules import accuracy_reward
from physreason.train.rollout import RolloutSettings, collect_rollouts

# A reference on the 0-1000 grid, and the same box in pixels of a 1400x700 frame (x reaches past 1000).
REFERENCE = '[{"box_2d": [100, 200, 900, 600], "label": "the red ball"}]'
FRAME = CoordSpace("pixels", width=1400, height=700)
PIXEL_BOX = [140, 140, 1260, 420]
QUESTION = GROUNDING_PROMPT.format(object_name="the red ball in the frame at 00:01.00")


def completion(box: list[int], key: str = "box_2d") -> str:
    return f'<think>\nlooking\n</think>\n\n[{{"{key}": {box}, "label": "the red ball"}}]'


def eval_sample(answer: str = REFERENCE, **reference) -> EvalSample:
    return EvalSample("clip.mp4#0", "clip.mp4", QUESTION, None, answer, reference=reference)


def test_a_reason1_pixel_box_scores_iou_one_in_the_rewards_and_in_eval():
    text = completion(PIXEL_BOX)
    assert box_iou_reward(text, answer=REFERENCE, coords=FRAME) == pytest.approx(1.0)
    assert localization_reward(text, answer=REFERENCE, coords=FRAME) == pytest.approx(1.0)
    assert accuracy_reward(text, answer=REFERENCE, coords=FRAME) == 1.0
    score = score_completion(text, eval_sample(), FRAME)
    assert score.iou == pytest.approx(1.0) and score.is_correct
    qwen_key = completion(PIXEL_BOX, "bbox_2d")  # Qwen2.5-VL's own key
    assert box_iou_reward(qwen_key, answer=REFERENCE, coords=FRAME) == pytest.approx(1.0)


def test_the_same_box_on_reason2s_grid_scores_one():
    coords = coord_space("reason2", (700, 1400))
    assert coords == NORM_1000
    text = completion([100, 200, 900, 600])
    assert box_iou_reward(text, answer=REFERENCE, coords=coords) == 1.0
    assert score_completion(text, eval_sample(), coords).iou == 1.0


def test_a_box_on_the_other_familys_grid_does_not_score():
    reason2_box_to_reason1 = completion([100, 200, 900, 600])
    assert box_iou_reward(reason2_box_to_reason1, answer=REFERENCE, coords=FRAME) < 0.5
    assert not score_completion(reason2_box_to_reason1, eval_sample(), FRAME).is_correct
    pixels_to_reason2 = completion(PIXEL_BOX)
    assert box_iou_reward(pixels_to_reason2, answer=REFERENCE, coords=NORM_1000) < 0.5


def test_pixel_values_past_the_frame_clip_to_the_frame_not_to_1000():
    reference = '[{"box_2d": [500, 200, 1000, 600]}]'  # to the right edge
    assert box_iou_reward(completion([700, 140, 1900, 420]), answer=reference, coords=FRAME) == pytest.approx(1.0)
    assert box_iou_reward(completion([700, 140, 1400, 420]), answer=reference, coords=FRAME) == pytest.approx(1.0)
    # Inside the frame but past 1000: read as pixels, not cut at 1000 (which would give 0.30).
    assert box_iou_reward(completion([700, 140, 1260, 420]), answer=reference, coords=FRAME) == pytest.approx(0.8)


def test_a_reason1_pixel_point_is_read_in_pixels():
    point = completion([700, 350], "point_2d")  # the frame's centre
    box = [450, 400, 550, 600]
    assert point_in_box_reward(point, answer='[{"point_2d": [500, 500]}]', box_2d=box, coords=FRAME) == 1.0
    assert point_in_box_reward(point, answer='[{"point_2d": [500, 500]}]', box_2d=box) == 0.0
    assert score_completion(point, eval_sample('[{"point_2d": [500, 500]}]', box_2d=box), FRAME).is_correct


def test_reason1_needs_a_frame_and_time_spans_are_no_grounding():
    with pytest.raises(InputError, match="pixels of the frame"):
        coord_space("reason1", None)
    assert coord_space("reason1", (196, 252)) == CoordSpace("pixels", width=252, height=196)
    span = MCQPrompt("s", "Find one event.", {}, '[{"start": "00:00.00", "end": "00:01.00"}]')
    assert span.messages("grpo", "reason1")[1]["content"][-1]["text"] == "Find one event."


def test_the_grounding_prompt_per_family():
    prompt = MCQPrompt("g", QUESTION, {}, REFERENCE)
    reason2 = prompt.messages("grpo", "reason2", (192, 256))[1]["content"][-1]["text"]
    assert reason2 == QUESTION  # Cosmos-Reason2's prompt as written: Qwen3-VL's 0-1000 grid goes unsaid
    reason1 = prompt.messages("grpo", "reason1", (196, 252))[1]["content"][-1]["text"]
    assert reason1.startswith(QUESTION + " ") and "absolute pixels" in reason1 and "252x196 pixels" in reason1
    assert "y from 0 at the top edge to 196" in reason1
    with pytest.raises(InputError, match="without image or video"):
        prompt.messages("grpo", "reason1")


class PixelEngine(Engine):
    """Answers every grounding request with REFERENCE's box in pixels of the frame it was given (or on 0-1000)."""

    def __init__(self, grid: str = "pixels") -> None:
        self.grid = grid
        self.requests = []

    def generate(self, requests, sampling, *, logprobs=True):
        results = []
        for request in requests:
            self.requests.append(request)
            height, width = request.frame_size()
            box = [100, 200, 900, 600]
            if self.grid == "pixels":
                box = [round(box[0] * width / 1000), round(box[1] * height / 1000),
                       round(box[2] * width / 1000), round(box[3] * height / 1000)]
            n = sampling.n or 1
            results.append(GenerationResult(request.request_id, [1, 2], [Completion(completion(box), [3], [], "stop")] * n))
        return results

    def update_weights(self, named_tensors):
        raise AssertionError("not used")


@pytest.fixture
def clip(tmp_path) -> Path:
    return write_clip(tmp_path / "clip.mp4", n_frames=8, size=(192, 256))  # 256x192, as data synth renders


def test_grpo_rollouts_ask_reason1_for_pixels_and_reward_its_pixel_box(clip):
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0, n=2, max_tokens=10)
    prompt = MCQPrompt("g", QUESTION, {}, REFERENCE, videos=(clip,))
    for grid, expected in (("pixels", 1.0), ("norm1000", 0.0)):
        engine = PixelEngine(grid)
        settings = RolloutSettings(
            groups_needed=1, prompts_per_round=1, sampling=sampling, vision=VisionConfig(fps=4),
            reward_weights={"localization": 1.0}, prompt_style="reason1",
        )
        batch = collect_rollouts(engine, PromptStream([prompt], seed=0, shuffle=False), settings, step=0)
        request = engine.requests[0]
        # 256x192 is below Qwen2.5-VL's video minimum of 128 tokens, so smart resize scales it up, sides x 28
        assert request.frame_size() == (280, 392)
        assert "392x280 pixels" in request.messages[-1]["content"][-1]["text"]
        assert [r["accuracy"] for r in batch.scored] == [expected] * 2
        if expected:
            assert [r["localization"] for r in batch.scored] == [pytest.approx(1.0, abs=0.02)] * 2


@pytest.mark.parametrize("style", ["reason1", "reason2"])
def test_eval_scores_each_familys_own_grid(tmp_path, clip, style):
    benchmark = Benchmark("grounding", clip.parent, [eval_sample()])
    engine = PixelEngine("pixels" if style == "reason1" else "norm1000")
    counts = evaluate_shard(
        engine, benchmark, tmp_path / "run", prompting=Prompting(style, False), sampling=SamplingConfig(seed=1),
        vision=VisionConfig(fps=4),
    )
    assert counts.answered == 1
    (line,) = [json.loads(x) for x in next((tmp_path / "run").rglob("*.jsonl")).read_text().splitlines()]
    assert line["iou"] == pytest.approx(1.0, abs=0.02) and line["is_correct"]
    assert line["coords"] == ("absolute pixels of the 392x280 frame" if style == "reason1" else
                              "a 0-1000 grid of each axis of the frame")
    asked = engine.requests[0].messages[-1]["content"][-1]["text"]
    assert ("absolute pixels" in asked) == (style == "reason1")


def test_regrid_rewrites_the_answer_and_the_question_for_pixels_only():
    text = '<think>\nat 10% of the width\n</think>\n\n<answer>\n[{"box_2d": [100, 200, 900, 600]}]\n</answer>'
    assert regrid_answer(text, FRAME) == text.replace("[100, 200, 900, 600]", "[140, 140, 1260, 420]")
    messages = [{"role": "user", "content": [{"type": "video", "video": "c"}, {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": text}]
    assert regrid_conversation(messages, NORM_1000, "r") == messages
    pixels = regrid_conversation(messages, FRAME, "r")
    assert "1400x700 pixels" in pixels[0]["content"][-1]["text"] and "[140, 140, 1260, 420]" in pixels[1]["content"]
    assert messages[0]["content"][-1]["text"] == QUESTION  # the record itself is untouched
    with pytest.raises(InputError, match="no assistant answer"):
        regrid_conversation([messages[0], {"role": "assistant", "content": "no json"}], FRAME, "r")


def test_data_synth_grounding_trains_each_family_on_its_own_grid(tmp_path, vl_kind, vl_model_dir):
    from transformers import AutoTokenizer

    from physreason.config import ModelConfig
    from physreason.data.synth.generate import generate_task
    from physreason.data.synth.records import json_sft_records
    from physreason.models import loading
    from physreason.models.family import read_vision_tokens
    from physreason.models.inputs import load_processor_params

    generate_task("grounding", 2, tmp_path, "train", show_progress=False)
    folder = tmp_path / "grounding"
    qa = json.loads((folder / "grounding_benchmark_qa_pairs.json").read_text())
    synth_lines = [json.loads(x) for x in (folder / "grounding_sft.jsonl").read_text().splitlines()]
    assert {line["coords"] for line in synth_lines} == {"norm1000"}  # one stored form, for every family
    assert "0-1000" not in synth_lines[0]["conversations"][1]["content"]  # the reasoning names shares of the frame
    json_sft_records(tmp_path, tmp_path / "sft.jsonl", ("grounding",))
    records = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert {r["coords"] for r in records} == {"norm1000"}

    style = style_for_family("qwen3_vl" if vl_kind == "qwen3_vl" else "qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(vl_model_dir)
    config = loading.load_model_config(ModelConfig(model_name_or_path=str(vl_model_dir)))
    dataset = SFTDataset(
        records, tmp_path, tokenizer, max_length=8192, vision_tokens=read_vision_tokens(config),
        vision_config=VisionConfig(fps=4), processor_params=load_processor_params(str(vl_model_dir)),
        prompt_style=style,
    )
    assert dataset.record_problems() == []
    sample = dataset[0]
    text = tokenizer.decode(sample.input_ids)
    key = "box_2d" if "box_2d" in qa[0]["qa_pairs"]["answer"] else "point_2d"
    stored = json.loads(qa[0]["qa_pairs"]["answer"])[0][key]
    if style == "reason1":  # 256x192 clips are seen as 392x280 by Qwen2.5-VL at the default budgets
        width, height = 392, 280
        expected = [round(v * (width if i % 2 == 0 else height) / 1000) for i, v in enumerate(stored)]
        assert "392x280 pixels" in text
    else:
        expected = stored
        assert "absolute pixels" not in text
    assert json.dumps(expected) in text
