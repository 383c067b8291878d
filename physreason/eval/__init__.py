"""Benchmark evaluation: Cosmos-Reason1 benchmark loading, sharded resumable runs, scoring and reports."""

from physreason.eval.benchmark import Benchmark, EvalSample, benchmark_file, expand_qa_pairs, load_benchmark
from physreason.eval.launch import EvalOutcome, RunStatus, plan_eval, run_eval, run_shard
from physreason.eval.report import DatasetReport, collect_reports, csv_text, markdown_table, report_rows, rich_table
from physreason.eval.results import answer_type_dir, merge_shards, model_slug, read_run, run_dir
from physreason.eval.runner import evaluate_shard
from physreason.eval.scoring import mean_std, score_completion

__all__ = [
    "Benchmark",
    "DatasetReport",
    "EvalOutcome",
    "EvalSample",
    "RunStatus",
    "answer_type_dir",
    "benchmark_file",
    "collect_reports",
    "csv_text",
    "evaluate_shard",
    "expand_qa_pairs",
    "load_benchmark",
    "markdown_table",
    "mean_std",
    "merge_shards",
    "model_slug",
    "plan_eval",
    "read_run",
    "report_rows",
    "rich_table",
    "run_dir",
    "run_eval",
    "run_shard",
    "score_completion",
]
