"""train.cpu_offload_overlap: the host's AdamW step of an offloaded model, overlapped with the next step's forward.

Under train.cpu_offload the fused AdamW over every host shard is a serial pass over host memory after the backward
(28 bytes a trained parameter), and the GPU idles through it. OverlappedHostStep steps the optimizer one FSDP2 unit at
a time, in the order the last forward ran the units, in a background thread, and returns to the training loop at once;
each unit's forward first waits (a forward pre-hook ahead of FSDP2's own, which copies the unit's shards to the GPU)
until that unit is stepped. The numbers are the serial step's: the same kernel, lr, clip coefficient and parameters,
each parameter's update independent of the others; only when each one runs changes.

Whatever reads the weights or the optimizer state other than a forward (the backward, checkpoint save and load,
export, validation, the end of training) calls wait() first. An error in the thread is raised in the main thread at
the next wait (or the next unit's forward), with the thread's traceback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class OverlappedHostStep:
    """The optimizer step of an FSDP2 model, a unit at a time in a background thread (see the module docstring).

    The optimizer (torch's AdamW) keeps its parameter groups, state and state_dict as they are: checkpoints are the
    same with the option on or off. Each unit gets a small AdamW of its own over its parameters, one group per group
    of the optimizer they belong to, that shares the optimizer's `state` and copies its groups' settings (lr, betas,
    weight decay, fused) when a step starts: torch's AdamW updates every parameter on its own, so stepping the units
    one after another gives the serial step's values bit for bit. A unit's gradients are released (set to None, as
    zero_grad(set_to_none=True)) once it is stepped.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(optimizer, torch.optim.Adam):
            raise ValueError(f"OverlappedHostStep steps torch's Adam/AdamW, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]  # root first, then in registration order
        owner: dict[int, int] = {}
        for index in reversed(range(len(units))):  # innermost first: a parameter belongs to the unit nearest it
            for parameter in units[index].parameters():
                owner.setdefault(id(parameter), index)
        self.units = len(units) + 1  # the last: parameters of no unit (none under FSDP2), stepped last, no hook
        self._owner = owner
        self._members: list[tuple[list[nn.Parameter], list[tuple[int, list[nn.Parameter]]]]] = []
        self._steppers: list[torch.optim.Optimizer | None] = []
        self._layout: list[list[int]] = []  # the optimizer's groups as parameter ids, to notice a change
        self._order: list[int] = []  # units in the order the last forward ran them
        self._seen: set[int] = set()
        self._thread: threading.Thread | None = None
        self._done: list[threading.Event] = []
        self._error: BaseException | None = None
        # totals since construction, for benches: steps the thread finished, its seconds, the main thread's seconds
        # blocked on it (forward hooks and wait(): the part of the host step the forward did not hide)
        self.steps, self.step_seconds, self.waited_seconds = 0, 0.0, 0.0
        self.handles = [
            unit.register_forward_pre_hook(self._before_forward_of(index), prepend=True)
            for index, unit in enumerate(units)
        ]

    # --- the main thread ---------------------------------------------------------------------------------------

    def start(self, grad_scale: torch.Tensor | None = None) -> None:
        """Step every unit in the background with the optimizer's current settings; grad_scale: the fused kernel's
        divisor of the gradients (clip_and_step's clip coefficient), or None. Returns at once."""
        self.wait()
        self._build()
        for stepper, (_params, groups) in zip(self._steppers, self._members, strict=True):
            if stepper is None:
                continue
            stepper.state = self.optimizer.state  # load_state_dict replaces the optimizer's state dict
            for group, (source, _subset) in zip(stepper.param_groups, groups, strict=True):
                group.update({k: v for k, v in self.optimizer.param_groups[source].items() if k != "params"})
            if grad_scale is not None:
                stepper.grad_scale = grad_scale  # type: ignore[attr-defined]
            elif hasattr(stepper, "grad_scale"):
                del stepper.grad_scale  # type: ignore[attr-defined]
        # the last forward's order first, then units it did not run (in the module's order)
        order = self._order + [u for u in range(self.units) if u not in set(self._order)]
        self._order, self._seen = [], set()
        self._done = [threading.Event() for _ in range(self.units)]
        self._error = None
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # the schedule's check that a step ran
        self._thread = threading.Thread(target=self._run, args=(order, self._done), name="host-adamw", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the step in flight (if any) is done; raise what the thread raised, with its traceback."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        started = time.perf_counter()
        thread.join()
        self.waited_seconds += time.perf_counter() - started
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def pending(self) -> bool:
        """Whether a step was started and not yet waited for."""
        return self._thread is not None

    def close(self) -> None:
        """Wait for the step in flight and remove the forward hooks."""
        try:
            self.wait()
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def _before_forward_of(self, index: int) -> Any:
        @torch._dynamo.disable
        def before_forward(_module: nn.Module, _args: Any) -> None:
            if index not in self._seen:
                self._seen.add(index)
                self._order.append(index)
            if self._thread is None:
                return
            done = self._done[index]
            if not done.is_set():
                started = time.perf_counter()
                done.wait()
                self.waited_seconds += time.perf_counter() - started
            if self._error is not None:
                self.wait()  # raises it

        return before_forward

    def _build(self) -> None:
        """The units' parameters and steppers, (re)built when the optimizer's groups change (first start)."""
        layout = [[id(p) for p in group["params"]] for group in self.optimizer.param_groups]
        if layout == self._layout:
            return
        members: list[tuple[list[nn.Parameter], list[tuple[int, list[nn.Parameter]]]]] = [
            ([], []) for _ in range(self.units)
        ]
        for source, group in enumerate(self.optimizer.param_groups):
            subsets: dict[int, list[nn.Parameter]] = {}
            for parameter in group["params"]:
                subsets.setdefault(self._owner.get(id(parameter), self.units - 1), []).append(parameter)
            for unit, subset in subsets.items():
                members[unit][0].extend(subset)
                members[unit][1].append((source, subset))
        steppers: list[torch.optim.Optimizer | None] = []
        for _params, groups in members:
            if not groups:
                steppers.append(None)
                continue
            settings = [
                {**{k: v for k, v in self.optimizer.param_groups[s].items() if k != "params"}, "params": subset}
                for s, subset in groups
            ]
            steppers.append(type(self.optimizer)(settings, fused=self.optimizer.defaults.get("fused")))
        self._members, self._steppers, self._layout = members, steppers, layout

    # --- the background thread -----------------------------------------------------------------------------------

    def _run(self, order: list[int], done: list[threading.Event]) -> None:
        started = time.perf_counter()
        try:
            for unit in order:
                stepper = self._steppers[unit]
                if stepper is not None:
                    stepper.step()
                    for parameter in self._members[unit][0]:
                        parameter.grad = None
                done[unit].set()
            self.steps += 1
            self.step_seconds += time.perf_counter() - started
        except BaseException as error:  # raised in the main thread by wait()
            self._error = error
        finally:
            for event in done:
                event.set()


@contextlib.contextmanager
def settled(overlap: OverlappedHostStep | None) -> Iterator[None]:
    """Leaving the block, wait for the step in flight (None: nothing to wait for). On the way out of an exception the
    thread's own error, if any, is logged instead of raised, so the exception that ended the block is the one seen."""
    if overlap is None:
        yield
        return
    try:
        yield
    except BaseException:
        try:
            overlap.wait()
        except BaseException:
            log.exception("the background optimizer step failed too")
        raise
    overlap.wait()
