"""Read benchmark data sets into one sample per question: multiple choice, or a structured answer.

Two record layouts, told apart per record:
- Cosmos-Reason1's benchmark: `<benchmark_root>/<name>/<name>_benchmark_qa_pairs.json`, a list of
  `{"video": "clips/x.mp4", "qa_pairs": {"question", "index2ans": {"A": ...}, "answer" | "correct_answer"}}`
  where `qa_pairs` may also be a list, and `video_start` / `video_end` (seconds) may select part of the clip.
  A question with no `index2ans` whose `answer` is Cosmos-Reason2's JSON (`box_2d`, `point_2d` or
  `start`/`end`, as `data synth` grounding and temporal_localization write) is a structured question,
  scored by IoU;
- Physical AI Bench (SHI-Labs/physical-ai-bench, reason/run.py; Hub data set shi-labs/physical-ai-bench-reason,
  split "test"): one question per record, `{"question", "index2ans": {"A": ..., "B": None}, "video_path",
  "answer", "category", "subcategory"}`, options whose text is None left out, as its reference does.
A data set is a name under `benchmark_root` (Reason1's QA file, or a folder), a JSON/JSONL/parquet file, a
dataset folder (a `datasets.save_to_disk` folder or a Hub snapshot of parquet/JSON files) or a Hub data set id.
Media paths are relative to the QA file's folder, or to the dataset folder.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from physreason.chat.structured import answer_kind, grounds_2d, reference_problem
from physreason.config import DatasetConfig
from physreason.data.loaders import load_records, load_snapshot_records
from physreason.data.video_range import record_video_range
from physreason.errors import InputError

_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
PAI_BENCH = "physical_ai_bench"  # Benchmark.board of data sets in Physical AI Bench's layout
PAI_BENCH_SPLIT = "test"


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
    category: str | None = None  # Physical AI Bench's category and subcategory (None in Reason1's layout)
    subcategory: str | None = None

    @property
    def structured(self) -> bool:
        """True for a question answered in Cosmos-Reason2's JSON (box, point, time span) instead of a letter."""
        return self.error is None and self.options is None

    @property
    def grounding_2d(self) -> bool:
        """True for a structured question answered with a 2D box or point (on its model's coordinate grid)."""
        return self.structured and grounds_2d(self.answer)


@dataclass(frozen=True)
class Benchmark:
    """A data set's name, the folder its media paths are relative to, and its samples in file order."""

    name: str
    media_root: Path
    samples: list[EvalSample]
    board: str | None = None  # PAI_BENCH when the records are in Physical AI Bench's layout (its report columns)
    source: str = ""  # the file, folder or Hub id the samples were read from, for messages naming a question


def benchmark_file(benchmark_root: str | Path, name: str) -> Path:
    """Return `<benchmark_root>/<name>/<name>_benchmark_qa_pairs.json`, the reference layout's QA file."""
    return Path(benchmark_root).expanduser() / name / f"{name}_benchmark_qa_pairs.json"


def load_benchmark(spec: str, benchmark_root: str | Path) -> Benchmark:
    """Load a data set named in `eval.datasets`: a name under `benchmark_root`, a data file, a folder or a Hub id.

    Raises InputError when nothing is found, the file is not a list of records, or a structured question's
    reference box, point or time span is unusable (see reference_problem). Other malformed questions do not raise:
    they become samples with `error` set, so a run counts them and goes on.
    """
    root = Path(benchmark_root).expanduser() if str(benchmark_root) else None
    if spec.endswith(_DATA_SUFFIXES):
        path = Path(spec).expanduser()
        if not path.is_absolute() and not path.exists() and root is not None:
            path = root / path
        if not path.is_file():
            raise InputError(f"data set {spec!r}: {path} does not exist; list an existing data file in eval.datasets")
        # A record that is not an object becomes a failed sample below, counted like any other malformed one.
        records, media_root = load_records(DatasetConfig(name=str(path)), require_objects=False)
        return _benchmark(path.stem, media_root, records, str(path))
    qa_file = benchmark_file(benchmark_root, spec)
    if qa_file.is_file():
        records, media_root = load_records(DatasetConfig(name=str(qa_file)), require_objects=False)
        return _benchmark(spec, media_root, records, str(qa_file))
    folder = _dataset_folder(spec, root)
    if folder is None:
        raise InputError(
            f"data set {spec!r}: {qa_file} does not exist; set eval.benchmark_root to the folder holding "
            f"<name>/<name>_benchmark_qa_pairs.json, or list a JSON/JSONL/parquet file, a dataset folder or a "
            f"Hub data set id (owner/name) in eval.datasets"
        )
    records, _ = load_snapshot_records(folder, PAI_BENCH_SPLIT)
    return _benchmark(folder.name, folder.resolve(), records, str(folder))


def _dataset_folder(spec: str, root: Path | None) -> Path | None:
    """The local folder a data set spec names (as given, or under benchmark_root), else a Hub snapshot of it.

    A spec of the form owner/name that is no local folder is downloaded from the Hub (a dataset repository,
    videos included) into the Hugging Face cache; None when the spec is neither.
    """
    for candidate in (Path(spec).expanduser(), *([root / spec] if root is not None else [])):
        if candidate.is_dir():
            return candidate
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is None:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=spec, repo_type="dataset"))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise InputError(
            f"data set {spec!r} is no local folder and could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {exc}); download it (huggingface-cli download --repo-type dataset {spec} "
            "--local-dir DIR) and list DIR in eval.datasets"
        ) from exc


def _benchmark(name: str, media_root: Path, records: list[Any], source: str) -> Benchmark:
    """A Benchmark of the records, read in Physical AI Bench's layout when any record is in it."""
    if any(_is_pai_record(record) for record in records):
        return Benchmark(name, media_root, expand_pai_records(records, source), board=PAI_BENCH, source=source)
    return Benchmark(name, media_root, expand_qa_pairs(records, source), source=source)


def _is_pai_record(record: Any) -> bool:
    return isinstance(record, dict) and "qa_pairs" not in record and "video_path" in record


def expand_pai_records(records: list[Any], source: str) -> list[EvalSample]:
    """One sample per Physical AI Bench record, in file order; ids are "<video_path>#<k>" (or the record's id).

    Options whose text is None are dropped (the reference does so when it writes the prompt).
    """
    samples: list[EvalSample] = []
    asked: Counter[str] = Counter()
    for number, record in enumerate(records):
        where = f"{source} record {number}"
        if not isinstance(record, dict):
            samples.append(EvalSample(id=f"record-{number}#0", video=None, error=f"{where} is not an object"))
            continue
        video = record.get("video_path")
        key = str(record.get("id", video if isinstance(video, str) else f"record-{number}"))
        sample_id = f"{key}#{asked[key]}"
        asked[key] += 1
        options = record.get("index2ans")
        if isinstance(options, dict):
            options = {str(letter): text for letter, text in options.items() if text is not None}
        qa = {"question": record.get("question"), "index2ans": options, "answer": record.get("answer")}
        sample = _sample(sample_id, video, qa, f"{where} ({sample_id})", video_key="video_path")
        category, subcategory = record.get("category"), record.get("subcategory")
        samples.append(
            replace(
                sample,
                category="" if category is None else str(category),
                subcategory="" if subcategory is None else str(subcategory),
            )
        )
    return samples


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


def _sample(sample_id: str, video: Any, qa: Any, where: str, video_key: str = "video") -> EvalSample:
    """Validate one QA pair; a problem becomes the sample's `error` instead of an exception, except an unusable
    structured reference (see reference_problem), which is an InputError naming the record."""
    problem = None
    if not isinstance(video, str) or not video:
        problem = f"has no {video_key!r} path"
    elif not isinstance(qa, dict):
        problem = "has no 'qa_pairs' object"
    elif not isinstance(qa.get("question"), str) or not qa["question"].strip():
        problem = "has no 'question' text"
    elif "index2ans" not in qa and (wrong := reference_problem(qa)) is not None:
        raise InputError(f"{where}: {wrong}; fix this reference in the benchmark file (or remove the question)")
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
