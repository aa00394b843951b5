"""Small helpers over ``torch.distributed`` that degrade to one process without special cases.

Every function here may be called whether or not a process group is initialised. Functions whose
name says "collective" must be called by every rank of the group, in the same order.
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

T = TypeVar("T")


_local = threading.local()


@contextmanager
def using_group(group: Any) -> Iterator[None]:
    """Within this block, on this thread, the collectives of this module (and DCP saves) use ``group``.

    The background writer of async saves runs on its own process group, so that its collectives can
    never interleave with the training loop's on the default group. ``group`` spans every rank, so
    ranks in it are the global ranks.
    """
    previous = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = previous


def current_group() -> Any:
    """The process group this thread's collectives use (``None``: the default group)."""
    return getattr(_local, "group", None)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier() -> None:
    if is_dist():
        dist.barrier(group=current_group())


def broadcast_object(obj: T, src: int = 0) -> T:
    """Collective: every rank returns rank ``src``'s ``obj``."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=current_group())
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Collective: a list with every rank's ``obj``, indexed by rank."""
    if not is_dist():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj, group=current_group())
    return out


def run_collectively(what: str, fn: Callable[[], T]) -> T:
    """Collective: run ``fn`` on every rank, then raise the same error everywhere if any rank failed.

    Without this, a rank that fails while the others wait in the next collective would hang the job.
    Every rank raises: the failing rank re-raises its own exception (chained, with its traceback), the
    others raise a :class:`CheckpointError` that names the failing ranks and their messages (a
    :class:`CheckpointCorruptError` when every failing rank found damage, so that all fall back alike).
    """
    result = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as exc:  # gathered and re-raised below on every rank
        error = exc
    report = None if error is None else (f"{type(error).__name__}: {error}",
                                         isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError)))
    reports = all_gather_object(report)
    failed = {r: rep for r, rep in enumerate(reports) if rep is not None}
    if not failed:
        return result  # type: ignore[return-value]
    if error is not None:
        raise error
    summary = "; ".join(f"rank {r}: {msg}" for r, (msg, _) in sorted(failed.items()))
    # damage another rank found is damage here too: an automatic resume falls back on every rank together
    cls = CheckpointCorruptError if all(damaged for _, damaged in failed.values()) else CheckpointError
    raise cls(f"{what} failed on rank(s) {sorted(failed)}: {summary}")


def format_exc_short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
