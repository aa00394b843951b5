"""torch's state dicts of a model and its optimizer, built once and kept between saves while what they are made of
stays the same.

A background save's pause is the copy of the state into the staging buffers plus everything around it; the largest
part around it is torch's ``get_state_dict`` (about 40 ms for a 150M-parameter Llama: every parameter's names are
worked out again, the optimizer's state is walked and flattened). Its result between two saves of an unchanged model
is the same dict of the same tensors: views of the parameters and the optimizer's own state tensors, which training
updates in place. So :class:`KeptStateDicts` keeps the dicts of the last save, and each later save checks, in one
walk of the modules and the optimizer (about 1 ms), that nothing they are made of changed:

- every module's parameters and persistent buffers: the same objects, under the same names, over the same memory
  (``param.data = …``, ``model.to(…)``, a new submodule or a re-registered buffer all change this), and no module
  whose state dict torch cannot reproduce from these alone (a post-hook, or its own ``state_dict``,
  ``_save_to_state_dict`` or ``get_extra_state``, on its class or set on the instance at any time,
  ``module.state_dict = types.MethodType(…)``: such a model is not kept from then on);
- an optimizer whose ``state_dict`` is torch's (not its class's own, nor one set on the instance) and has no
  post-hook;
- every parameter group (the same dict, the same keys, the same parameters) and every parameter's optimizer state
  (the same dict, the same keys, tensors the same objects over the same memory) — ``load_state_dict``,
  ``add_param_group`` or an optimizer that replaces its state tensors change this.

Values that change without any of that — the hyper-parameters (a scheduler's ``lr``), a state's plain numbers — are
read again from the optimizer at each save. Objects are held by this cache, so the same ``id`` is the same object.
The state-dict pre-hooks (FSDP2 registers one that reshards the parameters) still run before each check, as
``state_dict`` would run them. Whether the dicts can be kept at all is decided when they are first built, by checking
that torch's result is made of exactly these objects (its model values are views of the parameters and buffers, its
optimizer values the optimizer's own state); if not, torch is asked at every save, as before.

The dicts hold the state of the last save (views, not copies) until the next save or :meth:`clear`; a manager clears
them when it restores (which replaces the optimizer's state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["KeptStateDicts"]


class KeptStateDicts:
    """``get_state_dict(model, optimizer)`` (torch's, with ``options``: by default those of
    :mod:`ckptio.state.optimizer`) kept between calls while the model and
    optimizer keep their structure; :attr:`hits` and :attr:`builds` count the two outcomes."""

    def __init__(self, options: Any = None) -> None:
        from .optimizer import _OPTIONS

        self.options = _OPTIONS if options is None else options
        self.hits = 0
        self.builds = 0
        self.why_not: str | None = None
        """Why this model and optimizer are never kept (``None``: they may be)."""
        self._key: list[Any] | None = None
        self._held: list[Any] = []
        self._raw: dict[str, Any] = {}
        self._flat: dict[str, Any] = {}
        self._refresh: list[tuple[str, dict[str, Any], str]] = []

    def clear(self) -> None:
        """Forget the kept dicts (the next call builds them again)."""
        self._key, self._held, self._raw, self._flat, self._refresh = None, [], {}, {}, []

    def get(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """torch's ``(model state dict, flattened optimizer state dict)``, each a new top-level dict."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.why_not is None and self._key is not None:
            _run_pre_hooks(model, optimizer)
            key, _, why = _fingerprint(model, optimizer)
            if why is not None:  # e.g. a state_dict set on an instance since: torch's is asked from now on
                self.why_not = why
            elif key == self._key:
                self.hits += 1
                flat = dict(self._flat)
                for k, source, name in self._refresh:
                    flat[k] = source[name]
                return dict(self._raw), flat
        raw, flat = get_state_dict(model, optimizer, options=self.options)
        self.builds += 1
        self.clear()
        if self.why_not is None:
            self._keep(model, optimizer, raw, flat)
        return raw, flat

    def _keep(self, model: nn.Module, optimizer: Any, raw: dict[str, Any], flat: dict[str, Any]) -> None:
        key, held, why = _fingerprint(model, optimizer)
        if why is None:
            why = _not_views(raw, held)
        refresh: list[tuple[str, dict[str, Any], str]] = []
        if why is None:
            why = _sources(model, optimizer, flat, refresh)
        if why is not None:
            self.why_not = why
            return
        self._key, self._held, self._raw, self._flat, self._refresh = key, held, dict(raw), dict(flat), refresh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - to_local() dispatches; this does not


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    """What a tensor's place in a state dict depends on: the object, its memory, its shape and its layout."""
    if isinstance(t, DTensor):
        local = t._local_tensor  # noqa: SLF001
        return id(t), local.data_ptr(), local.shape, local.stride(), local.dtype, local.device, t.placements
    return id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


_MODULE_SAVE = nn.Module._save_to_state_dict
_MODULE_STATE_DICT = nn.Module.state_dict
_MODULE_EXTRA = nn.Module.get_extra_state
_OWN = ("state_dict", "_save_to_state_dict", "get_extra_state")
"""The methods a module's state dict is made by: a module whose class or instance has its own is never kept."""


def _fingerprint(model: nn.Module, optimizer: Any) -> tuple[list[Any], list[Any], str | None]:
    """(what the state dicts are made of, the objects named in it by ``id``, why they cannot be kept or ``None``)."""
    key: list[Any] = []
    held: list[Any] = []
    for prefix, m in model.named_modules(remove_duplicate=False):
        kind = type(m)
        if m._state_dict_hooks or kind._save_to_state_dict is not _MODULE_SAVE \
                or kind.state_dict is not _MODULE_STATE_DICT or kind.get_extra_state is not _MODULE_EXTRA \
                or any(name in m.__dict__ for name in _OWN):
            return key, held, f"{prefix or 'the model'} ({kind.__name__}) makes its own state dict"
        for name, t in m._parameters.items():
            key.append((prefix, name, None if t is None else _describe(t)))
            held.append(t)
        skip = m._non_persistent_buffers_set
        for name, t in m._buffers.items():
            if name not in skip:
                key.append((prefix, name, None if t is None else _describe(t)))
                held.append(t)
    plain = isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).state_dict is torch.optim.Optimizer.state_dict
    if not plain or "state_dict" in vars(optimizer) or optimizer._optimizer_state_dict_post_hooks:
        return key, held, f"the optimizer ({type(optimizer).__name__}) makes its own state dict"
    for group in optimizer.param_groups:
        key.append((id(group), tuple(group)))
        held.append(group)
        for p in group["params"]:
            state = optimizer.state.get(p)
            key.append((id(p), None if state is None else id(state)))
            held.extend((p, state))
            if state:
                key.append(tuple((k, _describe(v) if isinstance(v, torch.Tensor) else type(v))
                                 for k, v in state.items()))
                held.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return key, held, None


def _run_pre_hooks(model: nn.Module, optimizer: Any) -> None:
    """The state-dict pre-hooks ``state_dict`` would run (FSDP2's reshards the parameters, when they are not)."""
    for prefix, m in model.named_modules(remove_duplicate=False):
        for hook in m._state_dict_pre_hooks.values():
            hook(m, f"{prefix}." if prefix else "", False)
    for hook in getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}).values():
        hook(optimizer)


def _not_views(raw: dict[str, Any], held: list[Any]) -> str | None:
    """Why torch's model state dict is not made of views of the live parameters and buffers (``None``: it is)."""
    live = {(_local(t).data_ptr(), _local(t).dtype) for t in held if isinstance(t, torch.Tensor)}
    for k, v in raw.items():
        if not isinstance(v, torch.Tensor):
            return f"the model's state dict holds a {type(v).__name__} ({k})"
        local = _local(v)
        if local.numel() and (local.data_ptr(), local.dtype) not in live:
            return f"the model's state dict holds a copy ({k})"
    return None


def _sources(model: nn.Module, optimizer: Any, flat: dict[str, Any],
             refresh: list[tuple[str, dict[str, Any], str]]) -> str | None:
    """Fill ``refresh`` with where each value of the optimizer's flat dict that is not its own state tensor is read
    again at each save; why the flat dict is not what this module expects, or ``None``."""
    from .optimizer import GROUPS, STATE, _fqn, _split_state_key

    by_fqn = {_fqn(model, n): p for n, p in model.named_parameters()}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for k, v in flat.items():
        prefix = STATE if k.startswith(STATE) else GROUPS if k.startswith(GROUPS) else None
        fqn, name = _split_state_key(k[len(prefix):], by_fqn) if prefix else (None, "")
        if fqn is None or id(by_fqn[fqn]) not in group_of:
            return f"the optimizer's state dict has {k!r}, which names no parameter of the optimizer"
        p = by_fqn[fqn]
        source = group_of[id(p)] if prefix == GROUPS else optimizer.state.get(p, {})
        if name not in source:
            return f"the optimizer's state dict has {k!r}, which the optimizer does not hold"
        now = source[name]
        if prefix == STATE and isinstance(v, torch.Tensor):
            if not (isinstance(now, torch.Tensor) and _describe(now)[1:] == _describe(v)[1:]):
                return f"the optimizer's state dict holds a copy ({k})"
            continue
        if not _same(now, v):
            return f"the optimizer's state dict has {k!r} unlike the optimizer's"
        refresh.append((k, source, name))
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a plain equality: not the same
        return False
