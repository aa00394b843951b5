"""A LoRA run's optimizer state is keyed by the adapter weights' plain names, the ones NeMo AutoModel's LoRA
modules carry (``model.layers.0.self_attn.q_proj.lora_A.weight``), so either tool resumes the other's
optimizer; checkpoints of earlier ckptio versions, keyed by peft's full names, still load."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemReader

from ckptio import CheckpointConfig, CheckpointManager
from toy import make_model


def _model_and_optimizer(tmp_path, seed: int):
    model = make_model(seed=0, peft=True, base_dir=str(tmp_path / "base"))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_()  # lora_B starts at zero: make every adapter weight count
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def _state(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v.clone() for k, v in s.items()} for s in opt.state_dict()["state"].values()]


def _manager(tmp_path, model, opt) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt"), is_peft=True), model=model,
                             optimizer=opt, rng=False, base_model_path=str(tmp_path / "base"))


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_peft_optimizer_state_is_keyed_by_the_plain_adapter_names(tmp_path):
    model, opt = _model_and_optimizer(tmp_path, 1)
    with _manager(tmp_path, model, opt) as mgr:
        mgr.save(step=1)
    keys = FileSystemReader(str(tmp_path / "ckpt" / "epoch_0_step_1" / "optim")).read_metadata().state_dict_metadata
    states = sorted(k for k in keys if k.startswith("optim.state."))
    assert "optim.state.model.layers.0.self_attn.q_proj.lora_A.weight.exp_avg" in states
    assert not [k for k in keys if "base_model" in k or ".default." in k]
    fresh, fresh_opt = _model_and_optimizer(tmp_path, 2)
    with _manager(tmp_path, fresh, fresh_opt) as mgr:
        assert mgr.restore().step == 1
    _same(_state(fresh_opt), _state(opt))


def test_a_peft_optimizer_saved_under_full_peft_names_still_loads(tmp_path):
    model, opt = _model_and_optimizer(tmp_path, 1)
    with _manager(tmp_path, model, opt) as mgr:
        mgr.tracked.optim_state.peft_adapter = None  # as ckptio wrote it before: base_model.model.….default.weight
        mgr.save(step=1)
    keys = FileSystemReader(str(tmp_path / "ckpt" / "epoch_0_step_1" / "optim")).read_metadata().state_dict_metadata
    assert any(".lora_A.default.weight" in k for k in keys)
    fresh, fresh_opt = _model_and_optimizer(tmp_path, 2)
    with _manager(tmp_path, fresh, fresh_opt) as mgr:
        assert mgr.restore().step == 1
    _same(_state(fresh_opt), _state(opt))
    hyper = fresh_opt.param_groups[0]
    assert hyper["lr"] == 1e-2 and hyper["weight_decay"] == opt.param_groups[0]["weight_decay"]
