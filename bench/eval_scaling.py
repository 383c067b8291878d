"""Eval sharding across GPUs: `physreason eval --num-gpus N` wall time on the same clips for each N, same machine.

Model, rounds and the results' sha256 check: bench/RESULTS.md ("How the scripts measure"). Answers are sampled, each
request seeded by its sample, so neither its shard nor its batch decides its draws. One JSON line per run and
a summary; JSON to $OUT/eval_scaling.json.
Run (2 GPUs):  python bench/eval_scaling.py --gpus 1 2 --clips 128   (--set KEY=VALUE: passed to every eval)
CPU check:     python bench/eval_scaling.py --tiny --gpus 1 2 --clips 8 --max-tokens 8 --rounds 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Report, add_json, add_shape, device_line
from shapes import SHAPES, build_model_folder


def result_files(results: Path) -> dict[str, bytes]:
    """Every results.jsonl and run.json under a results folder, by relative path."""
    found = sorted(p for name in ("results.jsonl", "run.json") for p in results.rglob(name))
    return {str(p.relative_to(results)): p.read_bytes() for p in found}


def first_difference(a: dict[str, bytes], b: dict[str, bytes]) -> str | None:
    """Where two runs' result files first differ: the file and the first sample line that differs; None if equal."""
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            left, right = (a.get(name) or b"").splitlines(), (b.get(name) or b"").splitlines()
            for line, (x, y) in enumerate(zip(left, right)):
                if x != y:
                    return f"{name} line {line + 1}: {x[:160]!r} vs {y[:160]!r}"
            return f"{name}: {len(left)} vs {len(right)} lines"
    return None


def run_eval(model: Path, data: Path, gpus: int, max_tokens: int, results: Path, sets: list[str]) -> dict:
    """One `physreason eval` over the arrow-of-time clips with `gpus` shards; its wall time and accuracy table."""
    command = [sys.executable, "-m", "physreason", "eval", "-m", str(model), "--engine", "hf", "--benchmark-root",
               str(data), "-d", "arrow_of_time", "--num-gpus", str(gpus), "--no-progress", "--out", str(results),
               "--set", f"generation.max_tokens={max_tokens}"]  # fmt: skip
    for item in sets:
        command += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"eval with --num-gpus {gpus} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    files = result_files(results)
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + body for name, body in files.items())).hexdigest()
    return {"gpus": gpus, "seconds": round(seconds, 2), "table": done.stdout.strip().splitlines()[-1],
            "results_sha256": digest, "files": files}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="--num-gpus values to compare")
    parser.add_argument("--clips", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    add_shape(parser, "qwen2.5-vl-3b", SHAPES)
    parser.add_argument("--tiny", action="store_true", help="the tiny model, to check the script on CPU")
    parser.add_argument("--work", default=None, help="folder for the model, clips and results (default: a temp dir)")
    add_json(parser)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every eval (repeatable), e.g. engine.batch_size=1")
    args = parser.parse_args()
    report = Report("eval_scaling.json", args.json, key="runs", **device_line())

    work = Path(args.work or tempfile.mkdtemp(prefix="eval_scaling_"))
    model = build_model_folder(work / f"model_{args.shape}{'_tiny' if args.tiny else ''}", args.shape, args.tiny)
    data = work / "clips"
    subprocess.run([sys.executable, "-m", "physreason", "data", "synth", "--out", str(data), "--task", "arrow_of_time",
                    "--n", str(args.clips), "--split", "test", "--no-progress"], check=True)  # fmt: skip
    runs = report.rows
    reference: dict[str, bytes] = {}  # the first run's result files
    for round_ in range(args.rounds):
        for gpus in args.gpus if round_ % 2 == 0 else reversed(args.gpus):
            run = run_eval(model, data, gpus, args.max_tokens, work / f"results_r{round_}_g{gpus}", args.sets)
            files = run.pop("files")
            reference = reference or files
            run["differs_from_first"] = first_difference(reference, files)
            report.row({"round": round_, **run})
    summary = {}
    for gpus in args.gpus:
        times = [r["seconds"] for r in runs if r["gpus"] == gpus]
        summary[gpus] = {"median_seconds": statistics.median(times), "clips_per_s": args.clips / statistics.median(times)}
    base = summary[args.gpus[0]]["median_seconds"]
    for gpus, row in summary.items():
        row["speedup"] = base / row["median_seconds"]
        row["scaling_efficiency"] = row["speedup"] / (gpus / args.gpus[0])
    identical = len({r["results_sha256"] for r in runs}) == 1
    print(json.dumps({"summary": summary, "identical": identical, "args": vars(args), "date": time.strftime("%Y-%m-%d")},
                     default=str))  # fmt: skip
    report.update(summary=summary, identical=identical)


if __name__ == "__main__":
    main()
