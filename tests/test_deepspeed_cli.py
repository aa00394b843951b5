"""A DeepSpeed user's first commands on the folders the real DeepSpeed writes (issue 71): ``ckptio list``,
``inspect`` and ``convert`` on a run folder, before and after ckptio resumed and saved there, and a restore-only
script that leaves the folder as it was.

The runs are the real DeepSpeed's (0.19, CPU, gloo, under torchrun: ``tests/ds_run.py``): ZeRO-2 on 2 ranks saved at
steps 3 and 4, and ZeRO-3 on 2 ranks in bf16, a Llama saved as the HF Trainer does (``checkpoint-3/`` holding
``global_step3/`` and ``config.json``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("deepspeed", reason="test-only dependency: pip install --no-build-isolation deepspeed")

from cli_here import ckptio_here  # noqa: E402
from distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def runs():
    """test_deepspeed.py's runs (shared, read-only: ``fixture_cache.ds_run``; a test copies what it changes)."""
    from fixture_cache import ds_run

    return {"zero2": ds_run("--stage", "2", "--more", "1"),
            "zero3": ds_run("--stage", "3", "--bf16", "--model", "llama", "--hf")}


def _copy(runs, kind: str, tmp_path: Path) -> Path:
    out = tmp_path / kind
    shutil.copytree(runs[kind], out, symlinks=True)
    return out


def _resume_and_save(run_dir: str, save: bool) -> int:
    """A plain model and AdamW resumed from the folder DeepSpeed saved into (its checkpoint_dir); with ``save``, a
    ckptio checkpoint of the next step saved there."""
    from test_deepspeed import _toy_manager

    manager, model, opt, sched = _toy_manager(run_dir)
    info = manager.restore()
    assert info is not None
    if save:
        manager.save(step=info.step + 1)
    manager.close()
    return info.step


# ---------------------------------------------------------------------------------------------- row 1: list
def test_list_names_each_deepspeed_checkpoint_with_its_format_before_and_after_ckptio_saved_there(runs, tmp_path):
    run = _copy(runs, "zero2", tmp_path)
    out = ckptio_here("list", run)
    assert out.returncode == 0, out.stderr
    assert "NOT USABLE" not in out.stdout, out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("global_step")}
    assert set(lines) == {"global_step3", "global_step4"}, out.stdout
    for step in (3, 4):
        assert f"DeepSpeed ZeRO-2, step {step}, resumable" in lines[f"global_step{step}"], out.stdout
    assert "RESUME" in lines["global_step4"] and "RESUME" not in lines["global_step3"], out.stdout
    rows = {r["name"]: r for r in json.loads(ckptio_here("list", run, "--json").stdout)["checkpoints"]}
    assert rows["global_step3"]["step"] == 3 and rows["global_step3"]["foreign"]["format"] == "deepspeed"
    assert rows["global_step4"]["foreign"]["resumed"] and not rows["global_step3"]["foreign"]["resumed"]

    assert run_ranks(1, _resume_and_save, run_dir=str(run), save=True) == [4]
    out = ckptio_here("list", run)
    assert "NOT USABLE" not in out.stdout, out.stdout
    assert "DeepSpeed ZeRO-2, step 3, resumable" in out.stdout and "DeepSpeed ZeRO-2, step 4, resumable" in out.stdout
    ours = next(line for line in out.stdout.splitlines() if line.startswith("epoch"))
    assert "LATEST" in ours and "committed" in ours, out.stdout
    assert "RESUME" not in out.stdout.replace(ours, ""), out.stdout  # the ckptio checkpoint is what a resume takes


def test_list_names_the_other_layouts_a_restore_takes(runs, tmp_path):
    """An HF Trainer ``checkpoint-N/`` (with DeepSpeed inside, and a plain one), a Megatron ``iter_N/`` and a
    Lightning ``.ckpt`` in one folder: each listed with its format and what a restore does with it, as the
    restore's own detection says."""
    from transformers import LlamaForCausalLM

    from toy import llama_config

    root = tmp_path / "mixed"
    root.mkdir()
    shutil.copytree(runs["zero3"] / "checkpoint-3", root / "checkpoint-3")
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(root / "checkpoint-5")
    assert ckptio_here("convert", root / "checkpoint-5", tmp_path / "m", "--to", "megatron",
                       "--no-progress").returncode == 0
    iteration = next(p for p in (tmp_path / "m").iterdir() if p.name.startswith("iter_"))
    shutil.move(iteration, root / iteration.name)
    assert ckptio_here("convert", root / "checkpoint-5", root / "epoch=0-step=7.ckpt", "--to", "lightning",
                       "--no-progress").returncode == 0
    out = ckptio_here("list", root)
    assert out.returncode == 0 and "NOT USABLE" not in out.stdout, out.stdout
    line = {ln.split()[0]: ln for ln in out.stdout.splitlines()[1:] if ln.strip()}
    assert "DeepSpeed ZeRO-3, step 3, resumable" in line["checkpoint-3"], out.stdout
    assert "Hugging Face" in line["checkpoint-5"] and "weights" in line["checkpoint-5"], out.stdout
    assert "Megatron" in line[iteration.name], out.stdout
    assert "Lightning" in line["epoch=0-step=7.ckpt"], out.stdout


# ---------------------------------------------------------------------------------------------- row 2: convert
def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(16).view(1, 16) % 64).logits.float()


def test_convert_to_hf_without_a_config_says_so_and_takes_one_by_path_or_cached_name(runs, tmp_path):
    run = _copy(runs, "zero3", tmp_path)
    config = (run / "checkpoint-3" / "config.json").read_bytes()
    (run / "checkpoint-3" / "config.json").unlink()  # a plain DeepSpeed run: no config.json beside it
    out = ckptio_here("convert", run, tmp_path / "bare", "--to", "hf", "--dtype", "bf16", "--no-progress")
    assert out.returncode == 0 and not (tmp_path / "bare" / "config.json").exists()
    assert "weights only" in out.stderr and "--config" in out.stderr, out.stderr

    (tmp_path / "my-config.json").write_bytes(config)
    out = ckptio_here("convert", run, tmp_path / "hf", "--to", "hf", "--dtype", "bf16", "--no-progress",
                      "--config", tmp_path / "my-config.json")
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
    assert torch.equal(_logits(tmp_path / "hf"), torch.load(run / "logits.pt"))

    missing = ckptio_here("convert", run, tmp_path / "no", "--to", "hf", "--config", "nobody/no-such-model")
    assert missing.returncode == 2 and "nobody/no-such-model" in missing.stderr and "Traceback" not in missing.stderr
    assert not (tmp_path / "no").exists()

    # the model's name, from the Hugging Face cache (offline): the CLI as a process, the cache its environment's
    cache = tmp_path / "hub"
    blob = cache / "models--acme--tiny-llama" / "blobs" / hashlib.sha256(config).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(config)
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(os.path.relpath(blob, snapshot))
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE.parent / "src")}
    r = subprocess.run([str(Path(sys.executable).parent / "ckptio"), "convert", str(run), str(tmp_path / "named"), "--to",
                        "hf", "--dtype", "bf16", "--no-progress", "--config", "acme/tiny-llama"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    assert torch.equal(_logits(tmp_path / "named"), torch.load(run / "logits.pt"))


# ---------------------------------------------------------------------------------------------- rows 4, 5: inspect
def test_inspect_a_run_folder_says_what_a_resume_takes_and_what_else_is_there(runs, tmp_path):
    run = _copy(runs, "zero2", tmp_path)
    assert run_ranks(1, _resume_and_save, run_dir=str(run), save=True) == [4]
    ours = next(p.name for p in run.iterdir() if p.name.startswith("epoch"))
    out = ckptio_here("inspect", run)
    assert out.returncode == 0, out.stderr
    assert f"a resume takes {ours}" in out.stdout and "step 5" in out.stdout, out.stdout
    assert "global_step3 (DeepSpeed ZeRO-2, step 3)" in out.stdout, out.stdout
    assert "global_step4 (DeepSpeed ZeRO-2, step 4)" in out.stdout, out.stdout
    info = json.loads(ckptio_here("inspect", run, "--json").stdout)
    assert info["resume"]["takes"] == ours and info["step"] == 5
    assert sorted(o["name"] for o in info["resume"]["others"]) == ["global_step3", "global_step4"]


@pytest.mark.parametrize("kind,stage,files", [("zero2", 2, 3), ("zero3", 3, 4)])
def test_inspect_text_says_stage_ranks_step_adam_and_the_checkpoints_own_files(runs, kind, stage, files):
    run = runs[kind]
    out = ckptio_here("inspect", run)
    assert out.returncode == 0, out.stderr
    step = 4 if kind == "zero2" else 3
    tag = "global_step4" if kind == "zero2" else "checkpoint-3/global_step3"
    assert f"DeepSpeed ZeRO-{stage}, saved on 2 ranks, step {step}" in out.stdout, out.stdout
    assert f"checkpoint: {tag}" in out.stdout and "Adam state: yes" in out.stdout, out.stdout
    size = sum(p.stat().st_size for p in (run / tag).iterdir())
    from ckptio.cli._fmt import human_bytes

    assert f"files: {files}, {human_bytes(size)}" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------------- row 6: left as it was
def _fingerprint(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        st = path.lstat()
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() \
            else f"{'link' if path.is_symlink() else 'dir'} {st.st_mode:o}"
    return out


def test_a_restore_only_run_leaves_the_deepspeed_folder_byte_for_byte(runs, tmp_path):
    run = _copy(runs, "zero2", tmp_path)
    before = _fingerprint(run)
    assert run_ranks(1, _resume_and_save, run_dir=str(run), save=False) == [4]
    assert _fingerprint(run) == before
    assert run_ranks(1, _resume_and_save, run_dir=str(run), save=True) == [4]  # a save: ckptio's record begins
    record = json.loads((run / ".ckptio_record.json").read_text())
    assert [e["kind"] for e in record["events"] if e["kind"] in ("restore", "save")] == ["restore", "save"]
