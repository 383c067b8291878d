"""Order-keeping work in threads: clip decoding ahead of the engine (evaluation, GRPO rollouts)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, lookahead: int = 0) -> Iterator[R]:
    """fn over items, in their order, computed in `workers` threads at most max(lookahead, workers) items ahead of
    the one yielded; workers <= 1 is the plain map in this thread.

    An exception of fn is raised where its item is reached, as in the plain map. Closing the iterator early cancels
    the items not started and waits for the running ones.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    ahead = max(lookahead, workers)
    source = iter(items)
    pending: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="physreason-decode") as pool:
        try:
            for item in source:
                pending.append(pool.submit(fn, item))
                if len(pending) >= ahead:
                    break
            while pending:
                result = pending.popleft().result()
                for item in source:  # one more in flight for each one taken
                    pending.append(pool.submit(fn, item))
                    break
                yield result
        finally:
            for future in pending:
                future.cancel()


def map_in_threads(fn: Callable[[T], R], items: list[T], workers: int) -> list[R]:
    """[fn(item) for item in items], computed in up to `workers` threads (the first exception raised, in order)."""
    return list(ordered_map(fn, items, min(workers, len(items))))
