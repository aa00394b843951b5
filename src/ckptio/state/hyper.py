"""The one check of a restored LR scheduler state and optimizer hyper-parameters against the live objects, before
anything is applied.

``scheduler.load_state_dict`` copies whatever the state holds onto the scheduler (``__dict__.update``) and
``optimizer.load_state_dict`` takes any parameter group: a state with ``optimizer='hijacked'``, ``step_size=0``, an
``lr`` of ``'0.01'`` or betas of ``(nan, 0.999)`` loads, and the next step raises or turns the weights NaN; the state
of another scheduler class (DeepSpeed's ``WarmupLR`` given to a torch ``StepLR``) loads too, and its schedule silently
restarts. :func:`check` refuses each of them by name, changing nothing:

* a scheduler state must hold the live scheduler's own entries (private ones, ``_name``, may come and go between
  torch versions): one with entries of its own or without the live one's is another class's, refused;
* every value must be of the live value's kind (a number for a number, ``bool`` for ``bool``, a list of as many
  entries for a list, ...) and every number finite (where the live one is: ``ReduceLROnPlateau`` starts at
  ``best=inf``);
* the scheduler, with the state, must compute its learning rates (``get_lr``, run on a copy that shares nothing it
  writes): a state it divides by zero with is refused before it is loaded, not at the next step.

Called by ckptio's own restore (:func:`ckptio.engine.restoring.apply_state`), by the restore of a DeepSpeed run
(:mod:`ckptio.adopt.foreign`) and by ``CkptioTrainer`` (:mod:`ckptio.hf_trainer`): pure, it may run before any
state of a restore is applied.
"""

from __future__ import annotations

import copy
import math
import types
import warnings
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointMismatchError

__all__ = ["check", "check_groups", "check_scheduler"]

_OBSOLETE = frozenset({"verbose"})
"""Public scheduler entries older torch versions saved and newer ones no longer have."""
_NESTED = ("lr_lambdas", "_schedulers")
"""Scheduler entries holding other objects' states (checked by kind, never copied onto the probe)."""
_MISSING = object()


def check(live: Any, incoming: Any, where: object = "the checkpoint") -> None:
    """Raise a :class:`~ckptio.errors.CheckpointError` naming ``where`` unless ``incoming`` is a state ``live`` (an LR
    scheduler, an optimizer, ckptio's :class:`~ckptio.state.OptimizerState`) can take; anything else is not checked.
    Changes nothing."""
    live = getattr(live, "optim_state", live)  # the restore's wrapper of the fast path
    if _is_scheduler(live):
        check_scheduler(live, incoming, where)
    elif _is_scheduler(getattr(live, "scheduler", None)):  # accelerate's AcceleratedScheduler
        check_scheduler(live.scheduler, incoming, where)
    elif isinstance(getattr(live, "param_groups", None), list) and isinstance(incoming, dict) and \
            isinstance(incoming.get("param_groups"), list):  # an optimizer and a torch optimizer state dict
        check_groups(live.param_groups, incoming["param_groups"], where)
    elif hasattr(live, "optimizer") and hasattr(live, "_raw_params") and isinstance(incoming, dict) and \
            isinstance(incoming.get("optim"), dict):  # OptimizerState and its flattened state
        _check_flat(live, incoming["optim"], where)


def _is_scheduler(obj: Any) -> bool:
    lr = torch.optim.lr_scheduler
    return isinstance(obj, (lr.LRScheduler, lr.ReduceLROnPlateau))


# ---------------------------------------------------------------------------------------------- values
def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    return True


def _value(live: Any, got: Any, where: object, what: str) -> None:
    """``got`` is of ``live``'s kind, recursively, and finite where ``live`` is."""

    def bad(why: str) -> CheckpointCorruptError:
        shown = repr(got)[:80]
        return CheckpointCorruptError(f"{where}: {what} is {shown} ({why}); this run's is {repr(live)[:80]}")

    number = (int, float)
    if isinstance(live, bool):
        if not isinstance(got, bool):
            raise bad(f"a {type(got).__name__}, not a bool")
        return
    if isinstance(got, bool) and live is not None:
        raise bad(f"a bool, not a {type(live).__name__}")
    if live is None:  # unset in this run (foreach=None): a plain value of any kind
        if got is not None and not isinstance(got, (bool, int, float, str)):
            raise bad(f"a {type(got).__name__}")
        if not _finite(got):
            raise bad("not finite")
        return
    if isinstance(live, number) or isinstance(live, torch.Tensor) and live.numel() == 1:
        if isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_complex():
            got_value: Any = got.item()
        elif isinstance(got, number):
            got_value = got
        else:
            raise bad(f"a {type(got).__name__}, not a number")
        live_value = live.item() if isinstance(live, torch.Tensor) else live
        if not _finite(float(got_value)) and _finite(float(live_value)):
            raise bad("not finite")
        return
    if isinstance(live, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(live):
            kind = f"{len(got)} values" if isinstance(got, (tuple, list)) else f"a {type(got).__name__}"
            raise bad(f"{kind}, not {len(live)} values")
        for i, (a, b) in enumerate(zip(live, got)):
            _value(a, b, where, f"{what}[{i}]")
        return
    if isinstance(live, dict):
        if not isinstance(got, dict):
            raise bad(f"a {type(got).__name__}, not a dict")
        for key in live.keys() & got.keys():
            _value(live[key], got[key], where, f"{what}[{key!r}]")
        return
    if isinstance(live, str):
        if not isinstance(got, str):
            raise bad(f"a {type(got).__name__}, not text")
        return
    if type(got) is not type(live):
        raise bad(f"a {type(got).__name__}, not a {type(live).__name__}")


# ---------------------------------------------------------------------------------------------- schedulers
def check_scheduler(live: Any, incoming: Any, where: object) -> None:
    """A state ``live`` (a torch LR scheduler) takes: its class's entries, each of its kind and finite, and learning
    rates it computes."""
    name = type(live).__name__
    if not isinstance(incoming, dict) or not all(isinstance(k, str) for k in incoming):
        raise CheckpointCorruptError(f"{where}: the LR scheduler state is a {type(incoming).__name__}, not the state "
                                     f"of this run's {name}")
    mine = live.state_dict()
    extra = sorted(k for k in incoming if k not in mine and not k.startswith("_") and k not in _OBSOLETE)
    missing = sorted(k for k in mine if k not in incoming and not k.startswith("_"))
    if extra or missing:
        raise CheckpointMismatchError(
            f"{where}: the LR scheduler state is not the state of this run's {name} (another scheduler class's?): "
            + "; ".join(part for part in (f"entries {name} does not have: {extra[:6]}" if extra else "",
                                          f"missing {name}'s {missing[:6]}" if missing else "") if part))
    for key in mine.keys() & incoming.keys():
        _value(mine[key], incoming[key], where, f"the LR scheduler's {key!r}")
    get_lr = getattr(type(live), "get_lr", None)
    if get_lr is None or get_lr is torch.optim.lr_scheduler.LRScheduler.get_lr:
        return  # ReduceLROnPlateau, SequentialLR, ChainedScheduler: nothing computed from the state alone
    probe = copy.copy(live)  # its own __dict__: nothing set on it reaches the live scheduler
    probe.__dict__.update({k: v for k, v in incoming.items() if k not in _NESTED and k not in _OBSOLETE})
    probe.optimizer = types.SimpleNamespace(param_groups=[dict(g) for g in live.optimizer.param_groups])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lrs = probe.get_lr()
    except Exception as exc:  # noqa: BLE001 - what the next step would raise
        raise CheckpointCorruptError(f"{where}: this run's {name} cannot compute its learning rates from the saved "
                                     f"state ({type(exc).__name__}: {exc})") from exc
    if not all(_finite(float(lr)) if isinstance(lr, (int, float)) else _finite(lr) for lr in lrs):
        raise CheckpointCorruptError(f"{where}: this run's {name} computes learning rates {list(lrs)[:4]} from the "
                                     "saved state (not finite)")


# ---------------------------------------------------------------------------------------------- optimizers
def check_groups(live: list[dict[str, Any]], groups: Any, where: object) -> None:
    """Parameter groups ``live`` (an optimizer's ``param_groups``) take: as many, each hyper-parameter of the kind
    the live group's is and finite; one the live group lacks a plain finite value."""
    if not isinstance(groups, list) or len(groups) != len(live):
        raise CheckpointMismatchError(f"{where}: {len(groups) if isinstance(groups, list) else 'no'} parameter "
                                      f"group(s) saved, this run's optimizer has {len(live)}")
    for i, (mine, saved) in enumerate(zip(live, groups)):
        if not isinstance(saved, dict):
            raise CheckpointCorruptError(f"{where}: parameter group {i} is a {type(saved).__name__}")
        for key, value in saved.items():
            if key != "params":
                _hyper(mine.get(key, _MISSING), value, where, f"parameter group {i}'s {key!r}")


def _hyper(live: Any, got: Any, where: object, what: str) -> None:
    grown = isinstance(live, list) and isinstance(got, (tuple, list)) and len(got) != len(live)
    if live is _MISSING or grown:  # saved by another version, set by a scheduler (initial_lr), or a list of the
        # user's that grew or shrank (a group's tags; torch's own hyper-parameters are tuples): plain values
        live = None if not isinstance(got, (tuple, list)) else type(got)(None for _ in got)
    _value(live, got, where, what)


def _check_flat(optim_state: Any, flat: dict[str, Any], where: object) -> None:
    """ckptio's flattened optimizer state (``param_groups.<name>.<hyper-parameter>``) against the live groups."""
    from .optimizer import GROUPS, _split_state_key

    group_of: dict[str, dict[str, Any]] = {}
    by_id = {id(p): g for g in optim_state.optimizer.param_groups for p in g["params"]}
    for fqn, p in optim_state._raw_params():
        group_of[fqn] = group_of[optim_state._saved_name(fqn)] = by_id[id(p)]
    for key, value in flat.items():
        if not isinstance(key, str) or not key.startswith(GROUPS):
            continue
        fqn, name = _split_state_key(key[len(GROUPS):], group_of)
        if fqn is not None and name != "params":
            _hyper(group_of[fqn].get(name, _MISSING), value, where, f"{key!r}")
