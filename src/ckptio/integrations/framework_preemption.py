"""Saving on preemption in the framework integrations (Lightning, the Hugging Face Trainer, accelerate).

The same fields as :class:`~ckptio.CheckpointConfig`'s (``on_preemption``, ``preemption_signals``; docs/preemption.md)
and the same handler (:class:`ckptio.goodput.preemption.Preemption`): it notes the signal and calls the handler it
replaced (the framework's own, or the script's), so the framework still hears it. At the end of each step the
integration asks :meth:`FrameworkPreemption.due` (collective: one all-reduce of one integer when on), so that every
rank saves the same step even when the signal reached one rank alone; it saves through the framework's own save,
then the framework's run stops (``"exit"``: ``SystemExit(0)``; ``"return"``: the framework's loop ends and control
comes back to the script, the signal in ``preempted``). ``preemption_grace`` is not offered: the run's record the
integrations keep (:mod:`.framework_audit`) holds their saves' costs, but nothing judges the grace by it yet.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from types import SimpleNamespace
from typing import Any, Iterator, NoReturn, Sequence

from .. import _dist
from ..config_checks import validate_preemption
from ..goodput.preemption import Preemption

__all__ = ["FrameworkPreemption", "exit_after_save"]

log = logging.getLogger("ckptio")


def exit_after_save() -> NoReturn:
    """``on_preemption="exit"`` once every rank saved: ``SystemExit(0)``, the process group destroyed at interpreter
    exit (:func:`ckptio._dist.destroy_default_at_exit`) so that the process ends with status 0."""
    _dist.destroy_default_at_exit()
    raise SystemExit(0)


class FrameworkPreemption:
    """The handlers of one integration: checked at construction (a :class:`~ckptio.errors.ConfigError` naming the
    field), installed by :meth:`install` (on the main thread), given back by :meth:`close`."""

    def __init__(self, on_preemption: str | None, preemption_signals: Sequence[Any] = ("SIGTERM",),
                 who: str = "", defer_previous: bool = False) -> None:
        self._config = SimpleNamespace(on_preemption=on_preemption, preemption_signals=preemption_signals,
                                       preemption_grace=None, enabled=True)
        validate_preemption(self._config)
        self.mode: str | None = on_preemption
        self.who, self.defer_previous = who, defer_previous
        self._handler: Preemption | None = None
        self.preempted: int | None = None
        """The signal on which the integration saved and stopped the run (``None`` before)."""

    def install(self) -> None:
        """Put ckptio's handler on the signals (when on, once): it chains to the handler each had."""
        if self.mode is not None and self._handler is None:
            self._handler = Preemption(self._config, log, defer_previous=self.defer_previous)

    def due(self) -> int:
        """Collective when installed (every rank, at the end of each step): the signal any rank received, 0 when
        none did."""
        return self._handler.agreed() if self._handler is not None else 0

    def call_previous(self, signum: int) -> None:
        """With ``defer_previous`` (every rank, after the save): the handler the signal had before ckptio's, called
        on every rank together, whichever got the signal."""
        if self._handler is not None and self.defer_previous:
            self._handler.call_previous(signum)

    def saved(self, signum: int, what: str) -> None:
        """Say that ``what`` (the step, the folder) was saved on every rank after ``signum``; the run stops next."""
        assert self._handler is not None
        where = "this rank" if self._handler.received == signum else "another rank"
        self._handler.received = None
        self.preempted = signum
        if _dist.rank() == 0:
            log.warning("%s: %s received (on %s); saved %s on every rank, %s", self.who,
                        signal.Signals(signum).name, where, what,
                        "exiting" if self.mode == "exit" else "stopping the run and handing control back")

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        """Installed for the block (a framework's run), given back after it; once the block ends after a save on
        preemption with ``on_preemption="exit"``: ``SystemExit(0)``."""
        self.install()
        try:
            yield
        finally:
            self.close()
        if self.preempted and self.mode == "exit":
            exit_after_save()

    def close(self) -> None:
        """Give each signal the handler it had before ours (unless something replaced ours since)."""
        if self._handler is not None:
            self._handler.close()
            self._handler = None


def trainer_callback(preemption: FrameworkPreemption) -> Any:
    """The Hugging Face Trainer's end of a step: when a signal came to any rank, ``should_save`` (the Trainer saves
    this step through ``CkptioTrainer``'s save, on every rank) and ``should_training_stop`` (``train`` returns)."""
    from transformers import TrainerCallback

    class CkptioPreemptionCallback(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            signum = preemption.due()
            if signum:
                control.should_save = control.should_training_stop = True
                preemption.saved(signum, f"step {state.global_step}")

    return CkptioPreemptionCallback()
