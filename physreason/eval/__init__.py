"""Benchmark evaluation: Cosmos-Reason1 benchmarks and Physical AI Bench, sharded resumable runs, scoring, reports."""

from physreason.eval.benchmark import Benchmark, EvalSample, benchmark_file, expand_qa_pairs, load_benchmark
from physreason.eval.launch import EvalOutcome, EvalPlan, RunStatus, plan_eval, run_eval, run_shard
from physreason.eval.pai_bench import (
    BoardReport,
    board_column,
    board_counts,
    board_csv,
    board_markdown,
    board_rich_tables,
    collect_boards,
)
from physreason.eval.report import (
    DatasetReport,
    collect_reports,
    csv_text,
    markdown_report,
    markdown_table,
    report_rows,
    rich_table,
    settings_header,
)
from physreason.eval.results import answer_type_dir, merge_shards, model_slug, read_run, run_dir
from physreason.eval.runner import evaluate_shard
from physreason.eval.scoring import mean_std, score_completion
from physreason.eval.settings import EvalSetup, effective_config, reproduction_settings, resolve_eval_setup

__all__ = [
    "Benchmark",
    "BoardReport",
    "EvalSetup",
    "board_column",
    "board_counts",
    "board_csv",
    "board_markdown",
    "board_rich_tables",
    "collect_boards",
    "effective_config",
    "markdown_report",
    "reproduction_settings",
    "resolve_eval_setup",
    "settings_header",
    "DatasetReport",
    "EvalOutcome",
    "EvalPlan",
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
