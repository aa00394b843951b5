"""DCP's save, step by step, with ckptio's collectives: four where ``torch.distributed.checkpoint.save`` makes eight.

DCP coordinates a save with four object collectives, each two on the wire (the sizes, then the bytes): the local
plans gathered on rank 0, the final plans scattered back, the write results gathered, rank 0's outcome broadcast;
ckptio added a round of its own after them for the failures DCP does not see (its writer threads). On 4 gloo ranks
that was ~5.5 ms of each rank's CPU per save (issue 70). :func:`save_steps` makes DCP's calls on the planner and the
storage writer, in DCP's order and with DCP's arguments (torch's ``_save_state_dict``), so the folder is DCP's
own and plain DCP reads it (only the order of a file's items differs from ``dcp.save``'s: small ones first, at the
offsets the ``.metadata`` records, :func:`~.writer.head_first`), and coordinates them with two rounds of
:func:`ckptio._dist.decide_on_gathered` (a gather to rank 0 and a broadcast each, one collective apiece once the
frame sizes are known). A failure on any rank, while planning, writing or in rank 0's finish, travels in the next
round's report, and every rank raises it as a ckptio error naming the folder.

Call sequence: :func:`save_steps` is a collective when a process group is initialised.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any, Callable, TypeVar

from ... import _dist, errors
from ...errors import CheckpointError

__all__ = ["save_steps"]

T = TypeVar("T")

Report = tuple[str, str]
"""What the other ranks learn of a rank's failure: its message, and the name of its ckptio error class ("" if not)."""


def save_steps(state_dict: dict[str, Any], storage: Any, planner: Any, *, key: str, where: str,
               written: Callable[[], None]) -> Any:
    """Collective: save ``state_dict`` through DCP's ``storage`` writer and ``planner`` (``None``: DCP's default).
    Returns rank 0's DCP metadata (``None`` on the other ranks).

    ``key`` names the rounds' frame sizes (one per DCP folder and process group, as the planner's plan cache);
    ``written`` runs on each rank after its data is written and raises for a file DCP's writer did not finish (a
    failure on one of its extra threads). Every rank raises the same :class:`CheckpointError` when any rank failed;
    a ``KeyboardInterrupt`` or ``SystemExit`` of this rank's is raised as it is, after the round that tells the
    others."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    steps = _Steps(state_dict, storage, DefaultSavePlanner() if planner is None else planner)
    plan, steps.own = _attempt(steps.local_plan)
    failed, plans = _dist.decide_on_gathered((_report(steps.own), plan), steps.global_plan, key=f"{key}:plans")
    _raise_if_failed(where, failed, steps.own)  # own: rank 0's global step may have set it

    def write() -> Any:  # DCP's write step, then ckptio's check of what the writer threads did
        results = steps.write(plans)
        written()
        return results

    results, steps.own = _attempt(write)
    failed = _dist.decide_on_gathered((_report(steps.own), results), steps.finish, key=f"{key}:results")
    _raise_if_failed(where, failed, steps.own)  # own: rank 0's finish may have set it
    return steps.metadata


class _Steps:
    """DCP's steps of a save (torch's ``_save_state_dict``), each called as DCP calls it; the rounds between them are
    :func:`save_steps`'s. The global step and the finish run on rank 0 and return a failure as a value (the other
    ranks wait for rank 0's broadcast), kept in :attr:`own` to be raised here once every rank has been told."""

    def __init__(self, state_dict: dict[str, Any], storage: Any, planner: Any) -> None:
        self.state_dict, self.storage, self.planner = state_dict, storage, planner
        self.rank = _dist.rank()
        self.metadata: Any = None  # rank 0's, from the global step
        self.own: BaseException | None = None  # this rank's failure

    def local_plan(self) -> Any:
        from torch.distributed.checkpoint.stateful import Stateful

        planner, storage, coordinator = self.planner, self.storage, self.rank == 0
        state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in self.state_dict.items()}
        storage_meta = storage.storage_meta()
        if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
            planner.set_up_planner(state_dict=state, storage_meta=storage_meta, is_coordinator=coordinator)
        else:  # a planner written for an older torch
            planner.set_up_planner(state, coordinator)
        if "kwargs" in inspect.signature(storage.set_up_storage_writer).parameters:
            storage.set_up_storage_writer(coordinator, rank=self.rank, use_collectives=True)
        else:
            storage.set_up_storage_writer(coordinator)
        return storage.prepare_local_plan(planner.create_local_plan())

    def global_plan(self, parts: list[tuple[Report | None, Any]]) -> tuple[dict[int, Report] | None, list[Any]]:
        """Rank 0: the final plans, from every rank's local plan (each pickled for its rank alone)."""
        failed = _failures(parts)
        if failed:
            return failed, []
        try:
            plans, self.metadata = self.planner.create_global_plan([plan for _, plan in parts])
            plans = self.storage.prepare_global_plan(plans)
            # as DCP's scatter: on several ranks each rank (rank 0 too) gets a copy, on one the plan itself
            return None, [pickle.dumps(plan) for plan in plans] if _dist.is_dist() else plans
        except BaseException as exc:  # noqa: BLE001 - sent to every rank, raised there and here
            self.own = exc
            return {self.rank: _described(exc)}, []

    def write(self, plans: list[Any]) -> Any:
        central = pickle.loads(plans[self.rank]) if _dist.is_dist() else plans[self.rank]
        done = self.storage.write_data(self.planner.finish_plan(central), self.planner)
        done.wait()
        return done.value()

    def finish(self, parts: list[tuple[Report | None, Any]]) -> dict[int, Report] | None:
        """Rank 0: DCP's finish (the ``.metadata``, and ckptio's chunk index) from every rank's write results."""
        failed = _failures(parts)
        if failed:
            return failed
        try:
            self.storage.finish(metadata=self.metadata, results=[results for _, results in parts])
        except BaseException as exc:  # noqa: BLE001 - sent to every rank, raised there and here
            self.own = exc
            return {self.rank: _described(exc)}
        return None


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``fn()``, or the exception it raised: every rank goes on to the next round, which reports it (as DCP does, a
    ``KeyboardInterrupt`` too: the other ranks would otherwise wait in that round)."""
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - reported in the next round and raised on every rank
        return None, exc


def _report(exc: BaseException | None) -> Report | None:
    return None if exc is None else _described(exc)


def _described(exc: BaseException) -> Report:
    if isinstance(exc, CheckpointError):
        return str(exc), type(exc).__name__
    return f"{type(exc).__name__}: {exc}", ""


def _failures(parts: list[tuple[Report | None, Any]]) -> dict[int, Report]:
    return {r: report for r, (report, _) in enumerate(parts) if report is not None}


def _raise_if_failed(where: str, failed: dict[int, Report] | None, own: BaseException | None) -> None:
    """Raise on every rank when a round reported failures: the first failing rank's message, as a ckptio error of its
    class (a :class:`CheckpointError` for any other exception), chained from this rank's own."""
    if not failed:
        return
    if own is not None and not isinstance(own, Exception):
        raise own  # Ctrl-C (KeyboardInterrupt), SystemExit: the user's, not a failure of the folder
    message, kind = failed[min(failed)]
    cls = getattr(errors, kind, None) if kind else None
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    raise cls(f"saving DCP folder {where} failed on rank(s) {sorted(failed)}: {message}") from own
