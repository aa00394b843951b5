"""Megatron's learning-rate and weight-decay schedule, continued on a plain PyTorch optimizer.

A Megatron run records its schedule as ``opt_param_scheduler`` (megatron-core's ``OptimizerParamScheduler``
state): in every legacy rank file (``model_optim_rng.pt``), in a ``torch_dist`` checkpoint's ``common.pt``. It is
read here through the restricted unpickler (:mod:`ckptio.formats.safe_pickle`, only the pickle, no tensors) and
turned into :class:`MegatronLRScheduler`, a torch LR scheduler at the checkpoint's ``num_steps`` whose learning
rate and weight decay at every later step are megatron-core's, computed with the same float operations.

Every field of the state is placed:

* carried: ``max_lr`` (``start_lr``), ``min_lr``, ``lr_warmup_steps`` (``warmup_iter``, ``warmup_steps``),
  ``lr_decay_steps`` (``end_iter``, ``decay_steps``), ``lr_decay_style`` (``decay_style``), ``num_steps``
  (``num_iters``), ``start_wd``, ``end_wd``, ``wd_incr_steps``, ``wd_incr_style`` (the older spellings as
  megatron-core's ``load_state_dict`` reads them);
* not in the state, taken from the run's ``args`` (or given): the warmup's initial learning rate
  (``lr_warmup_init``), WSD's annealing steps (``lr_wsd_decay_samples``, or ``lr_wsd_decay_iters`` × the global
  batch size) and style (``lr_wsd_decay_style``), and the increment per step (``global_batch_size``: Megatron-LM
  counts samples);
* refused by name: any other field, a state without the weight-decay schedule (megatron-core would then take the
  run's arguments, which ckptio does not reproduce), and without a given increment a run with a batch-size
  ramp-up (``rampup_batch_size``: its increment changes), and a run with ``decoupled_lr`` unless a parameter
  group carries its ``max_lr`` (the embedding's and output layer's, as megatron-core's groups do).

The run's ``override_opt_param_scheduler`` and ``use_checkpoint_opt_param_scheduler`` are not consulted: they
say how Megatron loads a state, and the saved state is the schedule that was in effect (megatron-core saves the
values it used, overridden or not).

Per parameter group, as megatron-core's ``step``: ``max_lr``, ``min_lr``, ``start_wd``, ``end_wd`` in a group
replace the schedule's, and its weight decay is multiplied by the group's ``wd_mult`` (megatron-core gives the
norms and biases ``wd_mult=0``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.parse import within_one_read

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")
# each carried field -> its spellings in a saved state (megatron-core's load_state_dict reads the older ones first)
_FIELDS = {"max_lr": ("start_lr", "max_lr"), "min_lr": ("min_lr",),
           "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
           "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
           "lr_decay_style": ("decay_style", "lr_decay_style"), "num_steps": ("num_iters", "num_steps"),
           "start_wd": ("start_wd",), "end_wd": ("end_wd",), "wd_incr_steps": ("wd_incr_steps",),
           "wd_incr_style": ("wd_incr_style",)}


class MegatronLRScheduler(torch.optim.lr_scheduler.LRScheduler):
    """megatron-core's ``OptimizerParamScheduler`` as a torch LR scheduler: each :meth:`step` advances
    ``num_steps`` by ``increment`` and sets every parameter group's ``lr`` and ``weight_decay`` as megatron-core's
    ``step`` does. Its :meth:`state_dict` is plain values, so a ckptio checkpoint saves and restores it."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: dict[str, Any], increment: int) -> None:
        # LRScheduler.__init__ would take one step; the position is the checkpoint's, so it is set directly
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = schedule["max_lr"], schedule["min_lr"], schedule["init_lr"]
        self.lr_warmup_steps, self.lr_decay_steps = schedule["lr_warmup_steps"], schedule["lr_decay_steps"]
        self.lr_decay_style = schedule["lr_decay_style"]
        self.wsd_decay_steps, self.lr_wsd_decay_style = schedule["wsd_decay_steps"], schedule["lr_wsd_decay_style"]
        self.start_wd, self.end_wd = schedule["start_wd"], schedule["end_wd"]
        self.wd_incr_steps, self.wd_incr_style = schedule["wd_incr_steps"], schedule["wd_incr_style"]
        self.num_steps, self.increment = schedule["num_steps"], increment
        self.base_lrs = [self.max_lr for _ in optimizer.param_groups]
        self.last_epoch, self._step_count = 0, 1
        self._apply()

    # ------------------------------------------------------------------------------ megatron-core's functions
    def lr_of(self, group: dict[str, Any]) -> float:
        """The learning rate of ``group`` at ``num_steps`` (megatron-core's ``get_lr``)."""
        max_lr, min_lr = group.get("max_lr", self.max_lr), group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = max_lr * max(self.lr_warmup_steps, 1) ** 0.5 / (max(self.num_steps, 1) ** 0.5)
            return max(min_lr, lr)
        ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: (2.0 * math.pow(0.5, r)) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style](wsd_ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def wd_of(self, group: dict[str, Any]) -> float:
        """The weight decay of ``group`` at ``num_steps`` (megatron-core's ``get_wd`` × the group's ``wd_mult``)."""
        start_wd, end_wd = group.get("start_wd", self.start_wd), group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            wd = end_wd
        else:
            ratio = float(self.num_steps) / float(self.wd_incr_steps)
            coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
            wd = start_wd + coeff * (end_wd - start_wd)
        return wd * group.get("wd_mult", 1.0)

    # ------------------------------------------------------------------------------ torch's interface
    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_of(group) for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.lr_of(group), self.wd_of(group)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:  # type: ignore[override]
        """One training step: ``num_steps`` advances by ``increment`` (``epoch`` is not accepted)."""
        if epoch is not None:
            raise TypeError("MegatronLRScheduler.step() takes no epoch: each call is one training step")
        self.num_steps += self.increment
        self.last_epoch += 1
        self._step_count += 1
        self._apply()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a saved position and schedule, and set the groups' learning rate and weight decay from it."""
        self.__dict__.update(state_dict)
        self._apply()


# ---------------------------------------------------------------------------------------------- reading
@within_one_read  # the layout check and the read open one rank file: walked once
def read_scheduler_state(path: Path) -> tuple[dict[str, Any], Any, Path]:
    """``opt_param_scheduler``, the run's ``args`` and the file they are in, of the Megatron checkpoint ``path`` (a
    run folder or an ``iter_NNNNNNN`` folder; legacy rank files or ``torch_dist``)."""
    from .. import safe_pickle
    from .distrib_optim import read_common
    from .layout import record_file

    found = record_file(Path(path))
    if found is None:
        raise CheckpointError(f"{path}: not a Megatron checkpoint (neither mp_rank_* folders nor a torch_dist "
                              "metadata.json and common.pt)")
    layout, root, rel = found
    if layout == "legacy":
        obj, _, handle = safe_pickle.open_lazy(root, rel)
        handle.close()  # only the pickle is needed
    else:
        obj, _, _, _ = read_common(root)
    where = root.display(rel)
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{where}: holds a {type(obj).__name__}, not a Megatron checkpoint's dict")
    state = obj.get("opt_param_scheduler")
    if state is None:
        raise CheckpointError(f"{where}: records no opt_param_scheduler (saved without a learning-rate schedule)")
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointCorruptError(f"{where}: its opt_param_scheduler is a {type(state).__name__}, not a "
                                     "scheduler's state dict")
    return state, obj.get("args"), where


MAX_STEPS, MAX_RATE = 2 ** 63 - 1, 1e6
"""The largest step count (samples: Megatron keeps them in int64) and learning rate or weight decay read: larger
ones are damage, and would overflow the float arithmetic of the schedule (an infinite learning rate)."""


def _number(value: Any, name: str, where: object, *, whole: bool = False) -> Any:
    ok = type(value) is int or (not whole and type(value) is float and math.isfinite(value))
    if not ok or not 0 <= value <= (MAX_STEPS if whole else MAX_RATE):
        kind = f"a whole number from 0 to {MAX_STEPS}" if whole else f"a finite number from 0 to {MAX_RATE:g}"
        raise CheckpointCorruptError(f"{where}: the schedule's {name} is {str(value)[:40]!r}, not {kind}")
    return value


def schedule_of(state: dict[str, Any], args: Any, where: object, *, init_lr: float | None = None,
                wsd_decay_steps: int | None = None, lr_wsd_decay_style: str | None = None) -> dict[str, Any]:
    """The checked schedule of a saved ``opt_param_scheduler``, with what the state does not hold from ``args``."""
    known = {spelling for spellings in _FIELDS.values() for spelling in spellings}
    unknown = sorted(k for k in state if k not in known)
    if unknown:
        raise CheckpointError(f"{where}: opt_param_scheduler holds {unknown[:4]}, which ckptio's Megatron schedule "
                              "does not reproduce")
    if "start_wd" not in state:
        raise CheckpointError(f"{where}: opt_param_scheduler records no weight-decay schedule (start_wd, end_wd, "
                              "wd_incr_steps, wd_incr_style); megatron-core takes it from the run's arguments, "
                              "which ckptio does not reproduce")
    out: dict[str, Any] = {}
    for field, spellings in _FIELDS.items():
        spelling = next((s for s in spellings if s in state), None)
        if spelling is None:
            raise CheckpointCorruptError(f"{where}: opt_param_scheduler has no {field}")
        value = state[spelling]
        if field in ("lr_decay_style", "wd_incr_style"):
            styles = DECAY_STYLES if field == "lr_decay_style" else WD_STYLES
            if value not in styles:
                raise CheckpointError(f"{where}: the schedule's {field} is {str(value)[:40]!r}; megatron-core's are "
                                      f"{list(styles)}")
            out[field] = value
        else:
            out[field] = _number(value, spelling, where, whole=field.endswith("steps"))
    out["init_lr"] = _number(_arg(args, "lr_warmup_init", 0.0) if init_lr is None else init_lr, "lr_warmup_init",
                             where)
    if out["lr_decay_style"] == "WSD":
        if wsd_decay_steps is None:
            samples, iters = _arg(args, "lr_wsd_decay_samples"), _arg(args, "lr_wsd_decay_iters")
            wsd_decay_steps = samples if _arg(args, "train_samples") is not None or iters is None else \
                _number(iters, "lr_wsd_decay_iters", where, whole=True) * \
                _number(_arg(args, "global_batch_size", 1), "global_batch_size", where, whole=True)
        if lr_wsd_decay_style is None:
            lr_wsd_decay_style = _arg(args, "lr_wsd_decay_style")
        if lr_wsd_decay_style not in WSD_STYLES:
            raise CheckpointError(f"{where}: the run's lr_wsd_decay_style is {str(lr_wsd_decay_style)[:40]!r}; "
                                  f"megatron-core's are {list(WSD_STYLES)}")
        if wsd_decay_steps is None:
            raise CheckpointError(f"{where}: a WSD schedule, but the run's args record neither lr_wsd_decay_iters nor "
                                  "lr_wsd_decay_samples; pass wsd_decay_steps= (samples)")
        out["wsd_decay_steps"] = _number(wsd_decay_steps, "lr_wsd_decay_samples", where, whole=True)
        if not 0 < out["wsd_decay_steps"] <= out["lr_decay_steps"]:
            raise CheckpointCorruptError(f"{where}: WSD anneals over {out['wsd_decay_steps']} steps, not between 1 "
                                         f"and lr_decay_steps={out['lr_decay_steps']}")
    else:
        out["wsd_decay_steps"] = wsd_decay_steps
    out["lr_wsd_decay_style"] = lr_wsd_decay_style
    checks = [(out["min_lr"] <= out["max_lr"], "min_lr ≤ max_lr"), (out["init_lr"] <= out["max_lr"],
              "lr_warmup_init ≤ max_lr"), (out["lr_decay_steps"] > 0, "lr_decay_steps > 0"),
              (out["lr_warmup_steps"] < out["lr_decay_steps"], "lr_warmup_steps < lr_decay_steps"),
              (out["start_wd"] <= out["end_wd"], "start_wd ≤ end_wd"), (out["wd_incr_style"] != "constant" or
              out["start_wd"] == out["end_wd"], "a constant weight decay has start_wd = end_wd"),
              (out["wd_incr_style"] == "constant" or out["wd_incr_steps"] > 0, "wd_incr_steps > 0")]
    broken = [what for ok, what in checks if not ok]
    if broken:
        raise CheckpointCorruptError(f"{where}: the schedule breaks megatron-core's rule {broken[0]}: "
                                     f"{ {k: out[k] for k in _FIELDS} }")
    return out


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


def megatron_schedule(optimizer: torch.optim.Optimizer, checkpoint_path: str | Path, *, increment: int | None = None,
                      init_lr: float | None = None, wsd_decay_steps: int | None = None,
                      lr_wsd_decay_style: str | None = None) -> MegatronLRScheduler:
    """A torch LR scheduler continuing the Megatron checkpoint's learning-rate and weight-decay schedule on
    ``optimizer``, positioned at the checkpoint's ``num_steps`` (the groups' ``lr`` and ``weight_decay`` are set
    now; call its ``step()`` after each ``optimizer.step()``, as Megatron-LM does).

    ``increment``: ``num_steps`` per step; default the run's ``global_batch_size`` (Megatron-LM counts samples).
    ``init_lr``, ``wsd_decay_steps``, ``lr_wsd_decay_style``: what the saved state lacks, by default from the run's
    ``args`` (``lr_warmup_init``; ``lr_wsd_decay_samples`` or ``lr_wsd_decay_iters`` × the global batch size;
    ``lr_wsd_decay_style``)."""
    state, args, where = read_scheduler_state(Path(checkpoint_path))
    if increment is None:
        if _arg(args, "rampup_batch_size") is not None:
            raise CheckpointError(f"{where}: the run ramps its batch size up (rampup_batch_size="
                                  f"{str(_arg(args, 'rampup_batch_size'))[:40]}); pass increment= (samples per step)")
        increment = _arg(args, "global_batch_size")
        if increment is None:
            raise CheckpointError(f"{where}: the run's args record no global_batch_size; pass increment= (samples "
                                  "per step)")
    if type(increment) is not int or not 0 < increment <= MAX_STEPS:
        raise CheckpointError(f"{where}: the increment per step is {str(increment)[:40]!r}, not a positive integer")
    decoupled = _arg(args, "decoupled_lr")
    if decoupled is not None and not any("max_lr" in group for group in optimizer.param_groups):
        raise CheckpointError(f"{where}: the run gives the embedding and output layer their own schedule "
                              f"(decoupled_lr={str(decoupled)[:40]}, decoupled_min_lr="
                              f"{str(_arg(args, 'decoupled_min_lr'))[:40]}); put max_lr and min_lr in their "
                              "parameter group, as megatron-core does")
    schedule = schedule_of(state, args, where, init_lr=init_lr, wsd_decay_steps=wsd_decay_steps,
                           lr_wsd_decay_style=lr_wsd_decay_style)
    return MegatronLRScheduler(optimizer, schedule, increment)
