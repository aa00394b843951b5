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

Each parameter's tensors are written as soon as they are read (one parameter in memory at a time); the folder is
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
from ..training_state import grouped, per_parameter, saved_optimizer
from .zero import MOMENTS

__all__ = ["write_universal", "DS_VERSION"]

DS_VERSION = "0.19.0"
"""The DeepSpeed version the files say they follow (DeepSpeed checks the stage-1 layout against it)."""


def _fresh(index: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], Any]:
    """Adam as a new optimizer starts (zero moments, step 0) for every floating-point tensor: a source without an
    optimizer (a Hugging Face folder) becomes a universal folder DeepSpeed starts training from."""
    import logging

    logging.getLogger("ckptio").warning("the source holds no optimizer state: the universal folder starts Adam "
                                        "fresh (zero moments, step 0)")
    state = {n: {"exp_avg": None, "exp_avg_sq": None, "step": 0.0} for n, info in index.items()
             if info.dtype.startswith(("float", "bfloat"))}
    return state, {n: {} for n in state}, None


def _optimizer_of(opened: Opened, index: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]],
                                                                  Any]:
    """The source's Adam state per parameter name, hyper-parameters per name, and LR scheduler state."""
    if opened.step_dir is None:
        return _fresh(index)
    saved, scheduler = saved_optimizer(opened.step_dir)
    if saved is None:
        return _fresh(index)
    state, hyper = per_parameter(saved)
    missing = [f for f in hyper if not all(m in state.get(f, {}) for m in MOMENTS)]
    if not state or missing:
        raise CheckpointError(f"{opened.step_dir}: the optimizer is not Adam/AdamW with state for every parameter "
                              f"(no exp_avg/exp_avg_sq for {missing[:3]}); a universal folder holds Adam's moments")
    return state, hyper, scheduler


def _step(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def write_universal(opened: Opened, source: Any, out: Path, options: WriteOptions) -> None:
    """Write ``OUT`` as described in the module's docstring (``out`` must not exist)."""
    index = source.index()
    state, hyper, scheduler = _optimizer_of(opened, index)
    params = [n for n in index if n in state]
    tag = f"global_step{opened.step}_universal"
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    zero = tmp / tag / "zero"
    zero.mkdir(parents=True)
    try:
        module: dict[str, torch.Tensor] = collections.OrderedDict()
        shapes: dict[str, torch.Size] = collections.OrderedDict()
        for name in index:
            tensor = source.read(name)
            module[name] = tensor
            if name not in state:
                continue
            shapes[name] = tensor.shape
            folder = zero / name
            folder.mkdir()
            values = {"fp32": tensor, **{m: state[name][m] for m in MOMENTS}}
            for what, value in values.items():
                value = torch.zeros_like(tensor) if value is None else value
                value = value.detach().to(torch.float32).reshape(tensor.shape).contiguous()
                torch.save({"param": value, "cat_dim": 0}, folder / f"{what}.pt")
            torch.save(torch.tensor(_step(state[name]["step"])), folder / "step.pt")
            if options.progress is not None:
                options.progress(tensor.numel() * tensor.element_size())
        groups = grouped(hyper, params)
        step = torch.tensor(_step(state[params[0]]["step"])) if params else torch.tensor(0.0)
        torch.save({"param_groups": groups, "ds_version": DS_VERSION,
                    "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}},
                   zero / "optimizer_state.pt")
        meta = {"module": module, "buffer_names": [n for n in index if n not in state], "optimizer": None,
                "param_shapes": [shapes], "frozen_param_shapes": collections.OrderedDict(), "shared_params": {},
                "frozen_param_fragments": collections.OrderedDict(), "lr_scheduler": scheduler, "data_sampler": None,
                "random_ltd": None, "skipped_steps": 0, "global_steps": opened.step, "global_samples": 0,
                "dp_world_size": 1, "mp_world_size": 1, "ds_version": DS_VERSION}
        torch.save(meta, tmp / tag / "mp_rank_00_model_states.pt")
        os.link(tmp / tag / "mp_rank_00_model_states.pt", tmp / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        (tmp / "latest_universal").write_text(tag)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
