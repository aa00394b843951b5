"""PyTorch Lightning ``.ckpt`` files: export a training state that ``Trainer.fit(ckpt_path=…)`` resumes,
and import one written by Lightning into live training objects.

A Lightning checkpoint is one ``torch.save`` file holding::

    epoch, global_step, pytorch-lightning_version
    state_dict          # the LightningModule's state dict: the model's keys under its attribute, "model."
    optimizer_states    # [optimizer.state_dict()] — index-keyed, one entry per optimizer
    lr_schedulers       # [scheduler.state_dict()]
    loops               # progress counters of the fit/validate/test/predict loops
    callbacks, hyper_parameters (optional)

The loop counters written here are those Lightning itself writes when a checkpoint is taken at the end
of a training batch (as ``ModelCheckpoint(every_n_train_steps=…)`` does) with automatic optimization
and a step-interval scheduler, so a resumed fit continues at the next global step with the optimizer
and scheduler exactly where they were. Reading uses ``torch.load(weights_only=True)``: a checkpoint
whose extra entries hold arbitrary Python objects is refused rather than executed.

Both directions work on the live objects (model, optimizer, scheduler) of one process; a model
sharded with FSDP2 is gathered to full tensors for export (a collective; rank 0 writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _dist
from ..errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from . import pt as pt_format
from .registry import Format, Opened, WriteOptions, register

if TYPE_CHECKING:
    from .registry import TensorSource

__all__ = ["LightningPosition", "lightning_checkpoint", "checkpoint_dict", "save_lightning", "read_lightning",
           "load_lightning"]

LIGHTNING_VERSION = "2.6.6"  # the version whose layout the loop counters follow


@dataclass
class LightningPosition:
    """Where a Lightning ``.ckpt`` stopped: global step, epoch, and batches done in that epoch."""
    step: int
    epoch: int
    batches_in_epoch: int


def _progress(ready: int, completed: int | None = None, started: int | None = None,
              processed: int | None = None) -> dict[str, int]:
    out = {"ready": ready, "completed": ready if completed is None else completed}
    if started is not None:
        out["started"] = started
    if processed is not None:
        out["processed"] = processed
    return out


def _batch(total: int, current: int, *, mid_batch: bool) -> dict[str, Any]:
    lag = 1 if mid_batch and total else 0
    return {"total": _progress(total, total - lag, total, total),
            "current": _progress(current, max(0, current - lag), current, current), "is_last_batch": False}


def _idle_loop() -> dict[str, Any]:
    return {"state_dict": {}, "batch_progress": _batch(0, 0, mid_batch=False)}


def _loops(step: int, epoch: int, batches_in_epoch: int, scheduler_interval: str) -> dict[str, Any]:
    sched = step if scheduler_interval == "step" else epoch
    sched_now = batches_in_epoch if scheduler_interval == "step" else 0
    done_epochs = epoch
    return {
        "fit_loop": {
            "state_dict": {},
            "epoch_loop.state_dict": {"_batches_that_stepped": max(0, step - 1)},
            "epoch_loop.batch_progress": _batch(step, batches_in_epoch, mid_batch=True),
            "epoch_loop.scheduler_progress": {"total": _progress(sched), "current": _progress(sched_now)},
            "epoch_loop.automatic_optimization.state_dict": {},
            "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
                "step": {"total": _progress(step), "current": _progress(batches_in_epoch)},
                "zero_grad": {"total": _progress(step, step, step), "current": _progress(batches_in_epoch,
                                                                                         batches_in_epoch,
                                                                                         batches_in_epoch)},
            }},
            "epoch_loop.manual_optimization.state_dict": {},
            "epoch_loop.manual_optimization.optim_step_progress": {"total": _progress(0), "current": _progress(0)},
            "epoch_loop.val_loop.state_dict": {},
            "epoch_loop.val_loop.batch_progress": _batch(0, 0, mid_batch=False),
            "epoch_progress": {"total": _progress(done_epochs + 1, done_epochs, done_epochs + 1, done_epochs),
                               "current": _progress(done_epochs + 1, done_epochs, done_epochs + 1, done_epochs)},
        },
        "validate_loop": _idle_loop(),
        "test_loop": _idle_loop(),
        "predict_loop": {"state_dict": {}, "batch_progress": {"total": _progress(0, 0, 0, 0),
                                                              "current": _progress(0, 0, 0, 0)}},
    }


def _full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd: dict[str, Any]
    if _dist.is_dist():  # FSDP2: gather whole tensors (collective)
        sd = dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    else:
        sd = model.state_dict()
    return {k: v.detach().cpu() for k, v in sd.items()}


def lightning_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                         lr_scheduler: Any | None = None, *, step: int, epoch: int = 0,
                         batches_in_epoch: int | None = None, prefix: str = "model.",
                         scheduler_interval: str = "step",
                         hyper_parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Lightning checkpoint dict of the live objects, taken at the end of global step ``step``.

    ``prefix`` is the attribute under which the LightningModule holds the model (``self.model`` →
    ``"model."``). ``batches_in_epoch`` defaults to ``step`` (single-epoch runs).
    """
    if scheduler_interval not in ("step", "epoch"):
        raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
    if optimizer is not None and _dist.is_dist():
        raise NotImplementedError("exporting a sharded optimizer to a Lightning .ckpt is not supported yet; "
                                  "export from a single process")
    return checkpoint_dict(
        _full_model_state(model), step=step, epoch=epoch, batches_in_epoch=batches_in_epoch, prefix=prefix,
        optimizer_state=optimizer.state_dict() if optimizer is not None else None,
        scheduler_state=lr_scheduler.state_dict() if lr_scheduler is not None else None,
        scheduler_interval=scheduler_interval, hyper_parameters=hyper_parameters,
    )


def checkpoint_dict(weights: dict[str, torch.Tensor], *, step: int, epoch: int = 0,
                    batches_in_epoch: int | None = None, prefix: str = "model.",
                    optimizer_state: dict[str, Any] | None = None, scheduler_state: dict[str, Any] | None = None,
                    scheduler_interval: str = "step",
                    hyper_parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Lightning checkpoint layout around already-gathered states (the model's keys without ``prefix``)."""
    batches = step if batches_in_epoch is None else batches_in_epoch
    ckpt: dict[str, Any] = {
        "epoch": int(epoch),
        "global_step": int(step),
        "pytorch-lightning_version": LIGHTNING_VERSION,
        "state_dict": {prefix + k: v for k, v in weights.items()},
        "loops": _loops(int(step), int(epoch), int(batches), scheduler_interval),
        "callbacks": {},
        "optimizer_states": [optimizer_state] if optimizer_state is not None else [],
        "lr_schedulers": [scheduler_state] if scheduler_state is not None else [],
    }
    if hyper_parameters:
        ckpt["hyper_parameters"] = dict(hyper_parameters)
    return ckpt


def save_lightning(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   lr_scheduler: Any | None = None, **kwargs: Any) -> Path:
    """Write :func:`lightning_checkpoint` to ``path`` (rank 0; atomic: temporary name, fsync, rename)."""
    path = Path(path)
    ckpt = lightning_checkpoint(model, optimizer, lr_scheduler, **kwargs)
    if _dist.rank() == 0:
        from .torch_file import save_tensors_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors_file(ckpt, path)
    return path


def read_lightning(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint, loaded with ``weights_only=True`` and checked for the entries ckptio uses: nested
    at most :data:`~ckptio.storage.parse.MAX_DEPTH` deep, a ``state_dict`` mapping names to values, integer
    ``global_step`` and ``epoch`` (when present). Anything else is a :class:`CheckpointCorruptError` naming
    ``path``."""
    from ..storage.parse import as_int, check_depth, field, parsing

    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: no such Lightning checkpoint")
    with parsing(path, "Lightning checkpoint"):
        ckpt = pt_format.load(path)  # entries holding arbitrary Python objects are refused, never executed
        if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
            raise CheckpointCorruptError(f"{path}: not a Lightning checkpoint (no state_dict mapping)")
        check_depth(ckpt, path)
        odd = next((k for k in ckpt["state_dict"] if type(k) is not str), None)
        if odd is not None:
            raise CheckpointCorruptError(f"{path}: the state_dict holds a key that is not a string ({odd!r:.60})")
        for key in ("global_step", "epoch"):
            as_int(field(ckpt, key, int, path, default=0), path, repr(key))
    return ckpt


def _one_state(ckpt: dict[str, Any], key: str, what: str, path: Path) -> dict[str, Any]:
    """The single ``what`` state a Lightning checkpoint holds under ``key`` (a list of one mapping)."""
    from ..storage.parse import field

    states = field(ckpt, key, list, path, default=[])
    if len(states) != 1:
        raise CheckpointMismatchError(f"{path}: holds {len(states)} {what} states; ckptio imports exactly one")
    if not isinstance(states[0], dict):
        raise CheckpointCorruptError(f"{path}: its {what} state is a {type(states[0]).__name__}, not a mapping")
    return states[0]


def _batches_done(ckpt: dict[str, Any], step: int) -> int:
    """Batches done in the current epoch, from the fit loop's progress (``step`` when it does not say)."""
    node: Any = ckpt.get("loops")
    for key in ("fit_loop", "epoch_loop.batch_progress", "current", "ready"):
        node = node.get(key) if isinstance(node, dict) else None
    return node if type(node) is int and node >= 0 else step


def _strip(keys: set[str], wanted: set[str], prefix: str | None) -> str:
    if prefix is not None:
        return prefix
    for candidate in ("model.", "", "module.", "net.", "_orig_mod."):
        if {k[len(candidate):] for k in keys if k.startswith(candidate)} >= wanted:
            return candidate
    firsts = {k.split(".", 1)[0] + "." for k in keys if "." in k}
    for candidate in sorted(firsts):
        if {k[len(candidate):] for k in keys if k.startswith(candidate)} >= wanted:
            return candidate
    return "model."


def load_lightning(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   lr_scheduler: Any | None = None, *, prefix: str | None = None) -> LightningPosition:
    """Load a Lightning ``.ckpt`` into live objects; return where training stood.

    ``prefix``: the LightningModule attribute holding ``model`` (found automatically when ``None``).
    """
    path = Path(path)
    ckpt = read_lightning(path)
    sd = ckpt["state_dict"]
    wanted = set(model.state_dict())
    prefix = _strip(set(sd), wanted, prefix)
    weights = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    missing = sorted(wanted - set(weights))
    unexpected = sorted(set(weights) - wanted)
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{path}: the Lightning state_dict (prefix {prefix!r}) does not match the model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for key, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointCorruptError(f"{path}: state_dict entry {prefix + key!r} is a {type(value).__name__}, "
                                         "not a tensor")
        if tuple(value.shape) != tuple(model.state_dict()[key].shape):
            raise CheckpointMismatchError(f"{path}: {key} has shape {list(value.shape)}, the model expects "
                                          f"{list(model.state_dict()[key].shape)}")
    model.load_state_dict(weights)
    if optimizer is not None:
        optim_state = _one_state(ckpt, "optimizer_states", "optimizer", path)
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, KeyError) as exc:
            raise CheckpointMismatchError(f"{path}: its optimizer state does not fit this optimizer ({exc})") from exc
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(_one_state(ckpt, "lr_schedulers", "LR scheduler", path))
    step, epoch = ckpt.get("global_step", 0), ckpt.get("epoch", 0)
    return LightningPosition(step=step, epoch=epoch, batches_in_epoch=_batches_done(ckpt, step))


class LightningFile(Format):
    """PyTorch Lightning ``.ckpt`` files: the weights under the module's ``model.`` attribute, and, when
    written from a ckptio step directory, its optimizer (re-keyed by parameter position), LR scheduler and
    step, so that ``Trainer.fit(ckpt_path=…)`` resumes from it."""

    name = "lightning"
    summary = "Lightning .ckpt"
    priority = 80
    file_suffix = ".ckpt"

    step_files = True

    def detect(self, path: Path) -> bool:
        return path.is_file() and path.suffix == ".ckpt"

    def open(self, path: Path) -> "Opened":
        from .torch_file import DictSource, only_tensors

        ckpt = read_lightning(path)
        sd = ckpt["state_dict"]
        if sd and all(k.startswith("model.") for k in sd):  # the LightningModule's model attribute
            sd = {k[len("model."):]: v for k, v in sd.items()}
        return Opened(self.name, DictSource(only_tensors(sd, path), path.parent), None,
                      ckpt.get("global_step", 0), ckpt.get("epoch", 0))

    def write(self, opened: "Opened", source: "TensorSource", out: Path, options: "WriteOptions") -> None:
        from .torch_file import all_tensors, save_tensors_file

        optim = sched = None
        if opened.step_dir is not None:
            from .training_state import read_training_state

            optim, sched = read_training_state(opened.step_dir)
        weights = all_tensors(source, options.progress)
        config = None if opened.extras is None else opened.extras / "config.json"
        if config is not None and config.is_file():
            from .training_state import tied_aliases

            # a LightningModule loads strictly: a tied alias that the weights store once is written under
            # both names, as nn.Module.state_dict() does
            for alias, primary in tied_aliases(config).items():
                if alias not in weights and primary in weights:
                    weights[alias] = weights[primary]
        save_tensors_file(checkpoint_dict(weights, step=opened.step, epoch=opened.epoch, optimizer_state=optim,
                                          scheduler_state=sched), out)


register(LightningFile())
