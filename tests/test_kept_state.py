"""torch's state dicts kept between saves (``ckptio.state.kept``): used again only while nothing they are made of
changed, and then equal to what torch would build.

The oracle is torch's own ``get_state_dict`` called afresh after each change: the kept result must have the same
keys, the same tensors (same memory, same values) and the same plain values. Each change is also counted as a
reuse (``hits``) or a rebuild (``builds``), so that a test of a change that must be noticed fails if it is not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.state.kept import KeptStateDicts
from ckptio.state.optimizer import _OPTIONS
from toy import VOCAB, TinyLM, full_state


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = TinyLM(hidden=16)
    model.register_buffer("scale", torch.ones(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    _train(model, opt, sched, 0)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()  # type: ignore[attr-defined]


def _same_as_torch(got: tuple[dict, dict], model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for mine, theirs in zip(got, get_state_dict(model, opt, options=_OPTIONS)):
        assert list(mine) == list(theirs)
        for k, v in theirs.items():
            if isinstance(v, torch.Tensor):
                assert mine[k].data_ptr() == v.data_ptr() and torch.equal(mine[k], v), k
            else:
                assert mine[k] == v and type(mine[k]) is type(v), k


def _replace_data(model, opt, sched):
    model.lm_head.weight.data = torch.randn_like(model.lm_head.weight)


def _reload_optimizer(model, opt, sched):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _new_group(model, opt, sched):
    model.extra = torch.nn.Linear(3, 3)
    opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.5})


def _buffer_reassigned(model, opt, sched):
    model.scale = torch.full((3,), 2.0)


def _new_buffer_module(model, opt, sched):
    model.side = torch.nn.Module()
    model.side.register_buffer("b", torch.arange(4.0))


def _renamed(model, opt, sched):
    model.core = model.model
    del model.model


def _to_double(model, opt, sched):
    model.double()


def _train_step(model, opt, sched):
    _train(model, opt, sched, 7)


def _lr_only(model, opt, sched):
    for group in opt.param_groups:
        group["lr"] = 0.125


def _plain_state_value(model, opt, sched):
    opt.state[model.lm_head.weight]["note"] = 2  # was 1: a plain value is read again, not kept


CHANGES = {  # name -> (change, whether the kept dicts may be used after it)
    "training step": (_train_step, True),
    "lr changed": (_lr_only, True),
    "plain state value": (_plain_state_value, True),
    "param.data replaced": (_replace_data, False),
    "optimizer reloaded": (_reload_optimizer, False),
    "param group added": (_new_group, False),
    "buffer reassigned": (_buffer_reassigned, False),
    "module with a buffer added": (_new_buffer_module, False),
    "module renamed": (_renamed, False),
    "model cast to float64": (_to_double, False),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_between_saves_is_kept_or_noticed(name: str) -> None:
    model, opt, sched = _setup()
    opt.state[model.lm_head.weight]["note"] = 1
    kept = KeptStateDicts()
    _same_as_torch(kept.get(model, opt), model, opt)
    _same_as_torch(kept.get(model, opt), model, opt)
    assert (kept.builds, kept.hits, kept.why_not) == (1, 1, None)
    change, reused = CHANGES[name]
    change(model, opt, sched)
    _same_as_torch(kept.get(model, opt), model, opt)
    assert (kept.builds, kept.hits) == ((1, 2) if reused else (2, 1)), name
    _same_as_torch(kept.get(model, opt), model, opt)  # and kept again after a rebuild
    assert kept.builds + kept.hits == 4 and kept.hits >= 2


def test_a_model_with_its_own_state_dict_hook_is_never_kept() -> None:
    model, opt, _ = _setup()
    calls = []

    def hook(module, state_dict, prefix, local_metadata):
        calls.append(1)
        state_dict["lm_head.weight"] = state_dict["lm_head.weight"] * 2  # a new tensor each time

    model._register_state_dict_hook(hook)
    kept = KeptStateDicts()
    for _ in range(3):
        raw, _flat = kept.get(model, opt)
        assert torch.equal(raw["lm_head.weight"], model.lm_head.weight.detach() * 2)
    assert kept.hits == 0 and kept.builds == 3 and len(calls) == 3
    assert "makes its own state dict" in (kept.why_not or "")


def test_saves_reuse_state_dicts_and_hold_each_moment(tmp_path) -> None:
    """A background-saving manager through training, a scheduler and a structure change: every checkpoint restores to
    the state at its save() call, and the unchanged saves reused torch's dicts."""
    model, opt, sched = _setup()
    cfg = CheckpointConfig(checkpoint_dir=str(tmp_path), async_save=True, save_top_k=10)
    expected = {}
    with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, rng=False) as mgr:
        for step in range(1, 6):
            if step == 4:
                _replace_data(model, opt, sched)  # noticed: the next save holds the new weight
            path = mgr.save(step=step)
            expected[path] = (full_state(model, opt), [g["lr"] for g in opt.param_groups])
            _train(model, opt, sched, step)  # while the background write runs
        mgr.wait()
        assert mgr.tracked.kept.hits >= 3 and mgr.tracked.kept.builds == 2
    for path, (state, lrs) in expected.items():
        fresh, fresh_opt, fresh_sched = _setup()
        with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), model=fresh, optimizer=fresh_opt,
                               lr_scheduler=fresh_sched, rng=False) as mgr:
            mgr.restore(path)
        got = full_state(fresh, fresh_opt)
        assert sorted(got) == sorted(state)
        for k, v in state.items():
            assert torch.equal(got[k], v), (path, k)
        assert [g["lr"] for g in fresh_opt.param_groups] == lrs


def _instance_state_dict(module: torch.nn.Module):
    original = module.state_dict

    def state_dict(self, *args, **kwargs):
        out = original(*args, **kwargs)
        key = kwargs.get("prefix", "") + ("weight" if hasattr(self, "weight") else "lm_head.weight")
        out[key] = out[key] * 2  # a new tensor each time
        return out

    return state_dict


def _instance_save_to_state_dict(module: torch.nn.Module):
    def save(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.detach() * 3

    return save


@pytest.mark.parametrize("name,where,make", [
    ("state_dict", "lm_head", _instance_state_dict),
    ("_save_to_state_dict", "lm_head", _instance_save_to_state_dict),
    ("state_dict", "", _instance_state_dict),
])
def test_a_state_dict_method_set_on_the_instance_after_a_save_is_used(name: str, where: str, make) -> None:
    """``module.state_dict = types.MethodType(...)`` (or ``_save_to_state_dict``) after the dicts were kept: torch's
    ``get_state_dict`` calls the instance's method, so the kept dicts must not be used any more."""
    import types

    model, opt, _ = _setup()
    kept = KeptStateDicts()
    kept.get(model, opt)
    kept.get(model, opt)
    assert kept.hits == 1
    module = model.get_submodule(where)
    setattr(module, name, types.MethodType(make(module), module))
    for _ in range(2):
        raw, _flat = kept.get(model, opt)
        theirs, _ = get_state_dict(model, opt, options=_OPTIONS)
        assert list(raw) == list(theirs)
        for k, v in theirs.items():
            assert torch.equal(raw[k], v), k
        assert not torch.equal(raw["lm_head.weight"], model.lm_head.weight)
    assert kept.hits == 1 and "makes its own state dict" in (kept.why_not or "")


def test_a_state_dict_method_set_on_the_optimizer_after_a_save_is_used() -> None:
    import types

    model, opt, _ = _setup()
    kept = KeptStateDicts()
    kept.get(model, opt)
    original = opt.state_dict

    def state_dict(self):
        out = original()
        out["param_groups"][0]["lr"] = 0.75
        return out

    opt.state_dict = types.MethodType(state_dict, opt)
    _, flat = kept.get(model, opt)
    lrs = {v for k, v in flat.items() if k.startswith("param_groups.") and k.endswith(".lr")}
    assert lrs == {0.75} and kept.hits == 0
