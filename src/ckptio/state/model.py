"""The model as a flat, FQN-keyed state dict of (possibly sharded) tensors.

Handles FSDP2/DTensor models through ``torch.distributed.checkpoint.state_dict`` (each rank sees its
local shards as DTensors), skips non-persistent buffers (they are rebuilt by the model's
constructor), drops tied aliases such as ``lm_head.weight`` only while they are the very parameter another name
holds (read again at each save: a head untied after the manager was made is saved), and can strip an outer key
prefix (``module.``) so that checkpoints do not depend on wrappers. A ``torch.compile``d model is saved and restored
as the model it compiled (the same parameters, no ``_orig_mod.`` in its keys), so either loads the other's
checkpoints.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict


class ModelState:
    """Stateful view of a model for checkpointing.

    Args:
        model: the live model (plain, FSDP2-sharded, or a PEFT model).
        key_prefix: an outer prefix to remove from saved keys and add back on load, e.g. ``"_orig_mod."``.
        trainable_only: save only parameters with ``requires_grad`` (PEFT adapters); load non-strictly.
    """

    def __init__(self, model: nn.Module, *, key_prefix: str = "", trainable_only: bool = False) -> None:
        self.model = uncompiled(model)
        self.key_prefix = key_prefix
        self.trainable_only = trainable_only

    @property
    def tied_aliases(self) -> dict[str, str]:
        """Alias key -> primary key for parameters registered under several names (the same object), as the model
        holds them now: read at each call, since ``lm_head.weight = nn.Parameter(...)`` unties them at any time."""
        first: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            primary = first.setdefault(id(param), name)
            if primary != name:
                aliases[name] = primary
        return aliases

    def _strip(self, key: str) -> str:
        if self.key_prefix and key.startswith(self.key_prefix):
            return key[len(self.key_prefix):]
        return key

    def _trainable_keys(self) -> set[str]:
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def frozen_keys(self, state_dict: dict[str, Any]) -> frozenset[str]:
        """The keys of ``state_dict`` (this view's) that are not trainable parameters: frozen weights and buffers."""
        trainable = {self._strip(k) for k in self._trainable_keys()}
        return frozenset(k for k in state_dict if k not in trainable)

    def state_dict(self, got: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Local shards (DTensors under FSDP2) keyed by FQN, without tied aliases or the prefix. ``got``: torch's
        ``get_model_state_dict`` of the model, when the caller already has it."""
        raw: dict[str, Any] = got if got is not None else get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=False))
        keep: Callable[[str], bool] = lambda k: True  # noqa: E731
        if self.trainable_only:
            trainable = self._trainable_keys()
            keep = trainable.__contains__
        aliases = self.tied_aliases
        return {self._strip(k): v for k, v in raw.items()  # type: ignore[misc]
                if not (k in aliases and _same_tensor(v, raw.get(aliases[k]))) and keep(k)}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` (shaped like :meth:`state_dict`'s output) into the model."""
        full = {self.key_prefix + k: v for k, v in state_dict.items()}
        strict = not self.trainable_only
        aliases = self.tied_aliases
        missing, unexpected = _set(self.model, full, strict=False)
        if strict:
            missing = [k for k in missing if k not in aliases]
            if missing or unexpected:
                from ..errors import CheckpointMismatchError

                raise CheckpointMismatchError(
                    f"model state does not match: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
        tie = getattr(self.model, "tie_weights", None)
        if aliases and callable(tie):
            tie()


def uncompiled(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile`` wrapper (an ``OptimizedModule``, which holds the same parameters) compiled;
    any other model as it is."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod  # noqa: SLF001 - torch's documented way back to the compiled module
    return model


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two state-dict values are one tensor's bytes (a tie), not two tensors."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a is b:
        return True
    from torch.distributed.tensor import DTensor

    la = a._local_tensor if isinstance(a, DTensor) else a  # noqa: SLF001
    lb = b._local_tensor if isinstance(b, DTensor) else b  # noqa: SLF001
    return (la.data_ptr(), la.shape, la.stride(), la.dtype) == (lb.data_ptr(), lb.shape, lb.stride(), lb.dtype)


def _set(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool) -> tuple[list[str], list[str]]:
    result = set_model_state_dict(model, state_dict,  # type: ignore[arg-type]
                                  options=StateDictOptions(full_state_dict=False, strict=strict))
    return list(result.missing_keys), list(result.unexpected_keys)
