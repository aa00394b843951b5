"""Megatron's ``torch.save`` files read without Megatron and without running code from the file."""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import signal
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptio.errors import CheckpointCorruptError
from ckptio.formats import safe_pickle as megatron_pickle
from ckptio.storage.confined import Folder


def _load(path: Path):
    return megatron_pickle.load(Folder(path.parent), path.name, max_size=1 << 30)


def test_plain_classes_are_built_and_framework_classes_become_reported_placeholders(tmp_path, monkeypatch):
    # a stand-in for a Megatron enum, importable only while saving (as on the machine that trained)
    enums = types.ModuleType("megatron.core.transformer.enums")

    class AttnBackend(int):
        def __reduce__(self):
            return (AttnBackend, (int(self),))

    AttnBackend.__module__, AttnBackend.__qualname__ = enums.__name__, "AttnBackend"
    enums.AttnBackend = AttnBackend  # type: ignore[attr-defined]
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, enums.__name__, enums)
    args = argparse.Namespace(hidden_size=64, attention_backend=AttnBackend(5), exit_signal=signal.SIGTERM,
                              params_dtype=torch.bfloat16)
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {"args": args, "model": collections.OrderedDict(w=weights, t=weights[1:].t()),
           "rng": (np.random.get_state(), np.arange(5, dtype=np.uint32)), "iteration": 7}
    torch.save(obj, tmp_path / "model_optim_rng.pt")
    for name in list(sys.modules):
        if name.startswith("megatron"):
            monkeypatch.delitem(sys.modules, name)

    loaded, placeholders = _load(tmp_path / "model_optim_rng.pt")
    assert placeholders == ["megatron.core.transformer.enums.AttnBackend"]
    assert isinstance(loaded["args"], argparse.Namespace) and loaded["args"].hidden_size == 64
    assert isinstance(loaded["args"].attention_backend, megatron_pickle.Placeholder)
    assert loaded["args"].attention_backend.args == (5,)
    assert loaded["args"].exit_signal is signal.SIGTERM and loaded["args"].params_dtype is torch.bfloat16
    assert torch.equal(loaded["model"]["w"], weights) and torch.equal(loaded["model"]["t"], weights[1:].t())
    assert np.array_equal(loaded["rng"][1], np.arange(5, dtype=np.uint32))
    assert loaded["rng"][0][0] == "MT19937" and loaded["iteration"] == 7


def _archive(path: Path, payload: bytes, storages: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        for key, data in (storages or {}).items():
            zf.writestr(f"archive/data/{key}", data)
    return path


class _Run:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    bad = _archive(tmp_path / "evil.pt", pickle.dumps({"model": _Run(marker)}, protocol=2))
    with pytest.raises(CheckpointCorruptError, match=r"evil\.pt.*refusing to load the global (posix|os)\.system"):
        _load(bad)
    assert not marker.exists()


class _Storage:
    """Pickles as a persistent storage id, as torch.save writes it."""


class _Tensor:
    """Pickles as torch.save pickles a tensor, with the offset, sizes and strides given."""

    def __init__(self, offset: int, size: tuple, stride: tuple) -> None:
        self.a = (offset, size, stride)

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, (_Storage(), *self.a, False, collections.OrderedDict()))


def _tensor_pickle(offset: int, size: tuple, stride: tuple, numel: int) -> bytes:
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if isinstance(obj, _Storage) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"w": _Tensor(offset, size, stride)})
    return buf.getvalue()


@pytest.mark.parametrize("offset,size,stride,numel,data,match", [
    (0, (2, 2), (2, 1), 4, 16, None),  # well formed
    (2, (2, 2), (2, 1), 4, 16, "runs past its storage"),
    (0, (4, 4), (4, 1), 4, 16, "runs past its storage"),
    (0, (2, 2), (2, 1), 8, 16, "holds 16 bytes, expected 32"),
    (0, (2,), (-1,), 4, 16, "strides"),
])
def test_tensors_are_checked_against_their_storage(tmp_path, offset, size, stride, numel, data, match):
    path = _archive(tmp_path / "t.pt", _tensor_pickle(offset, size, stride, numel), {"0": bytes(range(data))})
    if match is None:
        loaded, _ = _load(path)
        assert loaded["w"].shape == (2, 2)
    else:
        with pytest.raises(CheckpointCorruptError, match=match):
            _load(path)


def test_not_an_archive_is_refused_with_the_file_name(tmp_path):
    (tmp_path / "old.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointCorruptError, match=r"old\.pt: not a torch.save archive"):
        _load(tmp_path / "old.pt")


def test_a_compressed_storage_cannot_inflate_past_the_file(tmp_path):
    """A 0.4 MB archive whose storage member is 384 MiB of deflated zeros (a zip bomb): refused from the member's
    declared size, before anything is inflated (torch.save never compresses, so its members fit in the file)."""
    import resource

    numel = (384 << 20) // 4
    path = tmp_path / "rng_state.pth"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", _tensor_pickle(0, (numel,), (1,), numel))
        with zf.open("archive/data/0", "w", force_zip64=True) as member:
            block = bytes(16 << 20)
            for _ in range(24):
                member.write(block)
    assert path.stat().st_size < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointCorruptError, match="rng_state.pth.*would expand to 402653184 bytes"):
        _load(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: nothing was inflated


def test_an_archive_whose_member_names_are_no_utf8_is_refused_by_name():
    """An input of the megatron_mixtral fuzz family: the central directory's UTF-8 flag set on a name that is not
    UTF-8 made zipfile raise a bare UnicodeDecodeError out of the reader."""
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(2)}}, buf)
    data = bytearray(buf.getvalue())
    at = data.rfind(b"PK\x01\x02")
    while at != -1:  # every central directory entry: flag bit 11 (UTF-8 names), first byte of the name 0xff
        data[at + 8:at + 10] = (int.from_bytes(data[at + 8:at + 10], "little") | 0x800).to_bytes(2, "little")
        data[at + 46] = 0xFF
        at = data.rfind(b"PK\x01\x02", 0, at)
    with pytest.raises(CheckpointCorruptError, match=r"bad\.pt: not a torch.save archive .*UnicodeDecodeError"):
        megatron_pickle.loads(bytes(data), "bad.pt")
