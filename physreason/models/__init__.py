"""Model loading, tiny random models for tests, parallelisation and export."""

from physreason.models.tiny import TINY_KINDS, build_tiny_model, build_tiny_tokenizer, save_tiny_model

__all__ = ["TINY_KINDS", "build_tiny_model", "build_tiny_tokenizer", "save_tiny_model"]
