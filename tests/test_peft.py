"""LoRA checkpoints are PEFT adapter folders that peft loads offline, and LoRA runs resume exactly."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

PROMPT = torch.tensor([[1, 8, 5, 12, 12, 15, 4, 20, 8, 5]])
N = 10


def _train(root: str, base_dir: str, stop_at: int | None = None, resume: bool = False) -> dict:
    from peft import get_peft_model_state_dict
    from toy import Run, full_state, make_tokenizer

    run = Run(f"{root}/ckpt", max_steps=N, peft=True, base_dir=base_dir)
    run.mgr.tokenizer = make_tokenizer()
    if resume:
        info = run.mgr.restore()
        assert info is not None
    run.train(save_at=(4, N), stop_at=stop_at)
    run.model.eval()
    with torch.no_grad():
        logits = run.model(input_ids=PROMPT).logits
    adapters = {k: v for k, v in full_state(run.model).items() if "lora_" in k}
    peft_keys = sorted(get_peft_model_state_dict(run.model)) if not torch.distributed.is_initialized() else []
    return {"logits": logits, "adapters": adapters, "losses": run.losses, "peft_keys": peft_keys}


@pytest.mark.parametrize("world", [1, 2])
def test_lora_adapter_folder_loads_in_peft_and_resumes_exactly(tmp_path, world):
    from peft import AutoPeftModelForCausalLM

    root, base = str(tmp_path), str(tmp_path / "base")
    straight = run_ranks(world, _train, root=root, base_dir=base)[0]
    step_dir = tmp_path / "ckpt" / f"epoch_0_step_{N}"
    model_dir = step_dir / "model"
    names = sorted(p.name for p in model_dir.iterdir())
    assert "adapter_config.json" in names and "adapter_model.safetensors" in names and "tokenizer.json" in names
    assert not [n for n in names if n.endswith(".distcp") or n.startswith("shard-")]
    config = json.loads((model_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")  # absolute: loads offline

    from safetensors import safe_open

    with safe_open(str(model_dir / "adapter_model.safetensors"), framework="pt") as fh:
        keys = sorted(fh.keys())
    assert keys and all("lora_" in k and ".default." not in k for k in keys)
    if world == 1:
        assert keys == straight["peft_keys"]  # exactly the names peft itself writes
    from ckptio.formats import registry
    from ckptio.engine.manifest import read_manifest
    from ckptio.storage.confined import Folder

    optim_entry = read_manifest(step_dir).states["optim"]  # whatever format the optimizer was saved in
    optim_keys = registry.get(optim_entry.format).state_index(Folder(step_dir / optim_entry.path))
    assert all("lora_" in k for k in optim_keys if k.startswith("optim.state.")), "frozen weights have optimizer state"

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(model_dir))
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=PROMPT).logits, straight["logits"])

    # interrupted at 4 (the first checkpoint), resumed in a fresh process: bitwise the same run
    resumed_root = tmp_path / "again"
    run_ranks(world, _train, root=str(resumed_root), base_dir=base, stop_at=4)
    resumed = run_ranks(world, _train, root=str(resumed_root), base_dir=base, resume=True)[0]
    assert sorted(resumed["losses"]) == list(range(5, N + 1))
    for step in range(5, N + 1):
        assert resumed["losses"][step] == straight["losses"][step], step
    for key, value in straight["adapters"].items():
        assert torch.equal(resumed["adapters"][key], value), key
