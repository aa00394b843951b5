"""``ckptio consolidate``: offline export from either model format, bounded memory, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptio.formats.safetensors import sharded as safetensors_sharded
from cli_here import ckptio_here



def _save_llama(root: Path, fmt: str):
    from toy import Run

    run = Run(root, fmt, max_steps=2)
    run.train(save_at=(2,))
    run.model.eval()
    return run.model


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_consolidate_a_checkpoint_saved_without_it(tmp_path, fmt, monkeypatch):
    monkeypatch.setenv("CKPTIO_PROGRESS_MIN_BYTES", "0")  # progress shown for this tiny model
    from transformers import AutoModelForCausalLM

    model = _save_llama(tmp_path, fmt)
    step_dir = tmp_path / "epoch_0_step_2"
    out = ckptio_here("consolidate", step_dir, "--max-shard-size", "20KB", "--dtype", "bfloat16")
    assert out.returncode == 0, out.stderr
    bundle = step_dir / "model" / "consolidated"
    assert "100%" in out.stderr and str(bundle) in out.stdout  # progress bar, and where it went
    loaded, info = AutoModelForCausalLM.from_pretrained(bundle, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p.detach().to(torch.bfloat16)), name
    assert len(json.loads((bundle / "model.safetensors.index.json").read_text())["weight_map"]) == 20
    again = ckptio_here("consolidate", step_dir)
    assert again.returncode == 2 and "--overwrite" in again.stderr


_RSS_SCRIPT = r"""
import sys
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
import torch, safetensors.torch, tqdm
from ckptio.cli import main
import ckptio.formats.safetensors.hf_bundle, ckptio.formats.registry  # the code itself, imported lazily by the command
ckptio.formats.registry.names()
before = hwm()
code = main(["consolidate", sys.argv[1], "--out", sys.argv[2], "--max-shard-size", sys.argv[3], "--no-progress"])
print("EXTRA", hwm() - before)
sys.exit(code)
"""


def test_consolidation_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """A 192 MiB model whose largest tensor is 16 MiB consolidates in far less than the model's size."""
    mib = 1024 * 1024
    src = tmp_path / "model"
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(2048, 2048, generator=g) for i in range(12)}  # 16 MiB each
    safetensors_sharded.save(tensors, src, rank=0, world_size=1)
    del tensors
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(src), str(tmp_path / "hf"), "64MiB"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.split("EXTRA")[1].split()[0])
    print(f"peak extra RSS {extra / mib:.1f} MiB for a {total / mib:.0f} MiB model (largest tensor 16 MiB)")
    assert total > 190 * mib
    assert extra < 2 * 16 * mib + 24 * mib, f"consolidation held {extra / mib:.0f} MiB"
    files = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) == 3  # 4 tensors of 16 MiB per 64 MiB file
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    merged = {}
    for f in files:
        merged.update(load_file(f))
    for i in range(12):
        assert torch.equal(merged[f"layers.{i}.weight"], torch.randn(2048, 2048, generator=g))
