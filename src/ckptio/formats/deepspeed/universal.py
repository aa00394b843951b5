"""``--to deepspeed-universal``: a DeepSpeed universal folder from a ckptio checkpoint, for DeepSpeed's
``load_universal`` on any number of ranks and any ZeRO stage.

Written (the run folder ``OUT/`` is what ``engine.load_checkpoint(OUT)`` takes with ``"checkpoint":
{"load_universal": true}`` in the DeepSpeed config)::

    OUT/latest_universal                          the tag: global_stepN_universal
    OUT/global_stepN_universal/
        mp_rank_00_model_states.pt                the step, the LR scheduler, param_shapes, the weights
        zero_pp_rank_0_mp_rank_00_model_states.pt the same (the name a stage-3 engine reads)
        zero/optimizer_state.pt                   the optimizer's hyper-parameters and step
        zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt, step.pt

Each parameter's tensors are written as soon as they are read (one parameter in memory at a time: the model-states
file keeps the buffers and an empty tensor per parameter, as a ZeRO-3 rank's does); the folder is
written under a temporary name and renamed into place when whole. Only plain containers and tensors are pickled
(``torch.load(weights_only=True)`` reads every file).
"""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ..registry import Opened, WriteOptions
from ..training_state import grouped, open_saved_optimizer, per_parameter
from .zero import MOMENTS

__all__ = ["write_universal", "DS_VERSION"]

DS_VERSION = "0.19.0"
"""The DeepSpeed version the files say they follow (DeepSpeed checks the stage-1 layout against it)."""


class _Adam:
    """The source's Adam state, read one tensor at a time: which tensors it optimizes, their moments and step, their
    hyper-parameters, and the LR scheduler's state. Without an optimizer in the source, Adam as a new optimizer starts
    (zero moments, step 0) for every floating-point tensor: a Hugging Face folder becomes a universal folder DeepSpeed
    starts training from."""

    def __init__(self, opened: Opened, index: dict[str, Any]) -> None:
        self.scheduler: Any
        source, values, self.scheduler = open_saved_optimizer(opened.step_dir) if opened.step_dir is not None else \
            (None, {}, None)
        self.source = source
        if source is None:
            import logging

            logging.getLogger("ckptio").warning("the source holds no optimizer state: the universal folder starts "
                                                "Adam fresh (zero moments, step 0)")
            self.names = [n for n, info in index.items() if info.dtype.startswith(("float", "bfloat"))]
            self.hyper: dict[str, dict[str, Any]] = {n: {} for n in self.names}
            return
        _, self.hyper = per_parameter(values)
        saved = source.index()
        missing = [f for f in self.hyper if not all(f"state.{f}.{m}" in saved for m in MOMENTS)]
        if not self.hyper or missing:
            raise CheckpointError(f"{opened.step_dir}: the optimizer is not Adam/AdamW with state for every parameter "
                                  f"(no exp_avg/exp_avg_sq for {missing[:3]}); a universal folder holds Adam's moments")
        self.names = [n for n in index if n in self.hyper]
        self.steps = {n: values.get(f"state.{n}.step") for n in self.names}  # a number where it was saved as one

    def moment(self, name: str, moment: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like) if self.source is None else self.source.read(f"state.{name}.{moment}")

    def step(self, name: str) -> float:
        if self.source is None:
            return 0.0
        value = self.steps[name]
        value = self.source.read(f"state.{name}.step") if value is None else value
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def write_universal(opened: Opened, source: Any, out: Path, options: WriteOptions) -> None:
    """Write ``OUT`` as described in the module's docstring (``out`` must not exist)."""
    index = source.index()
    adam = _Adam(opened, index)
    params = set(adam.names)
    tag = f"global_step{opened.step}_universal"
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    zero = tmp / tag / "zero"
    zero.mkdir(parents=True)
    try:
        # the model-states file keeps the buffers whole and the parameters as empty tensors (as a ZeRO-3 rank's does):
        # DeepSpeed's universal load takes the parameters from zero/, and nothing is held in memory for it
        module: dict[str, torch.Tensor] = collections.OrderedDict()
        shapes: dict[str, torch.Size] = collections.OrderedDict()
        for name in index:
            tensor = source.read(name)
            module[name] = torch.empty(0, dtype=tensor.dtype) if name in params else tensor
            if name not in params:
                continue
            shapes[name] = tensor.shape
            folder = zero / name
            folder.mkdir()
            for what in ("fp32", *MOMENTS):
                value = tensor if what == "fp32" else adam.moment(name, what, tensor)
                value = value.detach().to(torch.float32).reshape(tensor.shape).contiguous()
                torch.save({"param": value, "cat_dim": 0}, folder / f"{what}.pt")
                del value
            torch.save(torch.tensor(adam.step(name)), folder / "step.pt")
            if options.progress is not None:
                options.progress(tensor.numel() * tensor.element_size())
            del tensor
        names = list(shapes)
        groups = grouped(adam.hyper, names)
        step = torch.tensor(adam.step(names[0]) if names else 0.0)
        torch.save({"param_groups": groups, "ds_version": DS_VERSION,
                    "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}},
                   zero / "optimizer_state.pt")
        meta = {"module": module, "buffer_names": [n for n in index if n not in params], "optimizer": None,
                "param_shapes": [shapes], "frozen_param_shapes": collections.OrderedDict(), "shared_params": {},
                "frozen_param_fragments": collections.OrderedDict(), "lr_scheduler": adam.scheduler, "data_sampler": None,
                "random_ltd": None, "skipped_steps": 0, "global_steps": opened.step, "global_samples": 0,
                "dp_world_size": 1, "mp_world_size": 1, "ds_version": DS_VERSION}
        torch.save(meta, tmp / tag / "mp_rank_00_model_states.pt")
        os.link(tmp / tag / "mp_rank_00_model_states.pt", tmp / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        (tmp / "latest_universal").write_text(tag)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        adam.close()
