"""Simulate a kill -9 between a checkpoint's rename and the end of its safetensors export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest


class Killed(BaseException):
    """Stands for SIGKILL: no except clause of the trainer catches it, nothing runs after it."""


@contextlib.contextmanager
def killed_during_export(monkeypatch: pytest.MonkeyPatch, step: int) -> Iterator[None]:
    """The run dies when it starts the export of `step`, leaving its half-written staging folder behind."""
    from physreason.models import export

    real = export.export_safetensors

    def dying(model, source, out_dir, *args, **kwargs):
        out_dir = Path(out_dir)
        if out_dir.name == f"step_{step}":
            staging = out_dir.with_name(out_dir.name + ".tmp")
            staging.mkdir(parents=True)
            (staging / "model.safetensors").write_bytes(b"half")
            raise Killed
        return real(model, source, out_dir, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(export, "export_safetensors", dying)
        with pytest.raises(Killed):
            yield
