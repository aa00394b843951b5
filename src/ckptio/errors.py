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
    "MissingDependencyError",
    "NoUsableCheckpointError",
    "require",
]


class CheckpointError(Exception):
    """Root of every error raised by ckptio."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, or a file a checkpoint needs, does not exist."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the objects it is loaded into (missing keys, other shapes...)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's files are unreadable, truncated, or disagree with its manifest."""


class NoUsableCheckpointError(CheckpointCorruptError):
    """A checkpoint folder holds step directories, but none of them can be loaded; ``skipped`` lists each with why.

    Raised by an automatic resume instead of starting from scratch (which would silently throw the run's
    progress away), unless ``CheckpointConfig.start_fresh_if_damaged`` asks for a fresh start.
    """

    def __init__(self, message: str, skipped: "list[tuple[str, str]] | None" = None) -> None:
        super().__init__(message)
        self.skipped = list(skipped or [])


class ConfigError(CheckpointError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional dependency a feature needs is not installed; the message gives the extra to install."""


def require(module: str, *, extra: str, purpose: str, package: str | None = None):  # noqa: ANN201 - the module
    """Import ``module`` for ``purpose``, or raise :class:`MissingDependencyError` with the install line
    (``package``: the distribution's name, when it is not the module's first part)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = package or module.split(".")[0]
        raise MissingDependencyError(
            f"{purpose} needs the optional dependency {top!r}, which is not installed: pip install 'ckptio[{extra}]'"
        ) from exc
