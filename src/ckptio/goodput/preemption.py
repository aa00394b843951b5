"""Saving on preemption: a signal (``SIGTERM``, or those named) makes the manager save at the end of the current step.

With ``CheckpointConfig.on_preemption`` set, the manager installs a handler on each of ``preemption_signals``. The
handler only notes the signal (one assignment: nothing else is safe in a signal handler) and then calls the handler
it replaced when that was a Python function (a framework's own, such as Lightning's), so that both hear it. At the
next :meth:`~ckptio.CheckpointManager.maybe_save` every rank learns whether any rank got one: an all-reduce (MAX) of
one integer, made at every ``maybe_save`` only when the feature is on (docs/preemption.md gives its cost). So every
rank saves the same step even when the signal reached one rank alone. The save is durable and synchronous; before it,
when ``preemption_grace`` is set and the durable saves in the run's record took longer than that, the manager says
so and takes a memory-tier snapshot first (when the memory tier is on), which then outlives the process. Then it
either closes itself and raises ``SystemExit(0)`` (``"exit"``) or sets ``preempted`` and hands control back
(``"return"``). Closing the manager gives each signal the handler it had before.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from .. import _dist
from ..config_checks import parse_signal
from ..errors import ConfigError

__all__ = ["Preemption", "parse_signal", "RECORDED_SAVES"]

RECORDED_SAVES = 5
"""The newest durable saves of the run's record whose longest time is taken as what the next one costs."""

class Preemption:
    """The handlers on ``config.preemption_signals`` and what the manager does once the ranks agree on a signal
    (``active`` only with ``on_preemption`` set on an enabled manager: otherwise it installs nothing and costs
    nothing)."""

    def __init__(self, config: Any, log: Any, *, defer_previous: bool = False) -> None:
        self.defer_previous = defer_previous
        """The handler replaced is not called from the signal but by :meth:`call_previous`, on every rank together
        once they agreed (Lightning's: it makes a collective call)."""
        self.active = bool(config.on_preemption) and bool(config.enabled)
        self.mode: str | None = config.on_preemption
        self.grace_s: float | None = None
        if config.preemption_grace is not None:
            from .interval import parse_duration

            self.grace_s = parse_duration(config.preemption_grace, "preemption_grace")
        self.log = log
        self.received: int | None = None
        """The signal this process received and has not yet acted on (set by the handler)."""
        self.agreed_on = 0
        """The signal the last :meth:`agreed` found (0: none)."""
        self.preempted: int | None = None
        """The signal the ranks agreed on, once its save committed."""
        self._previous: dict[signal.Signals, Any] = {}
        if not self.active:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(f"on_preemption={self.mode!r}: make the CheckpointManager on the main thread (Python "
                              "runs signal handlers there only), or unset on_preemption")
        for sig in dict.fromkeys(parse_signal(s) for s in config.preemption_signals):
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if not self.defer_previous:
            self.call_previous(signum, frame)

    def call_previous(self, signum: int, frame: Any = None) -> None:
        """Call the handler ``signum`` had before ours, when it was a Python function (a framework's own): it hears
        the signal too. Python's own SIGINT handler is left out: it would raise KeyboardInterrupt and lose the save."""
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def agreed(self) -> int:
        """Collective when active (every rank, at each ``maybe_save``): the signal any rank received, 0 when none did."""
        mine = int(self.received or 0)
        if not self.active or not _dist.is_dist():
            self.agreed_on = mine
            return mine
        import torch
        import torch.distributed as dist

        flag = torch.tensor([mine], dtype=torch.int64, device=_dist.flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed_on = int(flag.item())
        return self.agreed_on

    def stop(self, mgr: Any, step: int, epoch: int, metrics: Any, counters: Any) -> Any:
        """Collective: the memory snapshot first when the grace period cannot hold a durable save, then the durable
        save, committed on every rank; then close and exit, or hand back its directory (``preempted`` set)."""
        signum = self.agreed_on
        name = signal.Signals(signum).name
        where = "this rank" if self.received == signum else "another rank"
        self.received = None
        if _dist.rank() == 0:
            self.log.warning("%s received (on %s): saving step %d durably before stopping", name, where, step)
        if self._memory_first(mgr):
            mgr.save_memory(step=step, epoch=epoch, counters=counters)
            mgr.memory_tier.wait()
        path = mgr.save(step=step, epoch=epoch, metrics=metrics, counters=counters)
        mgr.wait()
        _dist.barrier()  # committed on every rank before any of them goes
        self.preempted = signum
        if _dist.rank() == 0:
            self.log.warning("Saved step %d after %s; %s", step, name, "exiting" if self.mode == "exit" else
                             "handing control back (CheckpointManager.preempted is set)")
        if self.mode == "exit":
            mgr.close()
            _dist.destroy_default_at_exit()  # gloo's threads alive at teardown would abort the process (SIGABRT)
            raise SystemExit(0)
        return path

    def _memory_first(self, mgr: Any) -> bool:
        """Collective: rank 0's judgment, from the run's record, of whether a durable save fits in the grace period
        (said when it does not); whether to take the memory snapshot first."""
        if self.grace_s is None:
            return False
        first = False
        if _dist.rank() == 0:
            cost = durable_cost_s(getattr(mgr._goodput, "record", None))
            if cost is None:
                self.log.warning("preemption_grace=%.3g s: the run's record holds no durable save yet, so whether one "
                                 "fits in the grace period is not known", self.grace_s)
            elif cost > self.grace_s:
                first = mgr.memory_tier is not None
                self.log.warning(
                    "A durable save took up to %.3g s in this run (its record), more than the grace period of %.3g s "
                    "(preemption_grace): %s", cost, self.grace_s,
                    "taking a memory-tier snapshot first" if first else "it may not finish before the process is "
                    "killed; with the memory tier on (memory_every_steps) its snapshot would be taken first")
        return bool(_dist.broadcast_object(first))

    def close(self) -> None:
        """Give each signal the handler it had before (unless someone replaced ours since: theirs stays)."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            try:
                if signal.getsignal(sig) == self._handler:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            except ValueError:  # not the main thread: the process is ending anyway
                pass


def durable_cost_s(record: Any) -> float | None:
    """The longest of the newest durable saves in the run's record (till committed), or ``None`` without any."""
    if record is None:
        return None
    costs = [e.get("total_s", e.get("blocked_s")) for e in record.saves("durable")[-RECORDED_SAVES:]]
    costs = [float(c) for c in costs if c is not None]
    return max(costs) if costs else None
