"""physreason.models.lazy_compile: the functions physreason compiles by itself fall back to eager ops, once and with
a warning, when the machine cannot compile; errors of the computation itself still propagate."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from physreason.models.lazy_compile import LazyCompiled


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_compile_failure_warns_once_and_runs_the_function_eagerly(monkeypatch, caplog):
    calls = []

    def broken_compile(fn, dynamic=None):
        def compiled(*args):
            calls.append(1)
            # built without its constructor, whose arguments change between torch releases
            failure = BackendCompilerFailed.__new__(BackendCompilerFailed)
            Exception.__init__(failure, "backend='inductor' raised:\nRuntimeError: Failed to find C compiler")
            raise failure

        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    lazy = LazyCompiled(_double, dynamic=True)
    with caplog.at_level(logging.WARNING, logger="physreason.models.lazy_compile"):
        first = lazy(torch.ones(3))
        second = lazy(torch.full((2,), 3.0))
    assert torch.equal(first, torch.full((3,), 2.0)) and torch.equal(second, torch.full((2,), 6.0))
    assert calls == [1]  # the compiled function is not tried again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_double" in warnings[0].getMessage()
    assert "runs as eager ops" in warnings[0].getMessage() and lazy.failed.startswith("BackendCompilerFailed")


def test_an_error_of_the_computation_is_not_swallowed(monkeypatch):
    def compile_that_runs(fn, dynamic=None):
        def compiled(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")

        return compiled

    monkeypatch.setattr(torch, "compile", compile_that_runs)
    lazy = LazyCompiled(_double, dynamic=True)
    with pytest.raises(torch.OutOfMemoryError):
        lazy(torch.ones(3))
    assert lazy.failed is None


def test_nothing_compiles_before_the_first_call(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: compiled.append(fn) or fn)
    lazy = LazyCompiled(_double, dynamic=True)
    assert compiled == []
    assert torch.equal(lazy(torch.ones(2)), torch.full((2,), 2.0))
    assert lazy(torch.ones(1)).item() == 2.0 and compiled == [_double]  # compiled once, at the first call
