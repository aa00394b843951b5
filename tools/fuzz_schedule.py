"""The fuzz family of Megatron's schedule reader (``ckptio.megatron_schedule``), for ``fuzz_readers.py``.

``megatron_schedule``: the file a Megatron checkpoint records its run in (``layout.record_file``: a legacy run's
first ``model_optim_rng.pt``, a torch_dist ``common.pt``), holding megatron-core's ``OptimizerParamScheduler``
state after 20 steps of each decay style (constant, linear, cosine, inverse-square-root, WSD with each annealing),
damaged: half the time the schedule itself (``opt_param_scheduler`` and the run's ``args``: fields dropped, of other
types, huge, NaN, infinite, negative, steps past the decay, unknown fields, older spellings, the state not a dict),
else as every pickle is (cut, flipped, hostile pickles, zip bombs, members dropped, the object changed; the file
missing, a link, a folder...), then continued on a plain optimizer with ``megatron_schedule(optimizer, path)``.

The verdict: a ``CheckpointError`` naming the checkpoint, or a scheduler whose learning rate and weight decay of
every group are megatron-core's own (``OptimizerParamScheduler`` built from the values read, at the same step) now
and after five more steps, finite; an untouched file must give exactly the state megatron-core saved.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
from pathlib import Path
from typing import Any

import torch
from fuzz_frameworks import _fixed_dir, _kinds, _place, damage
from fuzz_kit import Case, WrongResult, load_image

GBS, DONE = 4, 20
STYLES = [("constant", None, "constant"), ("linear", None, "linear"), ("cosine", None, "cosine"),
          ("inverse-square-root", None, "linear"), *[("WSD", s, "cosine") for s in ("linear", "cosine",
                                                                                    "exponential", "minus_sqrt")]]
_VALUES = [None, "x", "cosine", True, [], {}, (1, 2), b"raw", 0, 1, -1, -1e-9, 0.5, 2 ** 31, 2 ** 63, 2 ** 64,
           10 ** 30, 10 ** 400, 1e308, float("inf"), float("-inf"), float("nan"), 10 ** 6, 239, 240, 241]


def _optimizer() -> torch.optim.Optimizer:
    """Two groups as megatron-core's: weight decay on the matrices, ``wd_mult`` 0 on the norms and biases."""
    model = torch.nn.Linear(3, 2)
    return torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "wd_mult": 0.0}], lr=1.0,
                             weight_decay=0.0)


def _megatron(**kw: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(_optimizer(), **kw)


def _runs() -> dict[str, Path]:
    """For each style, a legacy run folder and a torch_dist iteration folder holding megatron-core's state."""
    out, runs = _fixed_dir("megatron-schedule"), {}
    for style, wsd, wd_style in STYLES:
        wd = (0.1, 0.1) if wd_style == "constant" else (0.01, 0.1)
        ref = _megatron(init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=100, lr_decay_steps=240,
                        lr_decay_style=style, start_wd=wd[0], end_wd=wd[1], wd_incr_steps=200, wd_incr_style=wd_style,
                        wsd_decay_steps=100 if style == "WSD" else None, lr_wsd_decay_style=wsd)
        for _ in range(DONE):
            ref.step(GBS)
        args = argparse.Namespace(global_batch_size=GBS, lr_warmup_init=1e-5, rampup_batch_size=None, train_iters=60,
                                  train_samples=None, lr_wsd_decay_iters=25 if style == "WSD" else None,
                                  lr_wsd_decay_samples=None, lr_wsd_decay_style=wsd or "exponential")
        saved = {"args": args, "checkpoint_version": 3.0, "iteration": DONE, "opt_param_scheduler": ref.state_dict()}
        name = f"{style}-{wsd}"
        legacy = out / "legacy" / name
        (legacy / f"iter_{DONE:07d}" / "mp_rank_00").mkdir(parents=True, exist_ok=True)
        torch.save({**saved, "model": {}}, legacy / f"iter_{DONE:07d}" / "mp_rank_00" / "model_optim_rng.pt")
        (legacy / "latest_checkpointed_iteration.txt").write_text(str(DONE))
        dist = out / "dist" / name / f"iter_{DONE:07d}"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
        torch.save(saved, dist / "common.pt")
        runs[f"legacy/{name}"], runs[f"dist/{name}"] = legacy, dist.parent
    return runs


def _record(image: dict[str, Any]) -> str:
    return next(rel for rel in sorted(image) if rel.endswith(("model_optim_rng.pt", "common.pt")))


def _mutate_schedule(rng: Case, saved: dict[str, Any]) -> dict[str, Any]:
    """The saved object with its schedule or the run's arguments changed (one to three changes)."""
    saved = copy.deepcopy(saved)
    for _ in range(rng.choice([1, 1, 2, 3])):
        state, args = saved.get("opt_param_scheduler"), saved.get("args")
        kind = rng.choice(["field", "field", "field", "drop", "add", "spell", "arg", "arg", "whole"])
        if kind == "whole":
            value = rng.choice([None, [], "x", 3, {1: 2}, {"max_lr": None}, argparse.Namespace(max_lr=1.0)])
            what = rng.choice(["opt_param_scheduler", "args", "saved"])
            rng.note(f"{what} <- {type(value).__name__} {str(value)[:30]}")
            if what == "saved":
                return value  # type: ignore[return-value]
            saved[what] = value
        elif kind == "arg" and isinstance(args, argparse.Namespace):
            name = rng.choice(["global_batch_size", "lr_warmup_init", "rampup_batch_size", "lr_wsd_decay_iters",
                               "lr_wsd_decay_samples", "lr_wsd_decay_style", "train_samples", "decoupled_lr"])
            value = rng.choice(_VALUES)
            rng.note(f"args.{name} <- {type(value).__name__} {str(value)[:30]}")
            setattr(args, name, value)
        elif isinstance(state, dict) and state:
            key = rng.choice(sorted(state, key=repr))
            if kind == "drop":
                rng.note(f"opt_param_scheduler[{key!r}] dropped")
                del state[key]
            elif kind == "add":
                extra = rng.choice(["fuzz", 7, None, ("t",), "wsd_decay_steps"])
                rng.note(f"opt_param_scheduler[{extra!r}] added")
                state[extra] = 1
            elif kind == "spell":
                old = {"max_lr": "start_lr", "lr_warmup_steps": "warmup_iter", "lr_decay_steps": "end_iter",
                       "lr_decay_style": "decay_style", "num_steps": "num_iters"}.get(key, key)
                rng.note(f"opt_param_scheduler[{key!r}] spelled {old!r}")
                state[old] = state.pop(key)
            else:
                scaled = []
                if type(state[key]) in (int, float):
                    try:
                        scaled = [state[key] * rng.choice([-1, 2, 1e6])]
                    except OverflowError:  # an earlier change made it an integer too large for a float
                        scaled = [float("inf")]
                value = rng.choice(_VALUES + scaled)
                rng.note(f"opt_param_scheduler[{key!r}] <- {type(value).__name__} {str(value)[:30]}")
                state[key] = value
    return saved


def _check(sched: Any) -> None:
    """The scheduler read sets every group as megatron-core's scheduler of the same values does, now and later."""
    fields = ("init_lr", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd",
              "end_wd", "wd_incr_steps", "wd_incr_style", "wsd_decay_steps", "lr_wsd_decay_style")
    try:
        ref = _megatron(**{f: getattr(sched, f) for f in fields})
    except AssertionError as exc:
        raise WrongResult(f"megatron-core refuses the schedule read: {exc}") from None
    ref.num_steps = sched.num_steps
    for n in range(6):
        ref.step(0 if n == 0 else sched.increment)
        if n:
            sched.step()
        got = [(g["lr"], g["weight_decay"]) for g in sched.optimizer.param_groups]
        want = [(g["lr"], g["weight_decay"]) for g in ref.optimizer.param_groups]
        if got != want or not all(math.isfinite(v) for pair in got for v in pair):
            raise WrongResult(f"step {n}: lr/wd {got}, megatron-core's {want}")


class MegatronSchedule:
    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        self.runs = _runs()
        self.images = {name: load_image(root) for name, root in self.runs.items()}
        self.objs = {name: torch.load(io.BytesIO(image[_record(image)]), weights_only=False)  # our own files
                     for name, image in self.images.items()}

    def __call__(self, rng: Case, tmp: Path) -> None:
        from ckptio import CheckpointError, megatron_schedule

        self.prepare()
        rng.reading = False
        name = rng.choice(sorted(self.images))
        image, rel = dict(self.images[name]), _record(self.images[name])
        touched = False
        if not rng.pristine and rng.random() < 0.5:
            buf = io.BytesIO()
            torch.save(_mutate_schedule(rng, self.objs[name]), buf)
            image[rel], touched = buf.getvalue(), True
        elif not rng.pristine:
            kinds = _kinds(image)
            if rng.random() < 0.9:
                kinds = {rel: kinds[rel]}
            touched = bool(damage(rng, image, kinds, tmp, {rel: self.objs[name]}, manifest=None))
        root = tmp / "run"
        _place(rng, image, root, tmp)
        given = rng.choice([{}, {}, {}, {"increment": 1}, {"init_lr": 0.0}, {"wsd_decay_steps": 50}])
        rng.reading = True
        try:
            sched = megatron_schedule(_optimizer(), root, **given)
        except CheckpointError as exc:
            if str(root) not in str(exc):
                raise WrongResult(f"the error names no file of the checkpoint: {exc}") from exc
            raise
        if not touched and not given and sched.num_steps != DONE * GBS:
            raise WrongResult(f"an untouched schedule read at num_steps {sched.num_steps}, not {DONE * GBS}")
        _check(sched)


FAMILIES = {"megatron_schedule": MegatronSchedule()}
