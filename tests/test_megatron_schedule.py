"""Megatron's learning-rate and weight-decay schedule continued on a plain PyTorch optimizer
(:func:`ckptio.megatron_schedule`), against megatron-core 0.16.1's own ``OptimizerParamScheduler``."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointError, CheckpointManager, MegatronLRScheduler, megatron_schedule

pytest.importorskip("megatron.core.optimizer_param_scheduler")
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

logging.getLogger("megatron").setLevel(logging.WARNING)

GBS = 4  # samples per step: Megatron-LM's increment
DONE = 20  # steps taken before the checkpoint
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
CASES = [("constant", None, "constant"), ("linear", None, "linear"), ("cosine", None, "cosine"),
         ("inverse-square-root", None, "linear"), *[("WSD", s, "cosine") for s in WSD_STYLES]]


def _optimizer(model=None):
    """Two groups as megatron-core's: weight decay on the matrices, ``wd_mult`` 0 on the norms and biases."""
    model = torch.nn.Linear(3, 2) if model is None else model
    return torch.optim.AdamW([{"params": [model.weight]},
                              {"params": [model.bias], "wd_mult": 0.0}], lr=1.0, weight_decay=0.0)


def _megatron(style, wsd_style, wd_style):
    wd = (0.1, 0.1) if wd_style == "constant" else (0.01, 0.1)
    return OptimizerParamScheduler(
        _optimizer(), init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=100, lr_decay_steps=240,
        lr_decay_style=style, start_wd=wd[0], end_wd=wd[1], wd_incr_steps=200, wd_incr_style=wd_style,
        wsd_decay_steps=100 if style == "WSD" else None, lr_wsd_decay_style=wsd_style)


def _args(style, wsd_style, **changes):
    fields = dict(global_batch_size=GBS, lr_warmup_init=1e-5, rampup_batch_size=None, train_iters=60,
                  train_samples=None, lr_wsd_decay_iters=25 if style == "WSD" else None, lr_wsd_decay_samples=None,
                  lr_wsd_decay_style=wsd_style or "exponential")
    return argparse.Namespace(**{**fields, **changes})


def _legacy(root: Path, state, args) -> Path:
    """A legacy Megatron-LM run folder whose rank file holds ``state`` as its ``opt_param_scheduler``."""
    rank = root / f"iter_{DONE:07d}" / "mp_rank_00"
    rank.mkdir(parents=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": DONE, "model": {}, "opt_param_scheduler": state},
               rank / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(DONE))
    return root


def _dist(root: Path, state, args) -> Path:
    """A torch_dist iteration folder whose ``common.pt`` holds ``state``."""
    folder = root / f"iter_{DONE:07d}"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": DONE, "opt_param_scheduler": state},
               folder / "common.pt")
    return folder


def _groups(opt):
    return [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def _trained(style, wsd_style, wd_style):
    ref = _megatron(style, wsd_style, wd_style)
    for _ in range(DONE):
        ref.step(GBS)
    return ref


@pytest.mark.parametrize("style,wsd_style,wd_style", CASES)
@pytest.mark.parametrize("layout", ["legacy", "torch_dist"])
def test_the_next_50_steps_are_megatron_cores_bitwise(tmp_path, style, wsd_style, wd_style, layout):
    ref = _trained(style, wsd_style, wd_style)
    build = _legacy if layout == "legacy" else _dist
    path = build(tmp_path / "run", ref.state_dict(), _args(style, wsd_style))
    opt = _optimizer()
    sched = megatron_schedule(opt, path)
    assert isinstance(sched, MegatronLRScheduler) and isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert _groups(opt) == _groups(ref.optimizer)  # positioned at the checkpoint's num_steps
    seen = set()
    for _ in range(50):
        ref.step(GBS)
        sched.step()
        assert _groups(opt) == _groups(ref.optimizer), ref.num_steps  # bitwise: the same float operations
        assert sched.get_last_lr() == [g["lr"] for g in ref.optimizer.param_groups]
        seen.add(_groups(opt)[0][0])
    assert opt.param_groups[1]["weight_decay"] == 0.0 and len(seen) > 4  # the warmup, then the decay style


def test_a_ckptio_save_and_restore_continues_the_same(tmp_path):
    ref = _trained("WSD", "cosine", "linear")
    path = _legacy(tmp_path / "run", ref.state_dict(), _args("WSD", "cosine"))
    model = torch.nn.Linear(3, 2)
    opt = _optimizer(model)
    sched = megatron_schedule(opt, path)
    for _ in range(7):
        ref.step(GBS)
        sched.step()
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model, optimizer=opt,
                      lr_scheduler=sched).save(step=7)
    opt2 = _optimizer(model)
    sched2 = megatron_schedule(opt2, path)  # a new run starts from the Megatron checkpoint, then resumes ckptio's
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model, optimizer=opt2,
                      lr_scheduler=sched2).restore()
    assert sched2.num_steps == ref.num_steps and _groups(opt2) == _groups(ref.optimizer)
    for _ in range(50):
        ref.step(GBS)
        sched2.step()
        assert _groups(opt2) == _groups(ref.optimizer)


def test_the_increment_and_what_the_state_lacks_can_be_given(tmp_path):
    ref = _trained("WSD", "minus_sqrt", "constant")
    path = _legacy(tmp_path / "run", ref.state_dict(), _args("WSD", None, global_batch_size=None,
                                                              lr_wsd_decay_iters=None, lr_wsd_decay_style=None))
    opt = _optimizer()
    sched = megatron_schedule(opt, path, increment=GBS, wsd_decay_steps=100, lr_wsd_decay_style="minus_sqrt")
    for _ in range(50):
        ref.step(GBS)
        sched.step()
        assert _groups(opt) == _groups(ref.optimizer)


def _refused(tmp_path, state=None, args=None, **kwargs):
    ref_state = _trained("cosine", None, "linear").state_dict() if state is None else state
    path = _legacy(tmp_path / "run", ref_state, _args("cosine", None) if args is None else args)
    with pytest.raises(CheckpointError) as err:
        megatron_schedule(_optimizer(), path, **kwargs)
    return str(err.value)


def test_fields_it_does_not_reproduce_are_refused_by_name(tmp_path):
    state = {**_trained("cosine", None, "linear").state_dict(), "lr_mult_override": 2.0}
    message = _refused(tmp_path, state)
    assert "lr_mult_override" in message and "model_optim_rng.pt" in message


def test_a_state_without_the_weight_decay_schedule_is_refused(tmp_path):
    state = {k: v for k, v in _trained("cosine", None, "linear").state_dict().items()
             if k not in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")}
    assert "start_wd" in _refused(tmp_path, state)


@pytest.mark.parametrize("field,value", [("end_wd", 10 ** 400), ("max_lr", 1e308), ("num_steps", 2 ** 64),
                                         ("lr_decay_steps", 10 ** 30)],
                         ids=["end_wd-int-of-400-digits", "max_lr-1e308", "num_steps-2**64", "lr_decay_steps-1e30"])
def test_numbers_past_what_a_run_holds_are_refused_by_name(tmp_path, field, value):
    """Found by the megatron_schedule fuzz family: an integer too large for a float raised OverflowError, and a
    learning rate near the float's limit gave an infinite one."""
    message = _refused(tmp_path, {**_trained("cosine", None, "linear").state_dict(), field: value})
    assert field in message and "model_optim_rng.pt" in message


@pytest.mark.parametrize("iters", [{}, "x"])
def test_wsd_annealing_iterations_of_another_type_are_refused_by_name(tmp_path, iters):
    """Found by the megatron_schedule fuzz family: a dict here raised TypeError (and a string would have been
    repeated global_batch_size times)."""
    state = _trained("WSD", "linear", "cosine").state_dict()
    message = _refused(tmp_path, state, _args("WSD", "linear", lr_wsd_decay_iters=iters))
    assert "lr_wsd_decay_iters" in message and "model_optim_rng.pt" in message


def test_an_increment_past_what_a_run_holds_is_refused(tmp_path):
    assert "increment" in _refused(tmp_path, increment=10 ** 400)


def test_a_batch_size_ramp_up_needs_the_increment(tmp_path):
    assert "rampup_batch_size" in _refused(tmp_path, args=_args("cosine", None, rampup_batch_size=[4, 4, 100]))


def test_a_decoupled_embedding_schedule_needs_its_group(tmp_path):
    assert "decoupled_lr" in _refused(tmp_path, args=_args("cosine", None, decoupled_lr=1e-3))
    ref = _trained("cosine", None, "linear")
    ref.optimizer.param_groups[1].update(max_lr=1e-3, min_lr=0.0)  # megatron-core's group of the embedding
    ref.step(0)
    path = _legacy(tmp_path / "given", ref.state_dict(), _args("cosine", None, decoupled_lr=1e-3))
    opt = _optimizer()
    opt.param_groups[1].update(max_lr=1e-3, min_lr=0.0)
    sched = megatron_schedule(opt, path)
    for _ in range(50):
        ref.step(GBS)
        sched.step()
        assert _groups(opt) == _groups(ref.optimizer)


def test_wsd_without_its_annealing_style_is_refused(tmp_path):
    ref = _trained("WSD", "linear", "linear")
    assert "lr_wsd_decay_style" in _refused(tmp_path, ref.state_dict(), _args("WSD", None, lr_wsd_decay_style="x"))
    assert "lr_wsd_decay_iters" in _refused(tmp_path / "b", ref.state_dict(), _args("WSD", "linear",
                                                                                  lr_wsd_decay_iters=None))


def test_damaged_or_missing_state_names_the_file(tmp_path):
    state = {**_trained("cosine", None, "linear").state_dict(), "lr_decay_style": "zigzag"}
    assert "zigzag" in _refused(tmp_path / "a", state)
    state = {**_trained("cosine", None, "linear").state_dict(), "num_steps": float("nan")}
    assert "num_steps" in _refused(tmp_path / "b", state)
    state = {**_trained("cosine", None, "linear").state_dict(), "min_lr": 1.0}
    assert "min_lr ≤ max_lr" in _refused(tmp_path / "c", state)
    folder = _dist(tmp_path / "d", {}, _args("cosine", None))
    torch.save({"args": _args("cosine", None), "iteration": DONE}, folder / "common.pt")
    with pytest.raises(CheckpointError, match="common.pt.*no opt_param_scheduler"):
        megatron_schedule(_optimizer(), folder)
    (folder / "common.pt").write_bytes(b"not a torch archive")
    with pytest.raises(CheckpointError, match="common.pt"):
        megatron_schedule(_optimizer(), folder)
    with pytest.raises(CheckpointError, match="not a Megatron checkpoint"):
        megatron_schedule(_optimizer(), tmp_path)


@pytest.mark.slow
def test_fuzz_family_smoke():
    """A CI-sized run of the megatron_schedule fuzz family (``tools/fuzz_schedule.py``: the record file's schedule
    and pickle damaged): every input ends in a schedule megatron-core agrees with or a ckptio error naming the file."""
    from megatron_shared import fuzz_smoke

    fuzz_smoke("megatron_schedule", 200)
