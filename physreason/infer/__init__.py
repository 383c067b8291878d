"""Inference jobs: one question about local media, or a resumable JSONL batch."""

from physreason.infer.batch import run_batch
from physreason.infer.request import build_request, result_record

__all__ = ["build_request", "result_record", "run_batch"]
