"""Multiple-choice prompt records for GRPO: loading, per-draw option shuffling, and a resumable prompt stream.

Two record layouts are read from a JSON/JSONL file or dataset folder (`[data.dataset]`):
- the evaluation layout, `{"video": "clips/x.mp4", "qa_pairs": {"question", "index2ans", "answer"}}`
  (`qa_pairs` may be a list), which `physreason data synth` writes and `physreason eval` reads;
- flat records `{"question", "options" | "index2ans", "answer" | "correct_answer", "video"?, "image"?, "id"?}`,
  where options are a `{"A": ...}` dict or a list lettered A, B, ...; media are optional.
A question without options is a structured one (`data synth` tasks grounding and temporal_localization):
its answer is Cosmos-Reason2's JSON (`box_2d`, `point_2d` or `start`/`end`, 2D coordinates on the 0-1000 grid of
the frame), checked when the records load (an unusable box, point or span names its record), its other fields (a
point question's `box_2d`) go to the rewards (not those physreason sets itself: `completion`, `prompt_style`,
`reasoning`, `coords`; a field named as a reward option, `hit_threshold`, is refused), and it is asked as Cosmos-Reason2
asks it: the question alone, after the media, under the system prompt "You are a helpful assistant."; a 2D
question to a reason1 model also asks for absolute pixels of the frame it sees (chat.style.grounding_question).
Media paths are relative to the data root and may not leave it.
A question or option text holding a chat-structure token of the model's tokenizer (`<|im_start|>`, `<|vision_start|>`,
...: data.structural_tokens) is refused when the records load, naming each such question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from physreason.chat.mcq import AnswerType, lettered_options, shuffle_options
from physreason.chat.messages import Message, build_mcq_messages, build_messages
from physreason.chat.structured import answer_kind, grounds_2d, reference_problem
from physreason.chat.style import StyleName, coord_space, grounding_question
from physreason.config import DatasetConfig
from physreason.data.loaders import load_records, media_path_in_root, unusable_records_error
from physreason.data.structural_tokens import structural_token_in_texts
from physreason.data.video_range import record_video_range
from physreason.errors import InputError
from physreason.rewards.registry import PHYSREASON_FIELDS, reward_option_names


@dataclass(frozen=True)
class MCQPrompt:
    """One multiple-choice question with its media, ready to be asked."""

    id: str
    question: str
    options: dict[str, str]  # letter -> option text, in letter order; empty for a structured question
    answer: str  # the correct option's letter, or the reference JSON answer
    videos: tuple[Path, ...] = ()
    images: tuple[Path, ...] = ()
    video_range: dict[str, float] = field(default_factory=dict)  # the record's video_start / video_end, seconds
    reference: dict[str, Any] = field(default_factory=dict)  # a structured question's ground truth beside its answer

    @property
    def grounding_2d(self) -> bool:
        """True for a structured question answered with a 2D box or point (on its model's coordinate grid)."""
        return not self.options and grounds_2d(self.answer)

    def messages(
        self, answer_type: AnswerType = "grpo", style: StyleName = "reason1", frame_size: tuple[int, int] | None = None
    ) -> list[Message]:
        """Chat messages in the given prompt style (media first; "grpo" is Cosmos-Reason1's RL recipe's wording),
        or for a structured question as Cosmos-Reason2 does (its task prompt as written, whatever the answer type;
        a 2D question on the style's coordinate grid, for a frame of `frame_size` (height, width) as the model sees
        it: GenerationRequest.frame_size()). InputError for a 2D question to a reason1 model without a frame."""
        if not self.options:
            question = self.question
            if self.grounding_2d:
                question = grounding_question(question, coord_space(style, frame_size))
            return build_messages(question, videos=self.videos, images=self.images, reasoning=False, style="reason2")
        return build_mcq_messages(
            self.question, self.options, videos=self.videos, images=self.images, answer_type=answer_type, style=style
        )

    def layout(self, answer_type: AnswerType = "grpo", style: StyleName = "reason1") -> tuple[StyleName, bool]:
        """The style and reasoning mode `messages` asks the question in, which a completion's format is checked
        against: a structured question is asked as Cosmos-Reason2 asks it, without reasoning; answer type
        "letter" asks for the letter alone."""
        if not self.options:
            return "reason2", False
        return style, answer_type != "letter"

    def reward_fields(self) -> dict[str, Any]:
        """The sample fields rewards read (`answer`, and `options` or a structured question's ground truth)."""
        if not self.options:
            return {"answer": self.answer, **self.reference}
        return {"answer": self.answer, "options": self.options}


def shuffled(prompt: MCQPrompt, rng: random.Random) -> MCQPrompt:
    """The same question with its option texts in a random order under the same letters, answer remapped."""
    if not prompt.options:
        return prompt
    options, answer = shuffle_options(prompt.options, prompt.answer, rng)
    return replace(prompt, options=options, answer=answer)


def _paths(value: Any, root: Path, where: str) -> tuple[Path, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise InputError(f"{where}: media must be a path or a list of paths, got {value!r}")
    return tuple(media_path_in_root(root, item, where) for item in items)


def _prompt(sample_id: str, qa: Any, record: dict[str, Any], root: Path, where: str) -> MCQPrompt:
    if not isinstance(qa, dict):
        raise InputError(f"{where}: expected an object with question, options and answer, got {type(qa).__name__}")
    question = qa.get("question")
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{where}: no 'question' text")
    raw_options = qa.get("index2ans", qa.get("options"))
    if isinstance(raw_options, dict):  # Parquet/Arrow structs: None under the letters a question lacks
        raw_options = {key: text for key, text in raw_options.items() if text is not None}
    if not raw_options:
        return _structured_prompt(sample_id, question, qa, record, root, where)
    try:
        options = lettered_options(raw_options)
    except InputError as error:
        raise InputError(f"{where}: {error}") from None
    answer = qa.get("answer", qa.get("correct_answer"))
    if not isinstance(answer, str) or answer.strip() not in options:
        raise InputError(f"{where}: the answer {answer!r} is not one of the option letters {list(options)}")
    return MCQPrompt(
        id=sample_id,
        question=question,
        options={str(k): str(v) for k, v in options.items()},
        answer=answer.strip(),
        videos=_paths(record.get("video"), root, where),
        images=_paths(record.get("image"), root, where),
        video_range=record_video_range(record, where),
    )


def _structured_prompt(
    sample_id: str, question: str, qa: dict[str, Any], record: dict[str, Any], root: Path, where: str
) -> MCQPrompt:
    """A question without options whose answer is Cosmos-Reason2's JSON; InputError when the answer is not."""
    answer = qa.get("answer")
    try:
        answer_kind(answer if isinstance(answer, str) else "")
    except ValueError:
        raise InputError(
            f"{where}: no options ('index2ans' or 'options', {{\"A\": ...}} or a list), and the answer {answer!r} is "
            "not a structured JSON answer (box_2d, point_2d or start/end): give one or the other"
        ) from None
    problem = reference_problem(qa)
    if problem is not None:
        raise InputError(f"{where}: {problem}; fix this reference in the data (or remove the question)")
    # The fields physreason gives the rewards itself (the completion, the asked layout, the grid) are its own;
    # an option's name is the recipe's (grpo.reward_options) and would rescore this one sample.
    reference = {key: value for key, value in qa.items() if key not in ("question", "answer", *PHYSREASON_FIELDS)}
    options = reward_option_names()
    named = sorted(set(reference) & set(options))
    if named:
        rewards = sorted({reward for key in named for reward in options[key]})
        raise InputError(
            f"{where}: field(s) {named} name options of the reward(s) {rewards}, which are set for a whole run in "
            "grpo.reward_options, not by a record: remove or rename them"
        )
    return MCQPrompt(
        id=sample_id,
        question=question,
        options={},
        answer=answer,
        videos=_paths(record.get("video"), root, where),
        images=_paths(record.get("image"), root, where),
        video_range=record_video_range(record, where),
        reference=reference,
    )


def structural_token_problem(prompt: MCQPrompt, tokens: tuple[str, ...], where: str) -> str | None:
    """Why a question cannot be asked as written: its question or an option's text holds one of `tokens`
    (data.structural_tokens), which the prompt would carry as a turn marker or vision placeholder."""
    texts = [
        ("the question", prompt.question),
        *((f"option {letter}", text) for letter, text in prompt.options.items()),
    ]
    return structural_token_in_texts(
        texts, tokens, f"{where} (question {prompt.id!r})", "images and videos go in the record's video/image keys"
    )


def parse_mcq_records(
    records: list[Any], root: Path, source: str, control_tokens: tuple[str, ...] = ()
) -> list[MCQPrompt]:
    """One prompt per question in the records (either layout); InputError names the first bad record, or every
    question whose text holds one of `control_tokens` (structural_tokens of the model's tokenizer; () checks none)."""
    prompts: list[MCQPrompt] = []
    problems: list[str] = []
    for number, record in enumerate(records):
        where = f"{source} record {number}"
        if not isinstance(record, dict):
            raise InputError(f"{where} is not an object")
        key = str(record.get("id", record.get("video") if isinstance(record.get("video"), str) else f"record-{number}"))
        if "qa_pairs" in record:
            pairs = record["qa_pairs"] if isinstance(record["qa_pairs"], list) else [record["qa_pairs"]]
            parsed = [_prompt(f"{key}#{k}", qa, record, root, where) for k, qa in enumerate(pairs)]
        else:
            parsed = [_prompt(f"{key}#0", record, record, root, where)]
        problems += [p for p in (structural_token_problem(q, control_tokens, where) for q in parsed) if p is not None]
        prompts += parsed
    if problems:
        raise unusable_records_error(problems, len(prompts), "GRPO questions")
    return prompts


def load_mcq_prompts(
    dataset: DatasetConfig, max_samples: int | None = None, control_tokens: tuple[str, ...] = ()
) -> list[MCQPrompt]:
    """Read `[data.dataset]` as multiple-choice prompts (at most `max_samples`); InputError when there are none, or
    when a question's text holds one of `control_tokens` (parse_mcq_records)."""
    records, root = load_records(dataset)
    if max_samples:
        records = records[:max_samples]
    prompts = parse_mcq_records(records, root, dataset.name, control_tokens)
    if not prompts:
        raise InputError(f"{dataset.name} holds no multiple-choice questions: check data.dataset.name")
    return prompts


class PromptStream:
    """Endless, resumable stream of prompt draws: epoch-wise permutations, each draw optionally reshuffled.

    Draw `k` is prompt `perm_e[k % N]` of epoch `e = k // N`; its option order comes from a generator
    seeded by (seed, k), so a resumed run (same cursor) draws exactly the same prompts and orders.
    """

    def __init__(self, prompts: list[MCQPrompt], seed: int, shuffle: bool = True, shuffle_options: bool = True) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_options = shuffle_options
        self.cursor = 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: list(range(len(self.prompts)))}
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._orders[epoch] = torch.randperm(len(self.prompts), generator=generator).tolist()
        return self._orders[epoch]

    def draw(self, count: int) -> list[MCQPrompt]:
        """The next `count` prompts (crossing epochs as needed), options reshuffled when enabled."""
        drawn = []
        for _ in range(count):
            epoch, position = divmod(self.cursor, len(self.prompts))
            prompt = self.prompts[self._order(epoch)[position]]
            if self.shuffle_options:
                prompt = shuffled(prompt, random.Random(f"{self.seed}:{self.cursor}"))
            drawn.append(prompt)
            self.cursor += 1
        return drawn

    @property
    def epoch(self) -> int:
        """Passes over the prompts completed so far."""
        return self.cursor // len(self.prompts)
