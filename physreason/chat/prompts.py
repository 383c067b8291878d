"""The exact prompt strings Cosmos-Reason1 models were trained and evaluated with.

Each string is data copied verbatim from nvidia-cosmos/cosmos-reason1 (commit 3e7f1cb unless
noted); a change here changes model behaviour, and the golden snapshots under
tests/fixtures/chat/ make it a visible diff.
"""

from __future__ import annotations

# README.md of the first release (commit c51fe52) and the Cosmos-Reason1-7B model card: the system
# prompt for free-form questions with reasoning. The `<think>`/`<answer>` layout it spells out is
# the one `format_reward` enforces.
REASONING_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question in the following format: "
    "<think>\nyour reasoning\n</think>\n\n<answer>\nyour answer\n</answer>."
)

# Qwen2.5-VL's default system prompt (its chat template inserts it when none is given): the plain,
# non-reasoning prompt.
PLAIN_SYSTEM_PROMPT = "You are a helpful assistant."

# examples/benchmark/tools/eval/utils/input.py, get_prompt(): the benchmark's system prompt for
# multiple-choice questions, in both answer types.
MCQ_SYSTEM_PROMPT = "Answer the questions."

# Same file: appended to every multiple-choice question after the option lines.
MCQ_LETTER_INSTRUCTION = "Answer with the option's letter from the given choices directly."

# Same file: appended after the letter instruction when answer_type is "reasoning".
MCQ_REASONING_INSTRUCTION = (
    "Please answer the question in the following format: "
    "<think> your reasoning </think> <answer> your single letter answer </answer>."
)

# examples/post_training/tools/dataset/cosmos_grpo.py, __getitem__(): the GRPO training recipe
# appends this (not the benchmark's "single letter" wording) and sends an empty system prompt.
GRPO_REASONING_INSTRUCTION = (
    "Please answer the question in the following format: "
    "<think> your reasoning </think> <answer> your answer </answer>."
)
GRPO_SYSTEM_PROMPT = ""

# prompts/addons/reasoning.txt: the addon scripts/inference.py joins (after a blank line) onto a
# task's system prompt when --reasoning is given.
REASONING_ADDON = (
    "Answer the question with provided options in the following format:\n"
    "<think>\nyour reasoning\n</think>\n\n<answer>\nyour answer\n</answer>."
)

# prompts/addons/english.txt: the addon scripts/inference.py puts first in every system prompt.
ENGLISH_ADDON = "Always respond in English."

# Cosmos-Reason2 (nvidia-cosmos/cosmos-reason2 at commit a3b4a1d, cosmos_reason2_utils/text.py): the system
# prompt of every conversation its inference script and post-training examples build, Qwen's own default.
REASON2_SYSTEM_PROMPT = "You are a helpful assistant."

# Same file, REASONING_PROMPT: reasoning is opt-in; script/inference.py appends this to the user text after a
# blank line when --reasoning is given. The answer follows </think> directly, with no <answer> tags.
REASON2_REASONING_INSTRUCTION = (
    "Answer the question using the following format:\n\n<think>\nYour reasoning.\n</think>\n\n"
    "Write your final answer immediately after the </think> tag."
)

# Cosmos-Reason2 task prompts: nvidia-cosmos/cosmos-reason2, commit 554d78e (the last to change these files),
# prompts/2d_grounding.yaml and prompts/temporal_localization.yaml, `user_prompt` (their trailing newline,
# a YAML block-scalar artefact, dropped). The model answers in JSON after </think>: 2D grounding with
# `box_2d` [x1, y1, x2, y2] (or `point_2d` [x, y]) normalised to 0-1000 per axis, temporal localization
# with `start` / `end` times written `mm:ss.ff`.
GROUNDING_PROMPT = "Locate the bounding box of {object_name}. Return a json."
TEMPORAL_LOCALIZATION_PROMPT = (
    "Describe the notable events in the provided video. Provide the result in json format with 'mm:ss.ff' format "
    "for time depiction for each event. Use keywords 'start', 'end' and 'caption' in the json output."
)
# physreason's own wording, not in the reference set: the point variant of GROUNDING_PROMPT, with the
# `point_2d` key the reference's prompts/robot_cot.yaml asks for, and a sentence that names one event
# before the temporal-localization instructions (the reference asks for every notable event).
POINT_GROUNDING_PROMPT = "Locate the center point of {object_name}. Return a json with the key 'point_2d'."
# physreason's own wording: appended to a 2D grounding question for Cosmos-Reason1 (Qwen2.5-VL), which grounds in
# absolute pixels of its resized input. Qwen3-VL's 0-1000 grid needs no words: Cosmos-Reason2's prompts say none.
PIXEL_GRID_INSTRUCTION = (
    "Give the coordinates in absolute pixels of the frame as you see it, {width}x{height} pixels: x from 0 at the "
    "left edge to {width}, y from 0 at the top edge to {height}."
)
NAMED_EVENT_PROMPT = "Find one event in the provided video: {event}. " + TEMPORAL_LOCALIZATION_PROMPT.split(". ", 1)[1]
