"""Importing Ray the way every physreason entry point that may start a local Ray instance needs it."""

from __future__ import annotations

import os
import sys
from typing import Any

from physreason.errors import ConfigError


def import_ray(starts_local: bool, missing: str) -> Any:
    """Import and return Ray; `starts_local`: this run may start a local instance (no cluster address given).

    Ray turns token authentication on for every local instance it starts and warns about that on each start unless
    RAY_AUTH_MODE says so; saying "token" keeps Ray's own secure default without the warning. It must be set before
    Ray is imported: Ray reads it once into its configuration on import. `missing`: the ConfigError's message when
    Ray is not installed.
    """
    if starts_local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(missing) from exc
    return ray
