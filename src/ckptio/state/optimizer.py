"""The optimizer as one FQN-keyed, flattened state dict (so it reshards with DCP)."""

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
    """Stateful view of an optimizer for checkpointing.

    Optimizer state is keyed by parameter FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)
    instead of by parameter index, and holds DTensor shards under FSDP2, so a checkpoint saved on N
    ranks loads on M. (The LR scheduler is saved on its own, as a small state: its ``state_dict`` may
    hold empty containers, such as ``LambdaLR``'s ``lr_lambdas: [{}]``, that DCP's flattening drops.)
    """

    def __init__(self, model: nn.Module, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        # get_optimizer_state_dict initialises empty optimizer state (with a zero learning rate), so on
        # load this also serves as the template of shapes and shardings to read into.
        return {"optim": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"], options=_OPTIONS)
