"""Answer one shard of a benchmark repeat with an engine, appending one scored JSON line per sample as it finishes."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from physreason.chat.mcq import AnswerType
from physreason.chat.messages import build_messages
from physreason.chat.parse import parse_completion
from physreason.chat.structured import CoordSpace
from physreason.chat.style import Prompting, StyleName, build_mcq_messages, coord_space, grounding_question
from physreason.config import SamplingConfig, VisionConfig
from physreason.data.loaders import media_path_in_root
from physreason.data.structural_tokens import structural_token_in_texts, structural_tokens
from physreason.engines.base import Engine, GenerationRequest, GenerationResult, request_seed
from physreason.errors import ConfigError, InputError, PhysReasonError
from physreason.eval.benchmark import Benchmark, EvalSample
from physreason.eval.results import finished_in_run, shard_file
from physreason.eval.scoring import Score, score_completion
from physreason.infer.results import check_not_link, open_for_append, truncate_torn_tail
from physreason.parallel import ordered_map
from physreason.vision import load_video
from physreason.vision.resize import PATCH_FACTOR

log = logging.getLogger(__name__)


@dataclass
class ShardCounts:
    """What one shard did for one repeat of one data set."""

    assigned: int  # samples of this shard (every num_shards-th, starting at its index)
    skipped: int = 0  # already finished by an earlier run
    answered: int = 0
    failed: int = 0


def shard_samples(samples: list[EvalSample], shard: int, num_shards: int) -> list[EvalSample]:
    """The samples shard `shard` of `num_shards` answers: every num_shards-th, starting at `shard`."""
    return samples[shard::num_shards]


def build_eval_request(
    sample: EvalSample,
    benchmark: Benchmark,
    vision: VisionConfig,
    answer_type: AnswerType,
    factor: int = PATCH_FACTOR,
    *,
    style: StyleName = "reason1",
    system_prompt: str | None = None,
    control_tokens: tuple[str, ...] = (),
) -> GenerationRequest:
    """Decode the sample's clip and build the benchmark's messages in the prompt style; raises PhysReasonError
    when it cannot.

    The clip path must stay inside the benchmark's media root. reason1: the reference benchmark's prompt
    ("Answer the questions." system prompt; question, lettered options and instructions as user text);
    reason2: Cosmos-Reason2's (chat.style.build_mcq_messages). A structured question (no options) is asked
    with Cosmos-Reason2's task prompt as written, whatever the style, except that a 2D grounding question to a
    reason1 model asks for absolute pixels of the frame it sees (chat.style.grounding_question). `system_prompt`
    (prompt.system_prompt) replaces the style's; '' leaves the system message empty (reason1) or out (reason2), as
    build_messages does. The request is seeded by the sample's identity (data set, sample id; each repeat's own
    sampling seed adds the repeat), so a sampled answer is the same whichever shard, batch or row it lands in. A
    question or option text holding one of `control_tokens` (data.structural_tokens of the model's tokenizer; ()
    checks none) cannot be asked: the chat template would carry it as a turn marker or vision placeholder.
    """
    if sample.error is not None:
        raise PhysReasonError(sample.error)
    problem = structural_token_problem(sample, benchmark, control_tokens)
    if problem is not None:
        raise InputError(problem)
    assert sample.video is not None  # guaranteed when error is None
    path = media_path_in_root(benchmark.media_root, sample.video, f"data set {benchmark.name}")
    frames = load_video(path, vision.model_copy(update=sample.video_range), factor)
    if sample.options is None:  # Cosmos-Reason2's task prompt, asked as written on the model's coordinate grid
        question = sample.question
        if sample.grounding_2d:
            question = grounding_question(question, coord_space(style, frames.frame_size))
        messages = build_messages(question, videos=[frames], reasoning=False, style="reason2")
        style = "reason2"
    else:
        messages = build_mcq_messages(
            sample.question, sample.options, videos=[frames], answer_type=answer_type, style=style
        )
    if system_prompt is not None:
        messages = _with_system_prompt(messages, system_prompt, style)
    return GenerationRequest(
        messages=messages, videos=[frames], request_id=sample.id, seed=request_seed(benchmark.name, sample.id)
    )


def structural_token_problem(sample: EvalSample, benchmark: Benchmark, tokens: tuple[str, ...]) -> str | None:
    """Why a sample's question cannot be asked as written: its question or an option's text holds one of `tokens`
    (data.structural_tokens), named with the benchmark's file and the question's id; None when none does."""
    texts = [("the question", sample.question), *((f"option {k}", text) for k, text in (sample.options or {}).items())]
    where = f"{benchmark.source or f'data set {benchmark.name}'} (question {sample.id!r})"
    return structural_token_in_texts(texts, tokens, where, "the clip is the record's video path, not text")


def _with_system_prompt(messages: list[dict[str, Any]], system_prompt: str, style: StyleName) -> list[dict[str, Any]]:
    # build_mcq_messages takes no system prompt of its own, so the recipe's replaces the style's here.
    turns = [m for m in messages if m["role"] != "system"]
    if not system_prompt and style == "reason2":
        return turns
    return [{"role": "system", "content": system_prompt}, *turns]


def answer_coords(sample: EvalSample, request: GenerationRequest, style: StyleName) -> CoordSpace | None:
    """The grid the model answers a 2D grounding sample on (its prompt style's, with the request's frame); None for
    other samples."""
    return coord_space(style, request.frame_size()) if sample.grounding_2d else None


def result_line(
    sample: EvalSample,
    result: GenerationResult,
    seed: int | None,
    prompting: Prompting | None = None,
    coords: CoordSpace | None = None,
) -> dict[str, Any]:
    """The stored record of one answered sample: the response, its parsed parts and its score, or its error.

    Format problems are those of the layout the sample was asked for (`asked_layout`); `prompting` None is
    Cosmos-Reason1 with reasoning. `coords`: the grid a 2D grounding answer is written on (answer_coords); None
    reads it on the 0-1000 grid.
    """
    record: dict[str, Any] = {"id": sample.id, "video": sample.video, "seed": seed}
    if sample.category is not None:  # Physical AI Bench: the report's columns come from these
        record |= {"category": sample.category, "subcategory": sample.subcategory}
    if result.error is not None:
        return record | {"error": result.error}
    if not result.completions:
        return record | {"error": "the engine returned no completion"}
    completion = result.completions[0]
    try:
        score = score_completion(completion.text, sample, coords)
    except PhysReasonError as exc:
        return record | {"error": str(exc), "full_response": completion.text}
    except Exception as exc:  # model output is untrusted: no completion stops a run; it scores as unanswered
        log.warning(
            "sample %s: scoring its completion raised %s: %s; counted wrong", sample.id, type(exc).__name__, exc
        )
        record["score_error"] = f"{type(exc).__name__}: {exc}"[:500]
        score = Score(prediction=None, is_correct=False, iou=0.0 if sample.structured else None)
    parsed = parse_completion(completion.text, *asked_layout(sample, prompting or Prompting()))
    if score.iou is not None:
        record["iou"] = score.iou
    if coords is not None:  # the grid the answer was read on, for an audit of its IoU
        record["coords"] = coords.describe()
    return record | {
        "correct_answer": sample.answer,
        "prediction": score.prediction,
        "is_correct": score.is_correct,
        "reasoning": parsed.think,
        "full_response": completion.text,
        "format_problems": parsed.problems,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(result.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }


def asked_layout(sample: EvalSample, prompting: Prompting) -> tuple[StyleName, bool]:
    """The style and reasoning mode a sample's question was asked in: a structured question is asked as
    Cosmos-Reason2 asks it, without reasoning (build_eval_request); a multiple-choice one in the run's prompting."""
    if sample.options is None:
        return "reason2", False
    return prompting.style, prompting.reasoning


def _requests(
    pairs: list[tuple[Benchmark, EvalSample]],
    vision: VisionConfig,
    prompting: Prompting,
    factor: int,
    workers: int = 1,
    lookahead: int = 1,
    control_tokens: tuple[str, ...] = (),
) -> Iterator[GenerationRequest | GenerationResult]:
    """Each (benchmark, sample)'s request, or an error result when its clip or data cannot be used (a question or
    option holding one of `control_tokens`: build_eval_request), in order.

    With `workers` > 1 the clips are decoded in that many threads (FFmpeg and the resize release the GIL), up to
    `lookahead` samples ahead of the one yielded: the next batch decodes while the engine answers this one. The
    order, the requests and the errors are those of decoding one after another.
    """
    answer_type: AnswerType = "reasoning" if prompting.reasoning else "letter"

    def build(pair: tuple[Benchmark, EvalSample]) -> GenerationRequest | PhysReasonError:
        benchmark, sample = pair
        try:
            return build_eval_request(
                sample,
                benchmark,
                vision,
                answer_type,
                factor,
                style=prompting.style,
                system_prompt=prompting.system_prompt,
                control_tokens=control_tokens,
            )
        except ConfigError:
            raise  # a setting, not this sample: every sample would fail the same way
        except PhysReasonError as exc:
            return exc

    for (_, sample), item in zip(pairs, ordered_map(build, pairs, workers, lookahead), strict=True):
        if isinstance(item, PhysReasonError):
            log.warning("sample %s: %s", sample.id, item)
            yield GenerationResult(request_id=sample.id, error=str(item))
        else:
            yield item


@dataclass
class ShardJob:
    """One repeat of one data set to answer: its benchmark, its run folder and the repeat's sampling."""

    benchmark: Benchmark
    run: Path
    sampling: SamplingConfig


def evaluate_shard(
    engine: Engine,
    benchmark: Benchmark,
    run: Path,
    *,
    prompting: Prompting,
    sampling: SamplingConfig,
    vision: VisionConfig,
    shard: int = 0,
    num_shards: int = 1,
    batch_size: int = 8,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    decode_workers: int = 1,
) -> ShardCounts:
    """Answer this shard's unfinished samples of one repeat, appending each scored result to its shard file.

    Samples with a result in any file of `run` are skipped, whichever shard count wrote them. A
    sample whose clip is missing, corrupt or outside the data root, or whose question is malformed or holds a
    chat-structure token of the engine's tokenizer in its question or option text (<|im_start|>, <|vision_start|>,
    ...: data.structural_tokens), is written as {"id", "error"} and counted as failed; the run goes on. `decode_workers` > 1 decodes the clips in
    that many threads, the next batch's while the engine answers this one (the same records either way).
    """
    (counts,) = evaluate_shards(
        engine, [ShardJob(benchmark, run, sampling)], prompting=prompting, vision=vision, shard=shard,
        num_shards=num_shards, batch_size=batch_size, on_result=on_result, decode_workers=decode_workers,
    )  # fmt: skip
    return counts


def evaluate_shards(
    engine: Engine,
    jobs: list[ShardJob],
    *,
    prompting: Prompting,
    vision: VisionConfig,
    shard: int = 0,
    num_shards: int = 1,
    batch_size: int = 8,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    decode_workers: int = 1,
) -> list[ShardCounts]:
    """evaluate_shard for several repeats or data sets in turn, one ShardCounts each, whose samples share generate
    calls where their sampling is the same (every data set of a greedy evaluation): a small model's evaluation then
    makes one call of batch_size requests where it made one per data set (issue 45). Each sample's request and
    result are the same as data set by data set; each run's records go to its own shard file."""
    counts: list[ShardCounts] = []
    pairs: list[tuple[int, EvalSample]] = []  # (job, sample) of every pending sample, in job order
    for index, job in enumerate(jobs):
        assigned = shard_samples(job.benchmark.samples, shard, num_shards)
        done = finished_in_run(job.run)
        pending = [s for s in assigned if s.id not in done]
        if pending:  # before any sample is answered: a link where this shard's results go is refused (InputError)
            check_not_link(shard_file(job.run, shard, num_shards))
        counts.append(ShardCounts(assigned=len(assigned), skipped=len(assigned) - len(pending)))
        pairs += [(index, sample) for sample in pending]
    if not pairs:
        return counts
    with contextlib.ExitStack() as stack:
        sinks: dict[int, Any] = {}

        def write(index: int, sample: EvalSample, result: GenerationResult, coords: CoordSpace | None = None) -> None:
            if index not in sinks:
                out = shard_file(jobs[index].run, shard, num_shards)
                out.parent.mkdir(parents=True, exist_ok=True)
                truncate_torn_tail(out)  # refuses a link there, as open_for_append does
                sinks[index] = stack.enter_context(open_for_append(out))
            record = result_line(sample, result, jobs[index].sampling.seed, prompting, coords)
            sinks[index].write(json.dumps(record, ensure_ascii=False) + "\n")
            sinks[index].flush()
            counts[index].answered += "error" not in record
            counts[index].failed += "error" in record
            if on_result is not None:
                on_result(record)

        batch: list[tuple[int, EvalSample, GenerationRequest]] = []

        def flush() -> None:
            sampling = jobs[batch[0][0]].sampling
            results = engine.generate([request for _, _, request in batch], sampling, logprobs=False)
            for (index, sample, request), result in zip(batch, results, strict=True):
                write(index, sample, result, answer_coords(sample, request, prompting.style))
            batch.clear()

        # An engine renders its prompts with its tokenizer (HFEngine, VLLMEngine); a stand-in without one checks none.
        tokens = structural_tokens(getattr(engine, "tokenizer", None))
        requests = _requests(
            [(jobs[index].benchmark, sample) for index, sample in pairs], vision, prompting, engine.vision_factor,
            decode_workers, lookahead=2 * batch_size, control_tokens=tokens,
        )  # fmt: skip
        for (index, sample), item in zip(pairs, requests, strict=True):
            if isinstance(item, GenerationResult):
                write(index, sample, item)
                continue
            if batch and jobs[batch[0][0]].sampling != jobs[index].sampling:
                flush()  # one generate call samples with one setting
            batch.append((index, sample, item))
            if len(batch) == batch_size:
                flush()
        if batch:
            flush()
    return counts
