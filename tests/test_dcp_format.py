"""Our DCP folders are plain DCP; hostile DCP metadata and values are refused without running code."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptio import CheckpointConfig, CheckpointCorruptError, CheckpointManager
from ckptio.formats.dcp import format as dcp_format


def _saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path), model_save_format="torch_save"),
                            model=model, optimizer=opt, rng=False)
    return model, mgr.save(step=1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_reads_our_model_and_optimizer_folders(tmp_path):
    model, step_dir = _saved(tmp_path)
    # the layout other tools lay out (one __R_0.distcp per rank), though io_threads=2 (automatic for 1 rank on
    # this machine) writes that file as two regions at once; beside it, ckptio's chunk index of the folder
    for folder in ("model", "optim"):
        assert sorted(p.name for p in (step_dir / folder).iterdir()) == [".ckptio-chunks", ".metadata", "__0_0.distcp"]
    target = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}
    dcp.load(target, checkpoint_id=str(step_dir / "model"))  # torch alone, no ckptio reader
    assert torch.equal(target["weight"], model.weight.detach()) and torch.equal(target["bias"], model.bias.detach())
    md = dcp.FileSystemReader(str(step_dir / "optim")).read_metadata()
    assert "optim.state.weight.exp_avg" in md.state_dict_metadata


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_hostile_metadata_pickle_is_refused(tmp_path, monkeypatch):
    _model, step_dir = _saved(tmp_path)
    monkeypatch.chdir(tmp_path)
    (step_dir / "model" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata.*posix.system|\.metadata.*os.system"):
        dcp_format.read_metadata(step_dir / "model")
    assert not (tmp_path / "PWNED").exists()


def test_hostile_value_in_dcp_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "evil"
    with pytest.warns(UserWarning):
        dcp.save({"x": torch.ones(2), "payload": _Boom()}, checkpoint_id=str(folder))
    target = {"x": torch.zeros(2), "payload": None}
    with pytest.raises(CheckpointCorruptError, match=r"evil.*'payload' is not a plain value"):
        dcp_format.load(target, folder)
    assert not (tmp_path / "PWNED").exists()


def test_a_numpy_rng_state_value_is_read_and_a_frameworks_class_is_refused_by_name(tmp_path):
    """Megatron-Core's torch_dist saves ``rng_state`` as a DCP value holding numpy's RNG state, which
    ``torch.load(weights_only=True)`` refuses; ckptio's restricted unpickler builds it. A framework's class is
    refused by name. Read in a fresh process: importing megatron.core (or another test's import) allow-lists
    classes for ``weights_only`` in this one."""
    import subprocess
    import sys

    import numpy as np

    enums = pytest.importorskip("megatron.core.enums")
    np.random.seed(5)
    dcp.save({"x": torch.ones(2), "rng_state": {"np": np.random.get_state()}}, checkpoint_id=str(tmp_path / "ok"))
    with pytest.warns(UserWarning):
        dcp.save({"x": torch.ones(2), "args": enums.ModelType.encoder_or_decoder},
                 checkpoint_id=str(tmp_path / "framework"))
    probe = """if True:
        import sys, numpy as np
        from ckptio import CheckpointCorruptError
        from ckptio.formats.dcp.format import load_all
        got = load_all(sys.argv[1] + "/ok")["rng_state"]["np"]
        np.random.seed(5)
        want = np.random.get_state()
        assert got[0] == want[0] and (got[1] == want[1]).all() and got[2:] == want[2:], got
        try:
            load_all(sys.argv[1] + "/framework")
        except CheckpointCorruptError as exc:
            print(exc)
        """
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "framework" in out.stdout and "'args' holds objects of megatron.core.enums.ModelType" in out.stdout, out.stdout
