"""Prompt styles: Cosmos-Reason2 spoken natively beside Cosmos-Reason1, chosen from the checkpoint's family.

Golden snapshots of both styles in both modes live under tests/fixtures/chat/ (rewrite them with
`PHYSREASON_UPDATE_GOLDEN=1 pytest tests/test_prompt_styles.py` after an intended change, and review the diff).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from physreason.chat import prompts
from physreason.chat.parse import parse_completion
from physreason.chat.style import (
    STYLES,
    Prompting,
    build_mcq_messages,
    build_messages,
    resolve_prompting,
    resolve_sampling,
    style_for_family,
)
from physreason.config import Config, load_config
from physreason.models.chat_template import QWEN3_VL_CHAT_TEMPLATE
from physreason.models.inputs import prompting_for
from physreason.rewards import extract_answer, format_reward
from physreason.serve.server import with_prompt_style

GOLDEN_DIR = Path(__file__).parent / "fixtures" / "chat"
QUESTION = "Is it safe for the robot to pick up the cup now?"
OPTIONS = {"A": "yes", "B": "no"}
# The user text cosmos-reason2's script/inference.py builds with --reasoning: the prompt, stripped, a blank
# line, then its REASONING_PROMPT (cosmos_reason2_utils/text.py at commit a3b4a1d), written out here as data.
REFERENCE_REASONING_TEXT = (
    f"{QUESTION}\n\nAnswer the question using the following format:\n\n<think>\nYour reasoning.\n</think>\n\n"
    "Write your final answer immediately after the </think> tag."
)


def qwen3_tokenizer():
    from physreason.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(chat_template=QWEN3_VL_CHAT_TEMPLATE)


def render(messages, tokenizer=None) -> str:
    return (tokenizer or qwen3_tokenizer()).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


SNAPSHOTS = {
    "reason2_rendered_reasoning_video.txt": lambda: render(
        build_messages(QUESTION, videos=["clip"], reasoning=True, style="reason2")
    ),
    "reason2_rendered_plain_image_video.txt": lambda: render(
        build_messages(QUESTION, videos=["clip"], images=["frame"], reasoning=False, style="reason2")
    ),
    "reason2_rendered_mcq_reasoning_video.txt": lambda: render(
        build_mcq_messages(QUESTION, OPTIONS, videos=["clip"], answer_type="reasoning", style="reason2")
    ),
    "reason2_rendered_mcq_letter_video.txt": lambda: render(
        build_mcq_messages(QUESTION, OPTIONS, videos=["clip"], answer_type="letter", style="reason2")
    ),
}


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_reason2_prompt_matches_golden_snapshot(name: str) -> None:
    text = SNAPSHOTS[name]()
    path = GOLDEN_DIR / name
    if os.environ.get("PHYSREASON_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8", newline="")
    assert path.read_text(encoding="utf-8") == text, f"{name} changed; if intended, see this file's docstring"


@pytest.mark.parametrize("reasoning", [True, False])
def test_reason2_renders_exactly_as_the_reference_conversation(reasoning: bool) -> None:
    # cosmos-reason2's create_conversation: system "You are a helpful assistant.", then a user turn with the
    # images, the videos (each a dict carrying its path and vision kwargs) and the text, rendered by the same
    # apply_chat_template(..., tokenize=False, add_generation_prompt=True) call.
    text = REFERENCE_REASONING_TEXT if reasoning else QUESTION
    reference = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "frame.png"},
                {"type": "video", "video": "clip.mp4", "fps": 4, "total_pixels": 8192 * 32 * 32},
                {"type": "text", "text": text},
            ],
        },
    ]
    ours = build_messages(f"  {QUESTION}\n", videos=["clip"], images=["frame"], reasoning=reasoning, style="reason2")
    tokenizer = qwen3_tokenizer()
    assert render(ours, tokenizer) == render(reference, tokenizer)
    assert ours[1]["content"][-1]["text"] == text


def test_reason1_prompts_are_unchanged_by_the_styles() -> None:
    messages = build_messages(QUESTION, videos=["clip"], images=["frame"])
    assert messages[0]["content"] == prompts.REASONING_SYSTEM_PROMPT
    assert [part["type"] for part in messages[1]["content"]] == ["video", "image", "text"]
    assert messages[1]["content"][-1]["text"] == QUESTION


def test_reason2_empty_system_prompt_sends_no_system_message() -> None:
    messages = build_messages(QUESTION, reasoning=False, system_prompt="", style="reason2")
    assert [m["role"] for m in messages] == ["user"]


@pytest.mark.parametrize(
    ("family", "style"),
    [("qwen3_vl", "reason2"), ("qwen3_vl_moe", "reason2"), ("qwen2_5_vl", "reason1"), ("qwen3", "reason1")],
)
def test_auto_style_follows_the_family(family: str, style: str) -> None:
    assert style_for_family(family) == style
    prompting = resolve_prompting(Config(), family)
    assert prompting.style == style and prompting.reasoning == STYLES[style].reasoning_default


def test_auto_style_reads_the_checkpoints_config_not_its_name(tiny_model_dirs, tmp_path) -> None:
    # A Qwen3-VL folder named like a Reason1 checkpoint is still Reason2.
    renamed = tmp_path / "Cosmos-Reason1-7B"
    renamed.symlink_to(tiny_model_dirs["qwen3_vl"], target_is_directory=True)
    prompting, sampling = prompting_for(load_config(None, [], {"model.model_name_or_path": str(renamed)}))
    assert (prompting.style, prompting.reasoning) == ("reason2", False)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.presence_penalty, sampling.seed) == (
        0.7, 0.8, 20, 1.5, 3407,
    )  # fmt: skip
    reason1, _ = prompting_for(load_config(None, [], {"model.model_name_or_path": str(tiny_model_dirs["qwen2_5_vl"])}))
    assert (reason1.style, reason1.reasoning) == ("reason1", True)


def test_reason2_sampling_defaults_follow_the_mode_and_explicit_settings_win() -> None:
    reasoning = Prompting("reason2", True)
    cfg = load_config(None, ["generation.temperature=0.3"])
    sampling = resolve_sampling(cfg, reasoning)
    assert sampling.temperature == 0.3  # named in --set: kept
    assert (sampling.top_p, sampling.top_k, sampling.repetition_penalty, sampling.presence_penalty) == (0.95, 20, 1.0, 0.0)
    assert sampling.seed == 1234
    plain = resolve_sampling(load_config(None, []), Prompting("reason2", False))
    assert (plain.temperature, plain.top_p, plain.presence_penalty, plain.seed) == (0.7, 0.8, 1.5, 3407)
    # Reason1 keeps its published defaults, and a value changed in code is never replaced.
    assert resolve_sampling(Config(), Prompting()) == Config().generation
    coded = Config()
    coded.generation.temperature = 0.0
    assert resolve_sampling(coded, Prompting("reason2", False)).temperature == 0.0


def test_prompt_reasoning_key_overrides_the_styles_default(tiny_model_dirs) -> None:
    cfg = load_config(None, ["prompt.reasoning=true"], {"model.model_name_or_path": str(tiny_model_dirs["qwen3_vl"])})
    prompting, sampling = prompting_for(cfg)
    assert prompting.reasoning and (sampling.temperature, sampling.seed) == (0.6, 1234)
    forced = load_config(None, ["prompt.style=\"reason1\""], {"model.model_name_or_path": str(tiny_model_dirs["qwen3_vl"])})
    assert prompting_for(forced)[0].style == "reason1"


REASON2_CASES = [
    # (completion, mcq answer, free-form answer, format ok in reason2)
    ("<think>\nThe cup is held.\n</think>\n\nB", "B", "b", True),
    ("<think>\nThe cup is held.\n</think>\n\nThe answer is (A).", "A", "(a)", True),
    ("<think>\nno</think>\n\nyes", "A", "yes", True),  # an option's text names its letter
    ("B", "B", "b", False),  # non-reasoning mode: the whole completion is the answer
    # cut off mid-reasoning: no answer, whatever the reasoning names, and no format credit
    ("<think>\nstill thinking about B", None, None, False),
    ("<think>\nA or B?\n</think>\n\n", None, None, False),  # empty answer
    ("<think>\nx\n</think>\n\n<answer>\nA\n</answer>", "A", "a", False),  # Reason1 tags: read, but not Reason2's format
    ("<think>a</think>\n\nB</think>\n\nA", "A", "a", False),  # two closes: the text after the last is the answer
]


@pytest.mark.parametrize(("completion", "letter", "free", "well_formed"), REASON2_CASES)
def test_reason2_layout_completions_are_scored_right(completion, letter, free, well_formed) -> None:
    assert extract_answer(completion, OPTIONS) == letter
    assert extract_answer(completion) == free
    assert format_reward(completion, prompt_style="reason2") == float(well_formed)


def test_reason1_format_reward_is_unchanged_and_rejects_reason2_layout() -> None:
    reason1 = "<think>\nx\n</think>\n\n<answer>\nA\n</answer>"
    assert format_reward(reason1) == 1.0 and format_reward(reason1, prompt_style="reason1") == 1.0
    assert format_reward("<think>\nx\n</think>\n\nA") == 0.0


def test_reason2_parse_gives_reasoning_and_answer_for_records() -> None:
    parsed = parse_completion("<think>\nThe cup is held.\n</think>\n\nNo, wait.", "reason2")
    assert (parsed.think, parsed.answer, parsed.problems) == ("The cup is held.", "No, wait.", [])
    plain = parse_completion("No, wait.", "reason2")
    assert (plain.think, plain.answer) == (None, "No, wait.")


@pytest.mark.parametrize("reasoning", [True, False])
@pytest.mark.parametrize("per_request", [None, True, False])
def test_serve_template_prompts_as_infer_does_in_both_modes(reasoning, per_request) -> None:
    # The server's wrapped template, given a bare user turn, renders what infer sends for the same question;
    # chat_template_kwargs {"reasoning": ...} switches the mode per request.
    tokenizer = qwen3_tokenizer()
    template = with_prompt_style(tokenizer.chat_template, Prompting("reason2", reasoning))
    user = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    kwargs = {} if per_request is None else {"reasoning": per_request}
    served = tokenizer.apply_chat_template(
        user, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
    )
    mode = reasoning if per_request is None else per_request
    assert served == render(build_messages(QUESTION, videos=["clip"], reasoning=mode, style="reason2"), tokenizer)
    as_string = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], chat_template=template, tokenize=False, add_generation_prompt=True,
        **kwargs,
    )  # fmt: skip
    assert (REFERENCE_REASONING_TEXT in as_string) == mode


def test_serve_template_keeps_a_requests_own_system_message() -> None:
    tokenizer = qwen3_tokenizer()
    template = with_prompt_style(tokenizer.chat_template, Prompting("reason2", False))
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    served = tokenizer.apply_chat_template(own, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert served.startswith("<|im_start|>system\nBe brief.<|im_end|>") and "helpful" not in served
