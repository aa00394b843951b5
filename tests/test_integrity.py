"""Checksums written with the bytes, `ckptio verify`, fallback past corruption, locks, disk-full saves."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointError, CheckpointManager, committed_checkpoints
from ckptio.storage.checksum import file_checksum
from ckptio.storage.lock import CheckpointDirLocked
from cli_here import ckptio_here



def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def _save(root: Path, fmt: str, steps=(1, 2), **cfg) -> torch.nn.Module:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, **cfg),
                           model=model, optimizer=opt) as mgr:
        for step in steps:
            with torch.no_grad():
                model[0].weight.fill_(step)
            mgr.save(step=step)
    return model


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_every_file_has_the_checksum_of_its_bytes(tmp_path, fmt):
    _save(tmp_path, fmt, steps=(1,))
    step_dir = tmp_path / "epoch_0_step_1"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert set(manifest["checksums"]) == set(manifest["files"]) and manifest["files"]
    for rel, digest in manifest["checksums"].items():
        assert digest.startswith("crc32c:") and file_checksum(step_dir / rel) == digest, rel
    out = ckptio_here("verify", tmp_path)
    assert out.returncode == 0 and "OK" in out.stdout


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_flipped_bit_is_reported_and_resume_falls_back(tmp_path, fmt):
    _save(tmp_path, fmt)
    victim = next((tmp_path / "epoch_0_step_2" / "model").glob("*.safetensors" if fmt == "safetensors" else "*.distcp"))
    data = bytearray(victim.read_bytes())
    data[data.rindex(struct.pack("<f", 2.0)) + 1] ^= 0x01  # one bit of a step-2 weight: same size, still parses
    victim.write_bytes(bytes(data))
    out = ckptio_here("verify", tmp_path / "epoch_0_step_2")
    assert out.returncode == 1 and victim.name in out.stdout and "checksum" in out.stdout
    model = _mlp()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), model_save_format=fmt,
                                             verify="full"), model=model, rng=False)
    info = mgr.restore()
    assert info.step == 1 and torch.all(model[0].weight == 1)
    with pytest.raises(CheckpointError, match="corrupted"):
        CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), restore_from="epoch_0_step_2",
                                           verify="full"), model=_mlp(), rng=False).restore()


def test_missing_file_is_reported(tmp_path):
    _save(tmp_path, "safetensors")
    victim = sorted((tmp_path / "epoch_0_step_2" / "optim").iterdir())[0]
    victim.unlink()
    out = ckptio_here("verify", tmp_path, "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 1 and not report["ok"]
    assert any(f"{victim.name}: missing" in line for line in report["checkpoints"][str(tmp_path / "epoch_0_step_2")])


_HOLDER = textwrap.dedent("""
    import sys, time
    from ckptio import CheckpointConfig, CheckpointManager
    class S:
        def state_dict(self): return {"a": 1}
        def load_state_dict(self, sd): pass
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1]), extra_states={"s": S()}, rng=False)
    mgr.save(step=1)
    print("saved", flush=True)
    time.sleep(120)
""")


def test_second_job_on_the_same_folder_gets_a_clear_error(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        for line in holder.stdout:
            if line.strip() == "saved":
                break
        mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), rng=False,
                                extra_states={"s": _Tiny()})
        with pytest.raises(CheckpointDirLocked, match=rf"in use by pid {holder.pid}"):
            mgr.save(step=2)
        assert [e.step for e in committed_checkpoints(tmp_path)] == [1]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), rng=False,
                      extra_states={"s": _Tiny()}).save(step=3)  # the kernel dropped the dead job's lock


class _Tiny:
    def state_dict(self):
        return {"a": 1}

    def load_state_dict(self, sd):
        pass


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from ckptio import CheckpointConfig, CheckpointManager, CheckpointError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit, write() fails with EFBIG instead
    torch.manual_seed(0)
    layers = int(sys.argv[3])  # with two, each of the io_threads files is too large: both writer threads fail
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(layers)))
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1], model_save_format=sys.argv[2]),
                            model=model, rng=False)
    mgr.save(step=1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the next model file cannot fit
    with torch.no_grad():
        model[0].weight.fill_(2)
    codes = set()
    for step in range(2, 10):  # which writer thread fails first varies: a few tries meet both orders
        try:
            mgr.save(step=step)
        except CheckpointError as exc:
            print("ERROR:", exc)
            codes.add(3)
        except OSError as exc:
            print("OSERROR:", exc)
            codes.add(4)
        else:
            codes.add(0)
    sys.exit(max(codes))
""")


def _one_rank_runs_out_of_space(root: str, fmt: str) -> tuple[int, list[str], int, bool]:
    import resource

    import torch.distributed as dist
    from toy import fsdp_mlp

    rank = dist.get_rank()
    model, opt = fsdp_mlp(512, 2)
    cfg = CheckpointConfig(checkpoint_dir=root, model_save_format=fmt)
    failures = 0
    with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as mgr:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        saved = [p.full_tensor().clone() for p in model.parameters()]
        mgr.save(step=1)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:  # rank 1's shards (0.5 MiB a layer) no longer fit; which writer thread fails first varies
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
        for step in (2, 3, 4, 5):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            try:
                mgr.save(step=step)
            except (CheckpointError, OSError) as exc:  # rank 1 its own OSError, rank 0 a CheckpointError naming it
                assert "File too large" in str(exc) and ".tmp-epoch_0_step_" in str(exc), exc
                failures += 1
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    dist.barrier()
    left = sorted(p.name for p in Path(root).iterdir() if not p.name.startswith((".ckptio", "LATEST")))
    fresh, fresh_opt = fsdp_mlp(512, 2, seed=1)
    info = CheckpointManager(cfg, model=fresh, optimizer=fresh_opt, rng=False).restore()
    assert info is not None
    return failures, left, info.step, all(torch.equal(a, p.full_tensor()) for a, p in zip(saved, fresh.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_a_save_one_rank_cannot_write_fails_on_every_rank_and_commits_nothing(tmp_path, fmt):
    from distributed import run_ranks

    result = run_ranks(2, _one_rank_runs_out_of_space, root=str(tmp_path), fmt=fmt)
    assert result == [(4, ["epoch_0_step_1"], 1, True)] * 2


# the quick loop (-m "not slow") takes each format once, and each number of layers once
@pytest.mark.parametrize("layers, fmt", [
    pytest.param(layers, fmt, marks=[pytest.mark.slow] if (layers + j) % 2 == 0 else [])
    for layers in (1, 2) for j, fmt in enumerate(["safetensors", "torch_save"])])
def test_save_that_runs_out_of_space_fails_cleanly(tmp_path, fmt, layers):
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path), fmt, str(layers)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode in (3, 4), out.stdout + out.stderr
    assert "File too large" in out.stdout or "EFBIG" in out.stdout or "Errno 27" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr  # no writer thread died with its own traceback
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".ckptio")) == ["LATEST", "epoch_0_step_1"]
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(layers)))
    info = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), model_save_format=fmt,
                                              verify="full"), model=model, rng=False).restore()
    assert info.step == 1 and not torch.all(model[0].weight == 2)
