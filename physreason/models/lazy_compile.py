"""Small pointwise and reduction functions that physreason compiles by itself on GPUs, whatever train.compile says.

The trainer's step runs a few functions whose eager ops make several passes over large tensors (the loss chunk's
softmax and gradient, the widening of bf16 gradients); torch.compile fuses each into one or two kernels. They are
compiled at their first call on a GPU, not at import, and a machine that cannot compile (no C compiler for
Triton's launcher, a broken Triton) must not lose the run over a speed-up: the first failure to compile logs one
warning naming the function and why, and that function runs eagerly from then on. Errors of the computation itself
(out of memory, bad shapes) are not compile failures and propagate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def _compile_failure(exc: BaseException) -> bool:
    """Whether `exc` says the compiler failed (dynamo or its backend), not the function's own computation."""
    from torch._dynamo import exc as dynamo_exc

    kinds = tuple(
        kind
        for kind in (getattr(dynamo_exc, name, None) for name in ("BackendCompilerFailed", "InternalTorchDynamoError"))
        if isinstance(kind, type)
    )
    return isinstance(exc, kinds)


def compiles_here(mode: str, tensor: torch.Tensor) -> bool:
    """Whether a function switched by `mode` runs compiled for `tensor`: "cuda" (on a GPU: the default of each
    switch), "always" (CPU too: tests pin the compiled math), "never" (eager everywhere: benches A/B the path before)."""
    return mode == "always" or (mode == "cuda" and tensor.is_cuda)


class LazyCompiled:
    """`fn` through torch.compile(fn, dynamic=dynamic), compiled at the first call; eager after a compile failure."""

    def __init__(self, fn: Callable[..., Any], dynamic: bool | None) -> None:
        self.fn = fn
        self.dynamic = dynamic
        self.compiled: Callable[..., Any] | None = None
        self.failed: str | None = None  # why compiling failed (then every call is eager)

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=self.dynamic)
        try:
            return self.compiled(*args)
        except Exception as exc:
            if not _compile_failure(exc):
                raise
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.warning(
                "torch.compile of %s failed (%s); it runs as eager ops from now on (same results, slower). A GPU "
                "machine needs a C compiler and a working Triton for compiled kernels.",
                self.fn.__qualname__, self.failed,
            )  # fmt: skip
            return self.fn(*args)
