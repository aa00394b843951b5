"""The ``deepspeed`` format: DeepSpeed ZeRO (stages 1-3) and universal checkpoints, read without DeepSpeed.

A source path may be a tag folder (``global_step3/``), a run folder (the tag its ``latest`` names, else the highest
``global_stepN``), an HF Trainer ``checkpoint-N/`` holding one, or an output folder of those (:mod:`.layout`). The
weights it gives are the fp32 master weights (not the 16-bit copies of a bf16 or fp16 run), one parameter at a time
(:mod:`.zero`); :meth:`open_adam` gives Adam's moments and step the same way, :meth:`training_extras` the LR
scheduler's state and the optimizer's hyper-parameters, so a restore continues the run. ``--to deepspeed-universal``
(:mod:`.universal`) writes the other way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..common import TensorInfo
from ..registry import Format, Opened, WriteOptions, register
from . import layout
from .zero import MOMENTS, ZeroCheckpoint

__all__ = ["DeepSpeedCheckpoint"]


class _Source:
    """One tensor kind of an open DeepSpeed checkpoint (fp32 masters, or an Adam moment), under the model's names."""

    def __init__(self, ck: ZeroCheckpoint, what: str, owner: bool) -> None:
        self.ck, self.what, self.owner, self.folder = ck, what, owner, ck.path

    def index(self) -> dict[str, TensorInfo]:
        index = self.ck.index()
        return index if self.what == "fp32" else {n: index[n] for n in self.ck.shapes}

    def read(self, key: str) -> torch.Tensor:
        return self.ck.read(key, self.what)

    def close(self) -> None:
        if self.owner:
            self.ck.close()


def _extras_of(tag_dir: Path) -> Path | None:
    """The folder with the model's ``config.json`` beside the checkpoint (an HF Trainer ``checkpoint-N/``)."""
    for folder in (tag_dir, tag_dir.parent):
        if (folder / "config.json").is_file():
            return folder
    return None


class _AdamSource:
    """Adam's state of every parameter under torch's flattened names (``state.<name>.exp_avg``, ``.exp_avg_sq``,
    ``.step``), read one tensor at a time."""

    def __init__(self, ck: ZeroCheckpoint) -> None:
        self.ck, self.folder, self.step = ck, ck.path, torch.tensor(ck.adam_step())

    def index(self) -> dict[str, TensorInfo]:
        out = {}
        for name, shape in self.ck.shapes.items():
            out.update({f"state.{name}.{m}": TensorInfo(shape, "float32") for m in MOMENTS})
            out[f"state.{name}.step"] = TensorInfo((), "float32")
        return out

    def read(self, key: str) -> torch.Tensor:
        name, what = key[len("state."):].rsplit(".", 1)
        return self.step.clone() if what == "step" else self.ck.read(name, what)

    def close(self) -> None:
        pass  # the checkpoint is closed by the weights' source


def training_state(ck: ZeroCheckpoint) -> dict[str, Any]:
    """``Opened.training`` of a DeepSpeed checkpoint: Adam's state, streamed, and its hyper-parameters per parameter
    name, and the scheduler's state; ``{}`` without Adam."""
    if not ck.has_moments():
        return {}
    groups = ck.param_groups()
    values = {f"param_groups.{name}.{k}": v for g, group in enumerate(ck.groups) for name in group
              for k, v in (groups[g] if g < len(groups) else {}).items()}
    return {"tensors": _AdamSource(ck), "values": values, "lr_scheduler": ck.scheduler}


class DeepSpeedCheckpoint(Format):
    """A DeepSpeed run folder, tag folder or HF Trainer ``checkpoint-N/`` holding one: read, never written."""

    name = "deepspeed"
    summary = "DeepSpeed ZeRO or universal checkpoint (fp32 master weights, Adam state)"
    priority = 22  # before the HF bundle an HF Trainer writes beside its DeepSpeed checkpoint
    resumes_runs = True

    def detect(self, path: Path) -> bool:
        return layout.is_run(path)

    def open(self, path: Path) -> Opened:
        tag_dir = layout.find_tag_dir(path)
        ck = ZeroCheckpoint(tag_dir)
        step = ck.global_steps if ck.global_steps is not None else layout.step_of(tag_dir) or 0
        opened = Opened(self.name, _Source(ck, "fp32", True), _extras_of(tag_dir), step)
        opened.training = lambda: training_state(ck)
        return opened

    def open_adam(self, path: Path) -> tuple[float, dict[str, Any]] | None:
        ck = ZeroCheckpoint(layout.find_tag_dir(path))
        try:
            if ck.has_moments():
                return ck.adam_step(), {m: _Source(ck, m, i == 0) for i, m in enumerate(MOMENTS)}
        except BaseException:
            ck.close()
            raise
        ck.close()
        return None

    def training_extras(self, path: Path) -> dict[str, Any]:
        ck = ZeroCheckpoint(layout.find_tag_dir(path))
        try:
            return {"lr_scheduler": ck.scheduler, "param_groups": ck.param_groups()}
        finally:
            ck.close()

    def checkpoint_summary(self, path: Path) -> dict[str, Any]:
        ck = ZeroCheckpoint(layout.find_tag_dir(path))
        try:
            return {"label": _kind(ck), "step": _step(ck), "ranks": ck.world,
                    "carries": ", ".join(_carries(ck)), "checkpoint": str(ck.path)}
        finally:
            ck.close()

    def describe(self, path: Path) -> dict[str, Any]:
        """The checkpoint a restore of ``path`` takes (the tag ``latest`` names...): its stage, ranks, step, what it
        holds, and its own files (not the run folder's scripts and pointers)."""
        out = super().describe(path)
        ck = ZeroCheckpoint(layout.find_tag_dir(path))
        try:
            out["deepspeed"] = {"checkpoint": str(ck.path), "zero_stage": ck.stage, "universal": ck.universal,
                                "dp_world_size": ck.world, "global_steps": ck.global_steps,
                                "adam_state": ck.has_moments(), "lr_scheduler": ck.scheduler is not None}
            step = _step(ck)
            out["label"] = f"{_kind(ck)}, saved on {ck.world} rank{'s' if ck.world > 1 else ''}{f', step {step}' if step is not None else ''}"
            out["checkpoint"] = str(ck.path.relative_to(path)) if ck.path != path else ck.path.name
            out["holds"] = {"Adam state": "yes (exp_avg, exp_avg_sq, step)" if ck.has_moments() else "no",
                               "LR scheduler": "yes" if ck.scheduler is not None else "no"}
            out["files"] = {e.name: e.size for e in ck.folder.listdir() if e.kind == "file"}
            out["total_bytes"] = sum(out["files"].values())
        finally:
            ck.close()
        return out


def _kind(ck: ZeroCheckpoint) -> str:
    """``DeepSpeed ZeRO-2``, ``DeepSpeed universal (ZeRO-3)``."""
    if ck.universal:
        return "DeepSpeed universal" + (f" (ZeRO-{ck.stage})" if ck.stage else "")
    return f"DeepSpeed ZeRO-{ck.stage}"


def _step(ck: ZeroCheckpoint) -> int | None:
    return ck.global_steps if ck.global_steps is not None else layout.step_of(ck.path)


def _carries(ck: ZeroCheckpoint) -> list[str]:
    """What a restore takes from the checkpoint."""
    return ["fp32 master weights"] + (["Adam state"] if ck.has_moments() else []) + \
        (["LR scheduler"] if ck.scheduler is not None else [])


class DeepSpeedUniversal(DeepSpeedCheckpoint):
    """A universal folder (``ds_to_universal``'s, or ckptio's ``--to deepspeed-universal``, which DeepSpeed loads with
    ``load_universal`` on any number of ranks): read as the ``deepspeed`` format reads it, and written."""

    name = "deepspeed-universal"
    summary = "DeepSpeed universal checkpoint folder (per-parameter files DeepSpeed loads on any number of ranks)"
    priority = 21

    def detect(self, path: Path) -> bool:
        return layout.is_universal(path)

    def write(self, opened: Opened, source: Any, out: Path, options: WriteOptions) -> None:
        from .universal import write_universal

        write_universal(opened, source, out, options)


register(DeepSpeedCheckpoint())
register(DeepSpeedUniversal())
