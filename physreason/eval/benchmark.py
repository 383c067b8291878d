"""Read Cosmos-Reason1 benchmark data sets into one sample per question: multiple choice, or a structured answer.

Layout (the reference benchmark): `<benchmark_root>/<name>/<name>_benchmark_qa_pairs.json`, a list of
`{"video": "clips/x.mp4", "qa_pairs": {"question", "index2ans": {"A": ...}, "answer" | "correct_answer"}}`
where `qa_pairs` may also be a list, and `video_start` / `video_end` (seconds) may select part of the
clip. A question with no `index2ans` whose `answer` is Cosmos-Reason2's JSON (`box_2d`, `point_2d` or
`start`/`end`, as `data synth` grounding and temporal_localization write) is a structured question,
scored by IoU. A JSON or JSONL file with the same records works too; its media
paths are relative to its own folder.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from physreason.chat.structured import answer_kind
from physreason.config import DatasetConfig
from physreason.data.loaders import load_records
from physreason.data.video_range import record_video_range
from physreason.errors import InputError

_DATA_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class EvalSample:
    """One question about one video; `error` says why it cannot be asked (it is then a counted failure)."""

    id: str  # "<video>#<k>": the k-th question about that video in file order, stable across runs
    video: str | None  # as written in the record, relative to the data set's media root
    question: str = ""
    options: dict[str, str] | None = None
    answer: str = ""
    error: str | None = None
    video_range: dict[str, float] = field(default_factory=dict)  # the record's video_start / video_end, seconds
    reference: dict[str, Any] = field(default_factory=dict)  # a structured question's ground truth beside its answer

    @property
    def structured(self) -> bool:
        """True for a question answered in Cosmos-Reason2's JSON (box, point, time span) instead of a letter."""
        return self.error is None and self.options is None


@dataclass(frozen=True)
class Benchmark:
    """A data set's name, the folder its media paths are relative to, and its samples in file order."""

    name: str
    media_root: Path
    samples: list[EvalSample]


def benchmark_file(benchmark_root: str | Path, name: str) -> Path:
    """Return `<benchmark_root>/<name>/<name>_benchmark_qa_pairs.json`, the reference layout's QA file."""
    return Path(benchmark_root).expanduser() / name / f"{name}_benchmark_qa_pairs.json"


def load_benchmark(spec: str, benchmark_root: str | Path) -> Benchmark:
    """Load a data set named in `eval.datasets`: a name under `benchmark_root`, or a JSON/JSONL file path.

    Raises InputError when the file is missing or is not a list of records. Malformed questions
    do not raise: they become samples with `error` set, so a run counts them and goes on.
    """
    if spec.endswith(_DATA_SUFFIXES):
        path = Path(spec).expanduser()
        if not path.is_absolute() and not path.exists() and str(benchmark_root):
            path = Path(benchmark_root).expanduser() / path
        name = path.stem
    else:
        path = benchmark_file(benchmark_root, spec)
        name = spec
    if not path.is_file():
        raise InputError(
            f"data set {spec!r}: {path} does not exist; set eval.benchmark_root to the folder holding "
            f"<name>/<name>_benchmark_qa_pairs.json, or list a JSON/JSONL file in eval.datasets"
        )
    # A record that is not an object becomes a failed sample below, counted like any other malformed one.
    records, media_root = load_records(DatasetConfig(name=str(path)), require_objects=False)
    return Benchmark(name=name, media_root=media_root, samples=expand_qa_pairs(records, str(path)))


def expand_qa_pairs(records: list[Any], source: str) -> list[EvalSample]:
    """Return one sample per question of each `{"video", "qa_pairs"}` record, in file order."""
    samples: list[EvalSample] = []
    asked: Counter[str] = Counter()  # questions seen per video, so a video listed twice keeps unique ids
    for number, record in enumerate(records):
        where = f"{source} record {number}"
        if not isinstance(record, dict):
            samples.append(EvalSample(id=f"record-{number}#0", video=None, error=f"{where} is not an object"))
            continue
        video = record.get("video")
        key = str(record.get("id", video if isinstance(video, str) else f"record-{number}"))
        qa_pairs = record.get("qa_pairs")
        pairs = qa_pairs if isinstance(qa_pairs, list) else [qa_pairs]
        for qa in pairs:
            sample_id = f"{key}#{asked[key]}"
            asked[key] += 1
            sample = _sample(sample_id, video, qa, f"{where} ({sample_id})")
            if sample.error is None:
                try:
                    sample = replace(sample, video_range=record_video_range(record, f"{where} ({sample_id})"))
                except InputError as exc:
                    sample = replace(sample, error=str(exc))
            samples.append(sample)
    return samples


def _structured_answer(answer: Any) -> bool:
    """True when `answer` is Cosmos-Reason2's JSON: a box_2d, a point_2d or a start/end span."""
    try:
        answer_kind(answer if isinstance(answer, str) else "")
    except ValueError:
        return False
    return True


def _sample(sample_id: str, video: Any, qa: Any, where: str) -> EvalSample:
    """Validate one QA pair; a problem becomes the sample's `error` instead of an exception."""
    problem = None
    if not isinstance(video, str) or not video:
        problem = "has no 'video' path"
    elif not isinstance(qa, dict):
        problem = "has no 'qa_pairs' object"
    elif not isinstance(qa.get("question"), str) or not qa["question"].strip():
        problem = "has no 'question' text"
    elif "index2ans" not in qa and _structured_answer(qa.get("answer")):
        reference = {key: value for key, value in qa.items() if key not in ("question", "answer")}
        return EvalSample(id=sample_id, video=video, question=qa["question"], answer=qa["answer"], reference=reference)
    elif not isinstance(qa.get("index2ans"), dict) or not qa["index2ans"]:
        problem = 'has no \'index2ans\' options ({"A": "...", ...}) and no structured JSON answer'
    elif not isinstance(qa.get("answer", qa.get("correct_answer")), str):
        problem = "has no 'answer' (or 'correct_answer')"
    if problem is not None:
        return EvalSample(id=sample_id, video=video if isinstance(video, str) else None, error=f"{where} {problem}")
    return EvalSample(
        id=sample_id,
        video=video,
        question=qa["question"],
        options={str(k): str(v) for k, v in qa["index2ans"].items()},
        answer=qa.get("answer", qa.get("correct_answer")),
    )
