"""Both ways with the real NeMo AutoModel 0.7: its checkpoints resume in ckptio, ckptio's resume in AutoModel.

Every case runs ``tests/automodel_harness.py`` in an environment with ``nemo-automodel==0.7.0`` (installed
``--no-deps``, as its checkpoint component needs only torch, transformers at its exact pin, safetensors and
pyyaml) and ckptio from this checkout on ``PYTHONPATH``. The environment is built once per content of
:data:`PINS` under ``~/.cache/ckptio-automodel`` (``CKPTIO_AUTOMODEL_CACHE`` moves it); building it needs the
package index. A run interrupted by one checkpointer is resumed by the other, and must end bitwise equal
(every loss, the model, AdamW's state, the scheduler) to the same run left uninterrupted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from venvs import cached_venv, run

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).with_name("automodel_harness.py")
PINS = ["torch==2.13.0", "transformers==5.18.0", "peft==0.21.2", "safetensors", "pyyaml", "numpy", "psutil", "crc32c",
        "tqdm"]
NO_DEPS = ["nemo-automodel==0.7.0", "torchdata==0.11.0"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _environment() -> Path:
    def install(pip: list[str], env: Path) -> None:
        run(pip + PINS, timeout=1500)
        run(pip + ["--no-deps"] + NO_DEPS, timeout=1500)

    return cached_venv("ckptio-automodel", "CKPTIO_AUTOMODEL_CACHE", " ".join(PINS + NO_DEPS).encode(), install)


@pytest.fixture(scope="module")
def am_python() -> Path:
    return _environment()


def _run(python: Path, by: str, ckpt_dir: Path, out: Path, *, world: int = 1, fmt: str = "safetensors",
         stop_after: int | None = None, steps: int = 8, check_restore: bool = False, peft: bool = False,
         keep_latest: int | None = None, restore_from: Path | None = None, freeze: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    launch = [str(python)] if world == 1 else [str(python), "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc-per-node={world}"]
    cmd = launch + [str(HARNESS), "--by", by, "--dir", str(ckpt_dir), "--out", str(out), "--format", fmt,
                    "--steps", str(steps), "--ckpt-every", "4"]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    if check_restore:
        cmd += ["--check-restore"]
    if peft:
        cmd += ["--peft"]
    if keep_latest is not None:
        cmd += ["--keep-latest", str(keep_latest)]
    if restore_from is not None:
        cmd += ["--restore-from", str(restore_from)]
    if freeze:
        cmd += ["--freeze"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"{by} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return {"result": torch.load(out, weights_only=False), "log": done.stdout + done.stderr}


def _same(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ: {a['losses']} vs {b['losses']}"
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{what}: {k} differs"
    for p, state in a["optim"].items():
        for name, value in state.items():
            other = b["optim"][p][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (what, p, name)
    assert a["sched"] == b["sched"] and a["step"] == b["step"], what


@pytest.fixture(scope="module")
def straight(am_python, tmp_path_factory) -> dict:
    """The uninterrupted run, checkpointed by AutoModel, for each format and rank count used below."""
    root = tmp_path_factory.mktemp("straight")
    out = {}
    for fmt, world in (("safetensors", 1), ("torch_save", 1), ("safetensors", 2)):
        out[(fmt, world)] = _run(am_python, "automodel", root / f"{fmt}{world}", root / f"{fmt}{world}.pt",
                                 world=world, fmt=fmt)["result"]
    return out


@pytest.fixture(scope="module")
def interrupted(am_python, tmp_path_factory):
    """``interrupted(by, world, fmt, peft, into)``: a run of ``by`` on ``world`` ranks stopped after step 3, its
    checkpoint folder copied into ``into`` (links kept) and its result returned. Each distinct run is made once for
    the module; several tests resume the same one, each from its own copy."""
    made: dict[tuple, tuple[Path, dict]] = {}

    def get(by: str, world: int, fmt: str, peft: bool, into: Path) -> dict:
        key = (by, world, fmt, peft)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{by}{world}{fmt}{int(peft)}")
            made[key] = root / "ckpt", _run(am_python, by, root / "ckpt", root / "first.pt", world=world, fmt=fmt,
                                            stop_after=3, peft=peft)["result"]
        shutil.copytree(made[key][0], into, symlinks=True)
        return made[key][1]

    return get


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_an_automodel_checkpoint_resumes_in_ckptio_and_goes_on_as_automodel_would(am_python, straight, interrupted,
                                                                                  tmp_path, fmt):
    ckpt = tmp_path / "ckpt"
    first = interrupted("automodel", 1, fmt, False, ckpt)
    names = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert "epoch_0_step_3" in names and not (ckpt / "epoch_0_step_3" / "manifest.json").exists()
    second = _run(am_python, "ckptio", ckpt, tmp_path / "second.pt", fmt=fmt)  # auto-resume in the same folder
    assert "Loading checkpoint from" in second["log"] and "epoch_0_step_3" in second["log"]
    assert "resuming from an AutoModel checkpoint: no manifest, sizes and checksums not verified" in second["log"]
    merged = {**second["result"], "losses": {**first["losses"], **second["result"]["losses"]}}
    _same(merged, straight[(fmt, 1)], f"AutoModel -> ckptio ({fmt})")
    # restore(path) of AutoModel's step, from a run whose own folder is empty: the same continuation
    by_path = _run(am_python, "ckptio", tmp_path / "elsewhere", tmp_path / "by_path.pt", fmt=fmt,
                   restore_from=ckpt / "epoch_0_step_3")
    assert f"Loading checkpoint from {ckpt / 'epoch_0_step_3'}" in by_path["log"]
    _same({**by_path["result"], "losses": {**first["losses"], **by_path["result"]["losses"]}}, straight[(fmt, 1)],
          f"AutoModel -> ckptio by path ({fmt})")
    # retention (keep one of its own) runs on ckptio's steps and never on AutoModel's, which stays as it was
    third = _run(am_python, "ckptio", ckpt, tmp_path / "third.pt", fmt=fmt, steps=16, keep_latest=1)
    saves = 1 + third["log"].count("Saved checkpoint ")
    own = [p.name for p in ckpt.iterdir() if not p.is_symlink() and (p / "manifest.json").is_file()]
    assert third["log"].count("Saved checkpoint ") >= 2 and len(own) < saves, (own, saves)
    assert (ckpt / "epoch_0_step_3").is_dir() and not (ckpt / "epoch_0_step_3" / "manifest.json").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_a_ckptio_checkpoint_resumes_in_automodels_recipe(am_python, straight, interrupted, tmp_path, fmt):
    ckpt = tmp_path / "ckpt"
    first = interrupted("ckptio", 1, fmt, False, ckpt)
    step = ckpt / "epoch_0_step_3"
    assert (step / "manifest.json").is_file()
    # the seed's layout, plus ckptio's chunk index (a dot-file AutoModel's loader never opens)
    assert sorted(p.name for p in (step / "optim").iterdir()) == [".ckptio-chunks", ".metadata", "__0_0.distcp"]
    assert (step / "rng" / "rng_global_rank_0.pt").is_file() and (step / "step_scheduler.pt").is_file()
    assert (step / "dataloader" / "dataloader_dp_rank_0.pt").is_file()
    second = _run(am_python, "automodel", ckpt, tmp_path / "second.pt", fmt=fmt)  # AutoModel's own auto-resume
    assert f"Loading checkpoint from {step}" in second["log"]
    merged = {**second["result"], "losses": {**first["losses"], **second["result"]["losses"]}}
    _same(merged, straight[(fmt, 1)], f"ckptio -> AutoModel ({fmt})")


def test_two_ranks_both_ways(am_python, straight, interrupted, tmp_path):
    """FSDP2 on 2 gloo ranks: AutoModel's checkpoint resumes in ckptio and ckptio's in AutoModel."""
    a = tmp_path / "a"
    first = interrupted("automodel", 2, "safetensors", False, a)
    second = _run(am_python, "ckptio", a, tmp_path / "a2.pt", world=2)["result"]
    _same({**second, "losses": {**first["losses"], **second["losses"]}}, straight[("safetensors", 2)], "AM->ckptio 2")
    b = tmp_path / "b"
    first = interrupted("ckptio", 2, "safetensors", False, b)
    second = _run(am_python, "automodel", b, tmp_path / "b2.pt", world=2)["result"]
    _same({**second, "losses": {**first["losses"], **second["losses"]}}, straight[("safetensors", 2)], "ckptio->AM 2")


def _same_state(saved: dict, restored: dict, what: str) -> None:
    for k in saved["model"]:
        assert torch.equal(saved["model"][k], restored["model"][k]), f"{what}: {k} differs"
    for p, state in saved["optim"].items():
        for name, value in state.items():
            assert torch.equal(value, restored["optim"][p][name]), (what, p, name)
    assert saved["sched"] == restored["sched"], what


# peft on one rank both sides is left out: the adapter and its optimizer state cross the same way in 2 -> 1 and 1 -> 2
@pytest.mark.parametrize("saved_on,restored_on,peft", [(2, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)])
@pytest.mark.parametrize("writer,reader", [("automodel", "ckptio"), ("ckptio", "automodel")])
def test_another_number_of_ranks_gets_the_same_state(am_python, interrupted, tmp_path, saved_on, restored_on, peft,
                                                    writer, reader):
    """A checkpoint saved on 1 or 2 ranks by one checkpointer restores on the other rank count through the other
    to the same model, AdamW state and scheduler (AutoModel's side through Checkpointer.load_model/load_optimizer:
    its recipe keeps the data position per DP rank and cannot resume on another number of ranks).

    With ``peft``: LoRA on q/v, AutoModel's own LinearLoRA on its side and Hugging Face peft on ckptio's (what
    each user has); the adapter folder and the optimizer's state of the adapter weights cross both ways."""
    ckpt = tmp_path / "ckpt"
    saved = interrupted(writer, saved_on, "safetensors", peft, ckpt)
    if peft:
        model = ckpt / "epoch_0_step_3" / "model"
        assert sorted(p.name for p in model.iterdir() if p.suffix == ".safetensors") == ["adapter_model.safetensors"]
    restored = _run(am_python, reader, ckpt, tmp_path / "restored.pt", world=restored_on, check_restore=True,
                    peft=peft)
    assert any("lora_A" in k for k in saved["optim"]) == peft
    _same_state(saved, restored["result"], f"{writer} on {saved_on} -> {reader} on {restored_on}, peft={peft}")


def test_automodel_loads_a_frozen_fine_tunes_step_whose_frozen_files_are_shared(am_python, tmp_path):
    """ckptio hard-links the files of unchanged frozen tensors from save to save (issue 47): AutoModel's
    ``load_model`` and ``load_optimizer`` read such a step's ``model/`` and ``optim/`` as any other."""
    ckpt = tmp_path / "ckpt"
    # saves at steps 3, 7 and 11: the second save writes a second copy of the frozen files (two kept steps never
    # share their only copy, issue 67), the third links them
    saved = _run(am_python, "ckptio", ckpt, tmp_path / "saved.pt", stop_after=11, steps=12, freeze=True)["result"]
    model = ckpt / "epoch_0_step_11" / "model"
    linked = [p.name for p in model.glob("*.safetensors") if p.stat().st_nlink == 2]
    assert linked and linked != sorted(p.name for p in model.glob("*.safetensors")), "frozen files only are shared"
    restored = _run(am_python, "automodel", ckpt, tmp_path / "restored.pt", check_restore=True, steps=12,
                    freeze=True)["result"]
    _same_state(saved, restored, "ckptio (frozen, shared files) -> automodel")
