"""Retention and pointers: property-based sequences of saves, resumes, crashes and failures at every point, with
failure tolerance on (``failed_saves_allowed``, ``sync_saves_may_fail``: a failed save lets the run go on) or off."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptio import CheckpointConfig, CheckpointManager, committed_checkpoints
from ckptio import _faults
from ckptio.engine.layout import TMP_PREFIX, resolve_restore_path, scan
from ckptio.storage import read_pointer


class Crash(BaseException):
    """Stands for the process dying at a fault point."""


class Box:
    def __init__(self) -> None:
        self.v = 0

    def state_dict(self) -> dict:
        return {"v": self.v}

    def load_state_dict(self, sd: dict) -> None:
        self.v = sd["v"]


TOLERANCE = {True: dict(failed_saves_allowed=20, sync_saves_may_fail=True), False: dict(failed_saves_allowed=0)}
"""Failure tolerance on (more failures allowed in a row than a sequence has saves) and off."""


def manager(root: Path, tolerant: bool = False, **cfg) -> tuple[CheckpointManager, Box]:
    box = Box()
    config = CheckpointConfig(checkpoint_dir=str(root), monitor="val_loss", mode="min", **TOLERANCE[tolerant], **cfg)
    return CheckpointManager(config, extra_states={"box": box}, rng=False), box


op = st.one_of(
    st.tuples(st.just("save"), st.floats(0, 10, allow_nan=False)),
    st.tuples(st.just("crash"), st.floats(0, 10, allow_nan=False), st.sampled_from(_faults.POINTS)),
    st.tuples(st.just("fail"), st.floats(0, 10, allow_nan=False), st.sampled_from(_faults.POINTS)),
    st.tuples(st.just("resume")),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=12), k=st.integers(1, 3), keep_latest=st.sampled_from([None, 1, 2]),
       tolerant=st.booleans())
def test_invariants_hold_through_saves_resumes_and_crashes(ops, k, keep_latest, tolerant):
    """``crash``: the process dies at a fault point; ``fail``: the storage fails there (no space left), which with
    tolerance on the run goes on from (the save said failed) and with it off ends the run (a new one resumes)."""
    root = Path(tempfile.mkdtemp(prefix="ckptio-retention-"))
    try:
        mgr, box = manager(root, tolerant, save_top_k=k, keep_latest=keep_latest)
        step = 0
        ever: dict[str, float] = {}  # every checkpoint that was committed, with its metric
        for entry in ops:
            kind = entry[0]
            if kind == "resume":
                mgr, box = manager(root, tolerant, save_top_k=k, keep_latest=keep_latest)
                info = mgr.restore()
                newest = max(committed_checkpoints(root), key=lambda e: e.step, default=None)
                assert (info is None) == (newest is None)
                if info is not None:
                    assert info.path.name == newest.name and box.v == info.step
                continue
            step += 1
            box.v = step
            metric = entry[1]
            name = f"epoch_0_step_{step}"
            crashed_at = None
            seen: list[str] = []
            if kind in ("crash", "fail"):
                def hook(point: str, target: str = entry[2], crash: bool = kind == "crash") -> None:
                    seen.append(point)
                    if point == target:
                        raise Crash(point) if crash else OSError(errno.ENOSPC, f"No space left ({point})")
                _faults.set_hook(hook)
                stopped = kind == "crash"
                try:
                    mgr.save(step=step, metrics={"val_loss": metric})
                except Crash as c:
                    crashed_at = str(c)
                except OSError as e:  # tolerance off: the failure ends the run
                    assert not tolerant, f"a failure at {entry[2]} was raised with failure tolerance on: {e}"
                    crashed_at, stopped = entry[2], True
                finally:
                    _faults.set_hook(None)
                if kind == "fail" and entry[2] in seen:
                    crashed_at = entry[2]  # failed (or failed past its commit): no clean save to check pointers by
                if stopped:
                    mgr, box = manager(root, tolerant, save_top_k=k, keep_latest=keep_latest)  # a new run
                    mgr.restore()
            else:
                mgr.save(step=step, metrics={"val_loss": metric})
            # committed once the rename happened, which is just before the "commit.before_pointer" point
            # (a crash can also strike earlier, e.g. while the save sweeps leftovers of an earlier crash)
            if crashed_at is None or "commit.before_pointer" in seen:
                ever[name] = metric
            _check(root, ever, k, keep_latest, after_clean_save=crashed_at is None)
    finally:
        _faults.set_hook(None)
        shutil.rmtree(root, ignore_errors=True)


def _check(root: Path, ever: dict[str, float], k: int, keep_latest: int | None, after_clean_save: bool) -> None:
    committed = committed_checkpoints(root)
    names = {e.name for e in committed}
    # nothing uncommitted is ever listed as a checkpoint, or chosen for a resume
    assert all(not n.startswith(".") for n in names)
    chosen = resolve_restore_path(root, None)
    if ever:
        newest = max(ever, key=lambda n: int(n.rsplit("_", 1)[1]))
        best = min(ever.items(), key=lambda kv: (kv[1], -int(kv[0].rsplit("_", 1)[1])))[0]
        assert newest in names, "the latest committed checkpoint was deleted"
        assert best in names, "the best checkpoint was deleted"
        assert chosen is not None and chosen.name == newest
        assert names <= set(ever), "a checkpoint appeared that was never committed"
        if after_clean_save:
            assert read_pointer(root, "LATEST") == newest
            assert read_pointer(root, "BEST") == best
            limit = k + (keep_latest or 0) + 3  # + latest, best, resumed-from
            assert len(names) <= limit
    else:
        assert chosen is None


def test_top_k_rotation_keeps_best_latest_and_resumed_from(tmp_path):
    mgr, _ = manager(tmp_path, save_top_k=2)
    losses = [5.0, 1.0, 4.0, 3.0, 6.0, 2.0, 7.0]
    for step, loss in enumerate(losses, start=1):
        mgr.save(step=step, metrics={"val_loss": loss})
    kept = sorted(e.step for e in committed_checkpoints(tmp_path))
    assert kept == [2, 6, 7]  # top-2 (1.0, 2.0) plus the latest
    assert read_pointer(tmp_path, "BEST") == "epoch_0_step_2"
    # a resumed run protects what it resumed from, and rotation keeps working after the resume
    mgr.close()  # the first run ends
    resumed, _ = manager(tmp_path, save_top_k=2, restore_from="epoch_0_step_6")
    resumed.restore()
    for step, loss in [(8, 9.0), (9, 0.5), (10, 0.7)]:
        resumed.save(step=step, metrics={"val_loss": loss})
    kept = sorted(e.step for e in committed_checkpoints(tmp_path))
    assert kept == [6, 9, 10]
    assert read_pointer(tmp_path, "BEST") == "epoch_0_step_9"
    assert resolve_restore_path(tmp_path, "BEST").name == "epoch_0_step_9"


def test_milestones_and_mode_max(tmp_path):
    box = Box()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), save_top_k=1, monitor="acc", mode="max",
                                             keep_every_n_steps=3), extra_states={"b": box}, rng=False)
    for step, acc in enumerate([0.1, 0.9, 0.2, 0.3, 0.4, 0.5, 0.6], start=1):
        mgr.save(step=step, metrics={"acc": acc})
    assert sorted(e.step for e in committed_checkpoints(tmp_path)) == [2, 3, 6, 7]


def test_uncommitted_directories_are_never_pruned(tmp_path):
    mgr, _ = manager(tmp_path, save_top_k=1)
    mgr.save(step=1, metrics={"val_loss": 1.0})
    inflight = tmp_path / f"{TMP_PREFIX}epoch_0_step_2-0000"
    inflight.mkdir()
    (tmp_path / "not_a_checkpoint").mkdir()
    mgr.save(step=3, metrics={"val_loss": 2.0})
    assert (tmp_path / "not_a_checkpoint").is_dir()
    assert {e.name for e in scan(tmp_path)} >= {"epoch_0_step_1", "epoch_0_step_3", "not_a_checkpoint"}


def _two_rank_saves(root: str) -> dict:
    import torch.distributed as dist

    mgr, box = manager(Path(root), save_top_k=1)
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 4.0)]:
        box.v = step
        mgr.save(step=step, metrics={"val_loss": loss}, counters={"consumed_samples": step * 16})
    again, box2 = manager(Path(root), save_top_k=1, restore_from="BEST")
    info = again.restore()
    return {"rank": dist.get_rank(), "step": info.step, "v": box2.v, "consumed": info.counters["consumed_samples"]}


@pytest.mark.slow
def test_pointers_and_retention_on_two_ranks(tmp_path):
    from distributed import run_ranks

    results = run_ranks(2, _two_rank_saves, root=str(tmp_path))
    assert [r["step"] for r in results] == [2, 2] and [r["v"] for r in results] == [2, 2]
    assert results[0]["consumed"] == 32
    assert read_pointer(tmp_path, "LATEST") == "epoch_0_step_4" and read_pointer(tmp_path, "BEST") == "epoch_0_step_2"
    assert sorted(e.step for e in committed_checkpoints(tmp_path)) == [2, 4]


def test_prune_and_list_from_the_command_line(tmp_path):
    import json

    from cli_here import ckptio_here

    mgr, _ = manager(tmp_path)
    for step, loss in enumerate([3.0, 1.0, 2.0, 5.0, 4.0], start=1):
        mgr.save(step=step, metrics={"val_loss": loss})
    mgr.close()
    rows = json.loads(ckptio_here("list", str(tmp_path), "--json").stdout)
    flags = {r["name"]: (r["latest"], r["best"], r["protected"]) for r in rows["checkpoints"]}
    assert flags["epoch_0_step_2"] == (False, True, True) and flags["epoch_0_step_5"] == (True, False, True)
    dry = ckptio_here("prune", str(tmp_path), "--save-top-k", "1", "--monitor", "val_loss",
                      "--dry-run")
    assert dry.returncode == 0 and "would delete epoch_0_step_1" in dry.stdout
    assert len(committed_checkpoints(tmp_path)) == 5
    real = ckptio_here("prune", str(tmp_path), "--save-top-k", "1", "--monitor", "val_loss")
    assert real.returncode == 0, real.stderr
    assert sorted(e.step for e in committed_checkpoints(tmp_path)) == [2, 5]
    bad = ckptio_here("prune", str(tmp_path))
    assert bad.returncode == 2 and "at least one rule" in bad.stderr


def test_nemo_style_names_are_written_and_parsed_back(tmp_path):
    box = Box()
    cfg = CheckpointConfig(checkpoint_dir=str(tmp_path), name_template="megatron_gpt--{val_loss:.3f}-{step}-{consumed_samples}")
    mgr = CheckpointManager(cfg, extra_states={"b": box}, rng=False)
    mgr.save(step=1000, metrics={"val_loss": 0.4321}, counters={"consumed_samples": 32000.0, "rl_step": 7})
    mgr.close()
    name = "megatron_gpt--val_loss=0.432-step=1000-consumed_samples=32000.0"
    assert (tmp_path / name / "manifest.json").is_file()
    info = CheckpointManager(cfg, extra_states={"b": Box()}, rng=False).restore()
    assert info.path.name == name and info.step == 1000
    assert info.name_fields == {"val_loss": 0.432, "step": 1000, "consumed_samples": 32000.0}
    assert info.metrics == {"val_loss": 0.4321}  # the manifest is the source of truth (unrounded)
    assert info.counters == {"consumed_samples": 32000.0, "rl_step": 7}


def _automodel_step(root: Path, name: str) -> None:
    """A step directory as NeMo AutoModel writes it (torch DCP's own files, no manifest): adopted, never deleted."""
    import torch
    import torch.distributed.checkpoint as torch_dcp

    torch_dcp.save({"w": torch.ones(2)}, storage_writer=torch_dcp.FileSystemWriter(str(root / name / "model")),
                   no_dist=True)


def test_the_step_just_written_and_the_newest_complete_stay_whatever_lies_around(tmp_path):
    """A run resumed from an older step (restore_from) writes a step below the newest one on disk: with
    keep_latest=1 neither the step just written nor the newest complete one is deleted. A step with a bad manifest,
    a torn step, a ckptio step that lost its manifest and an adopted AutoModel step lie around: none is counted,
    ranked or deleted."""
    root = tmp_path / "ck"
    mgr, box = manager(root)
    with mgr:
        for step in (1, 2, 4, 5, 6, 7):
            box.v = step
            mgr.save(step=step, metrics={"val_loss": float(step)})
    (root / "epoch_0_step_7" / "manifest.json").unlink()  # lost its manifest: damaged, ckptio's own
    (root / "epoch_0_step_4" / "manifest.json").write_text("{not json")  # a bad manifest
    torn = root / "epoch_0_step_5" / "box.pt"
    torn.write_bytes(torn.read_bytes()[:-1])  # one file short: torn
    _automodel_step(root, "epoch_0_step_9")
    before = {e.name: (e.committed, e.adopted) for e in scan(root)}
    assert before == {"epoch_0_step_1": (True, False), "epoch_0_step_2": (True, False),
                      "epoch_0_step_4": (False, False),
                      "epoch_0_step_5": (False, False), "epoch_0_step_6": (True, False),
                      "epoch_0_step_7": (False, False),
                      "epoch_0_step_9": (True, True)}
    mgr, box = manager(root, keep_latest=1, restore_from=str(root / "epoch_0_step_1"))
    with mgr:
        assert mgr.restore().step == 1
        box.v = 3
        mgr.save(step=3, metrics={"val_loss": 3.0})
    left = {p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")}
    # step 3 (just written) and step 6 (the newest complete) stay, and step 1 (this run resumed from it); step 2
    # goes; the torn, the manifest-less and the adopted steps are untouched
    assert left == {"epoch_0_step_1", "epoch_0_step_3", "epoch_0_step_4", "epoch_0_step_5", "epoch_0_step_6",
                    "epoch_0_step_7", "epoch_0_step_9"}, left
    assert read_pointer(root, "LATEST") == "epoch_0_step_3"


def test_a_checkpoint_dir_copied_with_its_pointers_followed_resumes_and_saves_on(tmp_path, caplog):
    """Issue 46: ``shutil.copytree`` (and ``aws s3 sync``) follow links, so ``LATEST`` and ``BEST`` arrive as folders;
    every later ``save()`` raised "cannot update pointer ... Is a directory" after committing its step. Now the copy
    resumes, is said once by name, and the first save moves the folders aside (nothing lost) and links again."""
    import shutil

    import torch

    from ckptio import CheckpointConfig, CheckpointManager

    model = torch.nn.Linear(3, 2)
    cfg = dict(model_save_format="torch_save", save_top_k=2, monitor="val_loss")
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "a"), **cfg), model=model, rng=False) as mgr:
        for step in (1, 2):
            mgr.save(step=step, metrics={"val_loss": 1.0 / step})
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # symlinks=False: LATEST and BEST become folders
    assert (tmp_path / "b" / "LATEST").is_dir() and not (tmp_path / "b" / "LATEST").is_symlink()
    with caplog.at_level("WARNING", logger="ckptio"):
        with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "b"), **cfg), model=model,
                               rng=False) as mgr:
            assert mgr.restore().step == 2
            for step in (3, 4):
                mgr.save(step=step, metrics={"val_loss": 1.0 / step})
    root = tmp_path / "b"
    assert (root / "LATEST").is_symlink() and os.readlink(root / "LATEST") == "epoch_0_step_4"
    assert (root / "BEST").is_symlink() and os.readlink(root / "BEST") == "epoch_0_step_4"
    aside = sorted(p.name for p in root.iterdir() if ".copied-" in p.name)
    assert [n.split(".copied-")[0] for n in aside] == [".BEST", ".LATEST"]  # kept, hidden, never swept
    assert all((root / n / "manifest.json").exists() or any((root / n).iterdir()) for n in aside)
    assert caplog.text.count("a folder, not a link") == 4  # each pointer: once at the first look, once moved
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "BEST", "LATEST", "epoch_0_step_2", "epoch_0_step_3", "epoch_0_step_4"]  # 2: the one resumed from
