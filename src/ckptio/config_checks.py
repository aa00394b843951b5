"""Checks of :class:`~ckptio.config.CheckpointConfig`'s settings: the keep-rules, the switches, the two tiers and their
intervals (each raises a :class:`~ckptio.errors.ConfigError` naming the key, the value and what it may be)."""

from __future__ import annotations

import os
import signal
import string
from typing import Any

from .errors import ConfigError

__all__ = ["validate_preemption", "validate_retention", "validate_switches", "validate_tiers"]


def validate_tiers(self: Any) -> None:
    """The memory tier's settings and the intervals of both tiers (``"auto"``: :mod:`ckptio.goodput`)."""
    for name in ("memory_every_steps", "persist_every_steps", "auto_min_steps", "auto_max_steps"):
        value = getattr(self, name)
        if value is None and name != "auto_min_steps" or value == "auto" and name.endswith("every_steps"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer{', auto' if 'every' in name else ''} or null, "
                              f"got {value!r}")
    if self.auto_max_steps is not None and self.auto_max_steps < self.auto_min_steps:
        raise ConfigError(f"auto_max_steps ({self.auto_max_steps}) is below auto_min_steps ({self.auto_min_steps})")
    if self.mtbf is not None:
        from .goodput.interval import parse_duration

        parse_duration(self.mtbf, "mtbf")
    share = self.memory_recovers
    if share is not None and (not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1):
        raise ConfigError(f"memory_recovers must be a share between 0 and 1 or null, got {share!r}")
    if not isinstance(self.run_record, bool):
        raise ConfigError(f"run_record must be true or false, got {self.run_record!r}")
    k = self.memory_replicas
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"memory_replicas must be a positive integer (the nodes holding each part), got {k!r}")
    if isinstance(self.memory_dir, os.PathLike):
        self.memory_dir = os.fspath(self.memory_dir)
    if self.memory_dir is not None and (not isinstance(self.memory_dir, str) or not self.memory_dir
                                        or "://" in self.memory_dir):
        raise ConfigError(f"memory_dir must be a local folder (a RAM-backed one such as /dev/shm/ckptio), got "
                          f"{self.memory_dir!r}")


def validate_retention(self: Any) -> None:
    """The keep-rules' settings."""
    if self.mode not in ("min", "max"):
        raise ConfigError(f"mode must be 'min' or 'max', got {self.mode!r}")
    for name in ("save_top_k", "keep_latest", "keep_every_n_steps", "max_recent_checkpoints", "keep_optimizer_latest"):
        value = getattr(self, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < (-1 if name == "save_top_k" else 1)):
            raise ConfigError(f"{name} must be {'-1, 0 or a positive' if name == 'save_top_k' else 'a positive'} "
                              f"integer or null, got {value!r}")
    if self.keep_newer_than_s is not None and (not isinstance(self.keep_newer_than_s, (int, float))
                                               or self.keep_newer_than_s < 0):
        raise ConfigError(f"keep_newer_than_s must be a non-negative number of seconds, got {self.keep_newer_than_s!r}")
    if self.monitor is not None and not isinstance(self.monitor, str):
        raise ConfigError(f"monitor must be a metric name, got {self.monitor!r}")


def validate_switches(self: Any) -> None:
    """The lists of names and the switches (true, false and, where allowed, null)."""
    for name in ("load_states", "load_exclude"):
        value = getattr(self, name)
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{name} must be a list of names, got {value!r}")
    for name in [n for n in ("is_async", "share_reads") if type(getattr(self, n)) not in (type(None), bool)]:
        raise ConfigError(f"{name} must be true, false or null, got {getattr(self, name)!r}")
    for name in ("is_peft", "enabled", "strict", "auto_insert_field_names", "save_last", "async_save",
                 "wait_for_staging", "load_cast_dtype", "start_fresh_if_damaged", "share_unchanged",
                 "sync_saves_may_fail"):
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
    allowed = self.failed_saves_allowed
    if type(allowed) is not int or not 0 <= allowed <= 10**6:
        raise ConfigError(f"failed_saves_allowed must be a whole number of saves from 0 (raise at the first failure) "
                          f"to 1000000, got {allowed!r}")
    if type(self.audit_steps) is not int or not 0 <= self.audit_steps <= 100:
        raise ConfigError(f"audit_steps must be a whole number of steps from 0 (no resume audit) to 100, got "
                          f"{self.audit_steps!r}")
    tol = self.audit_tolerance
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol <= 1:
        raise ConfigError(f"audit_tolerance must be a relative difference in [0, 1] (0: exact), got {tol!r}")


def validate_preemption(self: Any) -> None:
    """Saving on preemption: the mode, the signals (names or numbers that can be caught), the grace period."""
    if self.on_preemption not in (None, "exit", "return"):
        raise ConfigError(f"on_preemption must be 'exit' (save, then exit), 'return' (save, then set "
                          f"CheckpointManager.preempted) or null (off), got {self.on_preemption!r}")
    signals = self.preemption_signals
    if isinstance(signals, (str, int)):
        signals = [signals]
    if not isinstance(signals, (list, tuple)) or not signals:
        raise ConfigError(f"preemption_signals must be a list of signal names such as ['SIGTERM'], got {signals!r}")
    self.preemption_signals = [parse_signal(s).name for s in signals]
    if self.preemption_grace is not None:
        if self.on_preemption is None:
            raise ConfigError("preemption_grace is set but on_preemption is not: set on_preemption ('exit' or "
                              "'return') to save on preemption")
        from .goodput.interval import parse_duration

        parse_duration(self.preemption_grace, "preemption_grace")


_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signal(value: Any, what: str = "preemption_signals") -> signal.Signals:
    """A signal from its name (``"SIGTERM"``, ``"TERM"``) or number; a wrong one raises naming ``what``."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            sig = signal.Signals(value)
        elif isinstance(value, str):
            name = value.strip().upper()
            sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        else:
            raise KeyError(value)
    except (KeyError, ValueError):
        import difflib

        close = difflib.get_close_matches(str(value).upper(), [s.name for s in signal.Signals], n=1)
        raise ConfigError(f"{what}: {value!r} is not a signal" + (f"; did you mean {close[0]!r}?" if close else
                          " (names such as 'SIGTERM', 'SIGUSR1', or numbers)")) from None
    if sig in _UNCATCHABLE:
        raise ConfigError(f"{what}: {sig.name} cannot be caught by any process; name a signal the job's scheduler "
                          "sends ahead of it (SIGTERM, or SIGUSR1 with slurm's --signal)")
    return sig


def parse_save_consolidated(value: object) -> Any:
    """``save_consolidated`` from what a YAML file or a command line gives: false, ``"final"`` or true (every)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "1"):
            return True
        if low in ("false", "no", "0", "none", ""):
            return False
        if low == "final":
            return "final"
        if low == "every":
            return True
    raise ConfigError(f"save_consolidated must be false, 'final', 'every' or true (the same as 'every'), got {value!r}")


def validate_template(template: object) -> None:
    """``name_template``: a format string naming one directory per step."""
    if not isinstance(template, str) or not template:
        raise ConfigError("name_template must be a non-empty format string such as 'epoch_{epoch}_step_{step}'")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(f"name_template {template!r} is not a valid format string: {exc}") from exc
    for required in ("step",):
        if required not in names:
            raise ConfigError(
                f"name_template {template!r} must contain {{{required}}} so that every step gets its own directory"
            )
    if "/" in template or "\\" in template or template.startswith("."):
        raise ConfigError(f"name_template {template!r} must name a single directory (no '/', no leading '.')")
