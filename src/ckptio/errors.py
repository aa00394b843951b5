"""The exceptions ckptio raises.

Every error derives from :class:`CheckpointError`. Subclasses also inherit the builtin that matches
their meaning, so ``except FileNotFoundError`` or ``except ValueError`` keeps working for callers that
do not know about ckptio.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptError",
    "ConfigError",
]


class CheckpointError(Exception):
    """Root of every error raised by ckptio."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, or a file a checkpoint needs, does not exist."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the objects it is loaded into (missing keys, other shapes...)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's files are unreadable, truncated, or disagree with its manifest."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""
