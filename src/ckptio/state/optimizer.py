"""Optimizer and LR scheduler as one FQN-keyed, flattened state dict (so it reshards with DCP)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

_OPTIONS = StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


class OptimizerState:
    """Stateful view of an optimizer (and optionally its LR scheduler) for checkpointing.

    Optimizer state is keyed by parameter FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)
    instead of by parameter index, and holds DTensor shards under FSDP2, so a checkpoint saved on N
    ranks loads on M. The scheduler's state (plain numbers) travels in the same state dict.
    """

    def __init__(self, model: nn.Module, optimizer: Any, lr_scheduler: Any | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler

    def state_dict(self) -> dict[str, Any]:
        # get_optimizer_state_dict initialises empty optimizer state (with a zero learning rate), so on
        # load this also serves as the template of shapes and shardings to read into.
        sd: dict[str, Any] = {"optim": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS)}
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = self.lr_scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"], options=_OPTIONS)
        if self.lr_scheduler is not None and "lr_scheduler" in state_dict:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
