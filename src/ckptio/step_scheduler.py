"""Counts training steps and epochs and says when to validate, checkpoint and stop."""

from __future__ import annotations

from typing import Any


class StepScheduler:
    """Training position plus the schedule derived from it; its state is checkpointed.

    ``step`` counts completed optimizer steps (the name of a checkpoint taken after step 20 says 20);
    ``epoch`` counts completed passes over the data.

    Args:
        max_steps: stop after this many steps (``None``: run ``num_epochs`` epochs).
        num_epochs: stop after this many epochs when ``max_steps`` is ``None``.
        ckpt_every_steps: checkpoint when ``step`` is a multiple of this, and at the last step (``done``), so the
            end of training is always saved (``None``: never by schedule; ``"auto"``: at the interval that pays,
            chosen by the :class:`~ckptio.CheckpointManager` given this scheduler from the measured cost of saves
            and ``mtbf``, and at the last step; :meth:`is_ckpt_step` is then a collective, called by every rank at
            every step). The last step is known when ``max_steps`` ends the run; a run that ends with its epochs
            learns it only after the loop, so save once more there.
        val_every_steps: validate when ``step`` is a multiple of this (``None``: never).
    """

    def __init__(
        self,
        *,
        max_steps: int | None = None,
        num_epochs: int = 1,
        ckpt_every_steps: int | str | None = None,
        val_every_steps: int | None = None,
    ) -> None:
        for name, value in (("max_steps", max_steps), ("ckpt_every_steps", ckpt_every_steps),
                            ("val_every_steps", val_every_steps)):
            if name == "ckpt_every_steps" and value == "auto":
                continue
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(num_epochs, int) or num_epochs < 1:
            raise ValueError(f"num_epochs must be a positive integer, got {num_epochs!r}")
        self.max_steps = max_steps
        self.num_epochs = num_epochs
        self.ckpt_every_steps = ckpt_every_steps
        self.val_every_steps = val_every_steps
        self.step = 0
        self.epoch = 0
        self.auto: Any = None
        """The manager's :class:`~ckptio.goodput.Goodput` when ``ckpt_every_steps`` is ``"auto"``."""

    @property
    def done(self) -> bool:
        if self.max_steps is not None:
            return self.step >= self.max_steps
        return self.epoch >= self.num_epochs

    def is_ckpt_step(self) -> bool:
        """Whether to checkpoint after the step just counted: every ``ckpt_every_steps`` steps and at the last one."""
        if self.ckpt_every_steps == "auto":
            if self.auto is None:
                raise RuntimeError('ckpt_every_steps="auto" needs a CheckpointManager made with this step_scheduler')
            self.auto.tick(self.step)
            return bool(self.auto.due("durable", self.step)) or self.done
        if not self.ckpt_every_steps:
            return False
        return self.step % self.ckpt_every_steps == 0 or self.done  # type: ignore[operator]

    def is_val_step(self) -> bool:
        return bool(self.val_every_steps) and self.step % self.val_every_steps == 0  # type: ignore[operator]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.epoch = int(sd["epoch"])
