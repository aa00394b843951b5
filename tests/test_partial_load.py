"""Partial and selective restores: states to load, keys to exclude, strict=False with a report, dtype casts."""

from __future__ import annotations

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import CheckpointMismatchError, ConfigError
from distributed import run_ranks

FORMATS = ("safetensors", "torch_save")


def _model(seed: int, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import LlamaForCausalLM

    from toy import llama_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(tie_word_embeddings=False, **overrides)).to(dtype)


def _save(root, fmt, model, *, steps: int = 1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt), model=model,
                           optimizer=opt, lr_scheduler=sched, rng=False) as mgr:
        mgr.save(step=steps)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _manager(root, fmt, model, **config):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, **config),
                            model=model, optimizer=opt, lr_scheduler=sched, rng=False)
    return mgr, opt, sched


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_new_head_is_refused_strictly_with_a_table_and_loaded_around_when_not_strict(tmp_path, fmt):
    saved = _save(tmp_path, fmt, _model(0))
    bigger = _model(1, vocab_size=80)
    fresh = {k: v.clone() for k, v in bigger.state_dict().items()}
    mgr, _, _ = _manager(tmp_path, fmt, bigger, load_states=["model"])
    with pytest.raises(CheckpointMismatchError, match=r"(?s)strict.*shape/dtype\s+lm_head.weight\s+checkpoint "
                                                      r"\[64, 32\] float32, model \[80, 32\] float32"):
        mgr.restore(exclude=[])
    info = mgr.restore(strict=False)
    report = info.report
    assert sorted(k for k, _, _ in report.mismatched) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert not report.missing and not report.unexpected and "optim" in report.skipped_states
    for k, v in bigger.state_dict().items():
        want = fresh[k] if k in ("lm_head.weight", "model.embed_tokens.weight") else saved[k]
        assert torch.equal(v, want), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_excluded_keys_and_unloaded_states_keep_their_live_values(tmp_path, fmt):
    saved = _save(tmp_path, fmt, _model(0))
    model = _model(1)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    mgr, opt, sched = _manager(tmp_path, fmt, model)
    info = mgr.restore(states=["model"], exclude=["lm_head.*", "model.layers.1.*"])
    assert "lm_head.weight" in info.report.excluded and len(info.report.excluded) == 10
    assert sorted(info.report.skipped_states) == ["lr_scheduler", "optim"]
    for k, v in model.state_dict().items():
        excluded = k.startswith(("lm_head.", "model.layers.1."))
        assert torch.equal(v, fresh[k] if excluded else saved[k]), k
    assert not opt.state and sched.last_epoch == 0  # fresh optimizer and schedule


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_and_unexpected_layers_are_reported(tmp_path, fmt):
    saved = _save(tmp_path, fmt, _model(0, num_hidden_layers=3))
    model = _model(1, num_hidden_layers=2)
    mgr, _, _ = _manager(tmp_path, fmt, model, strict=False, load_states=["model"])
    report = mgr.restore().report
    assert len(report.unexpected) == 9 and all(k.startswith("model.layers.2.") for k in report.unexpected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    (tmp_path / "b").mkdir()
    _save(tmp_path / "b", fmt, _model(0, num_hidden_layers=2))
    deeper = _model(1, num_hidden_layers=3)
    report = _manager(tmp_path / "b", fmt, deeper, strict=False, load_states=["model"])[0].restore().report
    assert len(report.missing) == 9 and report.loaded and not report.unexpected


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saved_dtype,live_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_another_dtype_loads_only_by_explicit_choice(tmp_path, fmt, saved_dtype, live_dtype):
    saved = _save(tmp_path, fmt, _model(0, saved_dtype))
    model = _model(1, live_dtype)
    message = f"checkpoint .* {str(saved_dtype)[6:]}, model .* {str(live_dtype)[6:]}"
    with pytest.raises(CheckpointMismatchError, match=message):  # the default: strict, no cast
        _manager(tmp_path, fmt, model, load_states=["model"])[0].restore()
    with pytest.raises(CheckpointMismatchError, match=message):
        _manager(tmp_path, fmt, model, load_states=["model"], load_cast_dtype=False)[0].restore(strict=True, exclude=["x"])
    info = _manager(tmp_path, fmt, model, load_states=["model"], load_cast_dtype=True)[0].restore()
    assert len(info.report.cast) == len(saved)
    for k, v in model.state_dict().items():
        assert v.dtype == live_dtype and torch.equal(v, saved[k].to(live_dtype)), k


def test_bad_options_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="load_states must be a list"):
        CheckpointConfig(checkpoint_dir=str(tmp_path), load_states="model")  # type: ignore[arg-type]
    mgr, _, _ = _manager(tmp_path, "safetensors", _model(0))
    with pytest.raises(ConfigError, match=r"states \['optimizer'\] are not states of this manager"):
        mgr.restore(states=["optimizer"])


def _partial_on_ranks(root: str, fmt: str) -> dict:
    from toy import full_state, make_model

    model = make_model(seed=3, tie_word_embeddings=False).to(torch.bfloat16)  # FSDP2 on 2 ranks
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root, model_save_format=fmt), model=model,
                           rng=False) as mgr:
        info = mgr.restore(exclude=["lm_head.*"], cast_dtype=True)
    out = {k.removeprefix("model/"): v for k, v in full_state(model).items()}
    out["casts"] = torch.tensor(len(info.report.cast))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_cast_load_on_sharded_ranks(tmp_path, fmt):
    from toy import make_model

    saved = _save(tmp_path, fmt, make_model(seed=0, tie_word_embeddings=False))
    fresh = make_model(seed=3, tie_word_embeddings=False).to(torch.bfloat16).state_dict()
    got = run_ranks(2, _partial_on_ranks, root=str(tmp_path), fmt=fmt)[0]
    assert int(got.pop("casts")) == len(saved) - 1
    for k, v in got.items():
        assert torch.equal(v, fresh[k] if k == "lm_head.weight" else saved[k].to(torch.bfloat16)), k
