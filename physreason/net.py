"""Host networking helpers shared by the trainers, the GPU checks, the benches and the tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on every interface of this host right now (a rendezvous or MASTER_PORT; other jobs on the
    machine may hold any fixed one). Another process can still take it before it is bound again."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
