"""Inference jobs: one question about local media, or a resumable batch in one process or on Ray Data."""

from physreason.infer.batch import run_batch
from physreason.infer.ray_pipeline import run_ray_batch
from physreason.infer.request import build_request, result_record

__all__ = ["build_request", "result_record", "run_batch", "run_ray_batch"]
