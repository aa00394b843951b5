"""Corrupt and hostile inputs: only ckptio's own errors, never code execution, never a write outside.

The property tests mutate valid files at random (hypothesis); the named cases are hand-made attacks
and any input that ever broke a reader, kept as regressions. `tools/fuzz_readers.py` runs the
same properties for much longer.
"""

from __future__ import annotations

import json
import pickle
import struct
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptio import CheckpointError
from ckptio.errors import CheckpointCorruptError
from ckptio.engine.describe import inspect_path
from ckptio.formats.dcp import format as dcp_format
from ckptio.formats import pt as pt_format
from ckptio.formats.safetensors import sharded as safetensors_sharded
from ckptio.formats.safetensors.sharded import SafetensorsSource
from ckptio.engine.manifest import read_manifest


def _valid_shard(folder: Path) -> bytes:
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    (name,) = [n for n in safetensors_sharded.save(tensors, folder, rank=0, world_size=1) if n.endswith(".safetensors")]
    return (folder / name).read_bytes()


def _readers(folder: Path):
    target = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    return [
        lambda: safetensors_sharded.read_index(folder),
        lambda: safetensors_sharded.load(target, folder),
        lambda: SafetensorsSource(folder).read("a"),
        lambda: inspect_path(folder),
    ]


def _only_ckptio_errors(fns) -> None:
    for fn in fns:
        try:
            fn()
        except CheckpointError:
            pass  # the one error type a user may see, with a message naming the file


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("set"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
)


def _mutate(data: bytes, muts) -> bytes:
    buf = bytearray(data)
    for m in muts:
        if not buf:
            break
        if m[0] == "flip":
            buf[m[1] % len(buf)] ^= 1 << m[2]
        elif m[0] == "truncate":
            del buf[m[1] % len(buf):]
        else:
            i = m[1] % len(buf)
            buf[i:i + len(m[2])] = m[2]
    return bytes(buf)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=st.lists(mutation, min_size=1, max_size=4))
@example(muts=[("flip", 617, 0)])  # found by the fuzz run: a flipped key name made a reader raise KeyError
def test_mutated_safetensors_shards_give_only_ckptio_errors(tmp_path_factory, muts):
    folder = tmp_path_factory.mktemp("st")
    data = _valid_shard(folder)
    path = next(folder.glob("*.safetensors"))
    path.write_bytes(_mutate(data, muts))
    _only_ckptio_errors(_readers(folder))


def _header_file(folder: Path, header: dict | bytes, data: bytes = b"\0" * 16, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    (folder / "x.safetensors").write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


F32x4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
HOSTILE_HEADERS = {
    "absurd header length": dict(header={}, length=2**60),
    "offsets past the end": dict(header={"a": {**F32x4, "shape": [10**6], "data_offsets": [0, 4 * 10**6]}}),
    "overlapping tensors": dict(header={"a": F32x4, "b": {**F32x4, "data_offsets": [8, 24]}}, data=b"\0" * 24),
    "unknown dtype": dict(header={"a": {**F32x4, "dtype": "Q99"}}),
    "shape does not match bytes": dict(header={"a": {**F32x4, "shape": [5]}}),
    "negative shape": dict(header={"a": {**F32x4, "shape": [-4]}}),
    "duplicate keys": dict(header=b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                                  b'"a":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}}', data=b"\0" * 32),
    "broken shard metadata": dict(header={"__metadata__": {"ckptio_shards": "{not json"}, "a": F32x4}),
    "shard claims a huge tensor": dict(header={"__metadata__": {"ckptio_shards": json.dumps(
        {"a": {"shape": [10**12], "offsets": [0]}})}, "a": F32x4}),
    "shard offset outside": dict(header={"__metadata__": {"ckptio_shards": json.dumps(
        {"a": {"shape": [4], "offsets": [3]}})}, "a": F32x4}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_safetensors_headers_fail_before_any_large_allocation(tmp_path, case):
    _header_file(tmp_path, **HOSTILE_HEADERS[case])
    for fn in _readers(tmp_path)[:3]:
        with pytest.raises(CheckpointError, match="x.safetensors|cover"):
            fn()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=st.lists(mutation, min_size=1, max_size=4))
@example(muts=[("flip", 3927, 0)])  # found by the fuzz run: renamed attributes -> AttributeError deep in DCP
@example(muts=[("flip", 72, 0)])
def test_mutated_dcp_metadata_gives_only_ckptio_errors(tmp_path_factory, muts):
    folder = tmp_path_factory.mktemp("dcp")
    dcp_format.save({"w": torch.ones(3, 2), "lr": 0.1}, folder)
    meta = folder / ".metadata"
    meta.write_bytes(_mutate(meta.read_bytes(), muts))
    target = {"w": torch.zeros(3, 2), "lr": 0.0}
    _only_ckptio_errors([lambda: dcp_format.read_index(folder), lambda: dcp_format.load(target, folder)])


@pytest.mark.parametrize("payload", [
    pickle.dumps(__import__("os").system),
    b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.",
    b"not a pickle at all",
])
def test_hostile_pickles_are_refused(tmp_path, payload):
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        dcp_format.read_metadata(tmp_path)
    (tmp_path / "state.pt").write_bytes(payload)
    with pytest.raises(CheckpointError, match="state.pt"):
        pt_format.load(tmp_path / "state.pt")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                     max_size=6), max_leaves=20))
def test_random_manifests_give_only_ckptio_errors(tmp_path_factory, doc):
    folder = tmp_path_factory.mktemp("m")
    (folder / "manifest.json").write_text(json.dumps(doc))
    _only_ckptio_errors([lambda: read_manifest(folder)])


def test_fuzz_families_smoke():
    """A short run of every family of tools/fuzz_readers.py: nothing but right loads and clean errors."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_readers

    tally = fuzz_readers.run(list(fuzz_readers.FAMILIES), inputs=40, seed=7, verbose=True)
    assert all(t["other"] == 0 for t in tally.values()), tally
    assert all(t["clean"] > 0 for t in tally.values()), tally  # the attacks are really generated


def test_a_pt_file_whose_members_inflate_past_it_is_refused_before_torch_reads_it(tmp_path):
    """torch.load inflates a deflated member of a .pt to the size its header claims. A 0.4 MB state file whose
    tensor is 384 MiB of deflated zeros is refused by every .pt reader (a step directory's small states, a whole
    file) naming it, before anything is inflated; the same state stored as torch.save stores it loads."""
    import resource
    import zipfile

    from ckptio.formats import pt as pt_format
    from ckptio.storage.confined import Folder

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros((96 << 20) + 1)}, plain)  # one more element than 384 MiB: not a multiple of 16 MiB
    bomb = tmp_path / "dataloader.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            with src.open(info) as fin, dst.open(info.filename, "w", force_zip64=True) as fout:
                while chunk := fin.read(16 << 20):
                    fout.write(chunk)
    plain.unlink()
    assert bomb.stat().st_size < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointCorruptError, match=r"dataloader.pt.*would expand to"):
        pt_format.load_from(Folder(tmp_path), "dataloader.pt")
    with pytest.raises(CheckpointCorruptError, match=r"dataloader.pt.*would expand to"):
        pt_format.load(bomb)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: nothing was inflated
    torch.save({"w": torch.arange(4.0)}, tmp_path / "ok.pt")
    assert torch.equal(pt_format.load_from(Folder(tmp_path), "ok.pt")["w"], torch.arange(4.0))
