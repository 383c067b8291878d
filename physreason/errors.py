"""The one exception type for errors a user can cause and fix."""

from __future__ import annotations


class PhysReasonError(Exception):
    """A user-fixable error: bad path, bad config, corrupt video, prompt too long.

    The message names the file, key or sample at fault and says what to do.
    """


class ConfigError(PhysReasonError):
    """A configuration file or override is invalid."""


class InputError(PhysReasonError):
    """An input (video, image, data record) cannot be used as given."""


class Interrupted(PhysReasonError):
    """A run stopped on SIGINT or SIGTERM after keeping its work; the message says how to continue (exit 130)."""

    exit_code = 130


class TrainingDiverged(PhysReasonError):
    """Training produced a non-finite loss or gradient norm; the run stopped before checkpointing it."""
