"""The chunk index of a sharded safetensors folder: written by the save, used by every reader, fail closed.

The index must say exactly what the shard headers say (so a plan made from it reads the same bytes), and an
index that is damaged, hostile or from another save must be refused, naming the file, before or while any
byte it points at is read. The 2-rank case (an index rank 0 writes for every rank) is checked in
``test_resharding.py`` on a real FSDP save.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptio import CheckpointCorruptError, CheckpointError
from ckptio.formats.safetensors import chunk_index, sharded as safetensors_sharded
from ckptio.formats.safetensors.sharded import SafetensorsSource, _scan
from ckptio.storage.checksum import bytes_checksum

INDEX = chunk_index.INDEX_NAME


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(6, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "c": torch.tensor(3.5), "d": torch.zeros(0, 3), "e": torch.arange(12, dtype=torch.int64).reshape(3, 4)}


def _saved(folder: Path, threads: int = 2) -> dict[str, torch.Tensor]:
    tensors = _tensors()
    written = safetensors_sharded.save(tensors, folder, rank=0, world_size=1, threads=threads)
    assert INDEX in written and (folder / INDEX).is_file()
    assert len([n for n in written if n.endswith(".safetensors")]) == threads
    return tensors


def _as_headers_say(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    (to / INDEX).unlink()
    return to


def _same_plan(folder: Path, plain: Path) -> None:
    indexed, infos = _scan(folder)
    headers, header_infos = _scan(plain)
    assert infos == header_infos
    assert set(indexed) == set(headers)
    for key, table in indexed.items():
        assert isinstance(table, chunk_index.ChunkTable)
        from_index = sorted((p.file, p.offsets, p.shape) for p in table)
        assert from_index == sorted((p.file, p.offsets, p.shape) for p in headers[key]), key


def test_the_index_says_what_the_headers_say_and_loads_the_same_bytes(tmp_path):
    tensors = _saved(tmp_path / "s")
    plain = _as_headers_say(tmp_path / "s", tmp_path / "plain")
    _same_plan(tmp_path / "s", plain)
    for folder in (tmp_path / "s", plain):
        target = {k: torch.full_like(v, 7) for k, v in tensors.items()}
        safetensors_sharded.load(target, folder)
        assert all(torch.equal(target[k], v) for k, v in tensors.items())
        source = SafetensorsSource(folder)
        assert all(torch.equal(source.read(k), v) for k, v in tensors.items())
        source.close()


def test_a_part_of_a_tensor_reads_only_the_pieces_it_overlaps(tmp_path):
    """A rank planning from the index never opens a shard it does not need: a damaged header there does not stop
    it (a restore with verify on still checks every file; here only the plan is under test)."""
    tensors = {f"w{i}": torch.arange(64, dtype=torch.float32).reshape(16, 4) + i for i in range(4)}
    folder = tmp_path / "s"
    safetensors_sharded.save(tensors, folder, rank=0, world_size=1, threads=4)  # w0..w3, one file each
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 4
    chunks, _ = _scan(folder)
    untouched = next(f for f in files if chunks["w3"].overlapping((0, 0), (16, 4))[0].file != f.name)
    untouched.write_bytes(b"\xff" * 64)
    target = {"w3": torch.zeros(16, 4)}
    safetensors_sharded.load_files(target, folder, None, strict=False)
    assert torch.equal(target["w3"], tensors["w3"])
    with pytest.raises(CheckpointCorruptError, match=untouched.name):
        safetensors_sharded.load({k: torch.zeros(16, 4) for k in tensors}, folder)


def _rewrite(folder: Path, edit) -> None:
    """Change the index with ``edit`` (on ``{"files", "tensors": {key: [dtype, shape, rows]}}``) and re-seal it
    with a valid checksum: what an attacker (or a bug) that knows the format would produce."""
    data = (folder / INDEX).read_bytes()
    first, _, body = data.partition(b"\n")
    head = json.loads(first)
    meta = json.loads(body[:head["meta_bytes"]])
    table = np.frombuffer(body, dtype="<i8", offset=head["meta_bytes"]).tolist()
    for key, (dtype, shape, at, count) in list(meta["tensors"].items()):
        width = 3 + 2 * len(shape)
        meta["tensors"][key] = [dtype, shape, [table[at + i * width:at + (i + 1) * width] for i in range(count)]]
    edit(meta)
    flat: list = []
    for key, entry in meta["tensors"].items():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list):
            rows = entry[2]
            meta["tensors"][key] = [entry[0], entry[1], len(flat), len(rows)]
            for row in rows:
                flat.extend(row)
    raw = json.dumps(meta).encode()
    raw += b" " * (-len(raw) % 8)
    try:
        new = raw + np.asarray(flat, dtype="<i8").tobytes()
    except (OverflowError, TypeError, ValueError):  # a number the int64 table cannot hold: write it as a float
        new = raw + np.asarray(flat, dtype="<f8").tobytes()
    head.update(meta_bytes=len(raw), body_bytes=len(new), body_crc32c=bytes_checksum(new))
    (folder / INDEX).write_bytes(json.dumps(head).encode() + b"\n" + new)


def _first_file_of(body: dict, key: str) -> int:
    return body["tensors"][key][2][0][0]


HOSTILE = {
    "a file outside the folder": (lambda b: b["files"].__setitem__(0, "../escape.safetensors"), "not a data file"),
    "a file in a subfolder": (lambda b: b["files"].__setitem__(0, "x/y.safetensors"), "not a data file"),
    "a file of another kind": (lambda b: b["files"].__setitem__(0, "x.distcp"), "not a data file"),
    "a file named twice": (lambda b: b["files"].__setitem__(1, b["files"][0]), "twice"),
    "a file number out of range": (lambda b: b["tensors"]["a"][2][0].__setitem__(0, 99), "file number"),
    "overlapping chunks": (lambda b: b["tensors"]["a"][2].append(list(b["tensors"]["a"][2][0])), "overlap"),
    "a gap": (lambda b: b["tensors"]["a"].__setitem__(1, [7, 4]), "cover"),
    "a chunk outside the tensor": (lambda b: b["tensors"]["a"][2][0].__setitem__(1, 3), "does not fit|overlap|cover"),
    "a wrong byte range": (lambda b: b["tensors"]["a"][2][0].__setitem__(-1, 10), "byte range"),
    "a byte range of another tensor": (lambda b: b["tensors"]["a"][2][0].__setitem__(-2, 8) or
                                       b["tensors"]["a"][2][0].__setitem__(-1, 104), "different saves"),
    "an unknown dtype": (lambda b: b["tensors"]["a"].__setitem__(0, "Q9"), "dtype"),
    "a dtype that is not a dtype": (lambda b: b["tensors"]["a"].__setitem__(0, "Tensor"), "dtype"),
    "a dtype the header does not have": (lambda b: b["tensors"]["e"].__setitem__(0, "float64"), "different saves"),
    "a huge number": (lambda b: b["tensors"]["a"][2][0].__setitem__(1, 2**62), "out of range"),
    "a negative size": (lambda b: b["tensors"]["a"][2][0].__setitem__(3, -6), "does not fit|byte range|cover"),
    "a huge shape": (lambda b: b["tensors"]["a"].__setitem__(1, [2**40, 2**40]), "shape"),
    "not an entry": (lambda b: b["tensors"].__setitem__("a", {"x": 1}), "entry"),
    "rows past the table": (lambda b: b["tensors"].__setitem__("a", ["float32", [6, 4], 10**6, 2]), "table"),
    "no files list": (lambda b: b.pop("files"), "'files'"),
    "no chunks": (lambda b: b["tensors"]["a"].__setitem__(2, []), "rows"),
    "a tensor the files do not hold": (lambda b: b["tensors"].__setitem__(
        "zz", ["float32", [6, 4], [[_first_file_of(b, "a"), 0, 0, 6, 4, 0, 96]]]), "holds no tensor"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_index_with_a_valid_checksum_is_refused_naming_the_file(tmp_path, case):
    tensors = _saved(tmp_path / "s")
    edit, message = HOSTILE[case]
    _rewrite(tmp_path / "s", edit)
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    if case == "a tensor the files do not hold":
        target["zz"] = torch.zeros(6, 4)
    with pytest.raises(CheckpointCorruptError, match=message) as caught:
        safetensors_sharded.load(target, tmp_path / "s")
    assert INDEX in str(caught.value) or ".safetensors" in str(caught.value)


@pytest.mark.parametrize("damage", ["flip a body byte", "flip a first-line byte", "flip a table byte", "truncate", "empty", "not json"])
def test_a_damaged_index_is_refused_before_it_is_used(tmp_path, damage):
    _saved(tmp_path / "s")
    path = tmp_path / "s" / INDEX
    data = bytearray(path.read_bytes())
    if damage == "flip a body byte":
        data[data.index(b"\n") + 20] ^= 0x04
    elif damage == "flip a first-line byte":
        data[data.index(b"crc32c:") + 8] ^= 0x01
    elif damage == "flip a table byte":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"{not json\n{}")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=INDEX):
        safetensors_sharded.read_index(tmp_path / "s")


def test_an_index_left_by_another_save_is_caught_against_the_headers(tmp_path):
    """The shards are rewritten by a later save of differently split tensors, the old index stays: the plan from
    the index would read the wrong bytes, and the header check refuses it."""
    _saved(tmp_path / "s", threads=2)
    stale = (tmp_path / "s" / INDEX).read_bytes()
    other = {k: v.flip(0) if v.dim() else v for k, v in _tensors().items()}
    other["a"] = torch.randn(6, 4)
    for f in (tmp_path / "s").iterdir():
        f.unlink()
    safetensors_sharded.save({"e": other["e"], "a": other["a"], "b": other["b"], "c": other["c"], "d": other["d"]},
                             tmp_path / "s", rank=0, world_size=1, threads=2)
    (tmp_path / "s" / INDEX).write_bytes(stale)
    target = {k: torch.zeros_like(v) for k, v in other.items()}
    with pytest.raises(CheckpointCorruptError, match="different saves"):
        safetensors_sharded.load(target, tmp_path / "s")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 7)), min_size=1, max_size=3))
def test_any_bit_flip_in_the_index_gives_a_ckptio_error_or_the_right_data(tmp_path_factory, flips):
    folder = tmp_path_factory.mktemp("fz")
    tensors = _saved(folder)
    path = folder / INDEX
    data = bytearray(path.read_bytes())
    for at, bit in flips:
        data[at % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    try:
        safetensors_sharded.load(target, folder)
    except CheckpointError:
        return
    assert all(torch.equal(target[k], v) for k, v in tensors.items())  # never wrong data silently


# ---------------------------------------------------------------------------------------------------- DCP folders
def _dcp_saved(folder: Path) -> dict:
    from ckptio.formats.dcp import format as dcp

    state = {"w": torch.randn(6, 4), "nest": {"b": torch.arange(5), "step": 3, "name": "adam"}}
    written = dcp.save(state, folder)
    assert INDEX in written and ".metadata" in written
    return state


def test_a_dcp_folder_loads_the_same_from_its_index_and_from_its_metadata(tmp_path):
    from ckptio.formats.dcp import format as dcp
    from ckptio.formats.dcp.direct import layout
    from ckptio.storage.confined import Folder

    state = _dcp_saved(tmp_path / "d")
    plain = _as_headers_say(tmp_path / "d", tmp_path / "plain")
    with_index, without = layout(Folder(tmp_path / "d")), layout(Folder(plain))
    assert with_index.index is not None and without.index is None
    assert with_index.tensors == without.tensors and with_index.values == without.values
    assert with_index.order == without.order and with_index.paths == without.paths
    for key in with_index.tensors:
        assert with_index.pieces(key, (0, 0)[:len(with_index.tensors[key].shape)], with_index.tensors[key].shape) == \
            without.pieces(key, (0, 0)[:len(without.tensors[key].shape)], without.tensors[key].shape)
    for folder in (tmp_path / "d", plain):
        loaded = dcp.load_all(folder)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["nest"]["b"], state["nest"]["b"])
        assert loaded["nest"]["step"] == 3 and loaded["nest"]["name"] == "adam"
        assert list(dcp.read_index(folder)) == with_index.order and set(with_index.order) == {
            "w", "nest.b", "nest.step", "nest.name"}


@pytest.mark.parametrize("case", ["a value past the end of its file", "a value of an unknown file", "a bad order",
                                  "a truncated data file", "a safetensors index in a DCP folder",
                                  "a key in the order that is a list", "values that are a list",
                                  "a path holding true", "a path holding a huge index"])
def test_a_hostile_dcp_index_is_refused(tmp_path, case):
    from ckptio.formats.dcp import format as dcp

    _dcp_saved(tmp_path / "d")
    if case == "a truncated data file":
        data = tmp_path / "d" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:100])
        message = "truncated or from another save"
    elif case == "a safetensors index in a DCP folder":
        _saved(tmp_path / "s")
        (tmp_path / "d" / INDEX).write_bytes((tmp_path / "s" / INDEX).read_bytes())
        message = "kind"
    else:
        edit = {"a value past the end of its file": lambda b: b["values"]["nest.step"].__setitem__(2, 10**9),
                "a value of an unknown file": lambda b: b["values"]["nest.step"].__setitem__(0, 5),
                "a bad order": lambda b: b["order"].pop(),
                "a key in the order that is a list": lambda b: b["order"].__setitem__(0, [b["order"][0]]),
                "values that are a list": lambda b: b.__setitem__("values", []),
                "a path holding true": lambda b: b["paths"].__setitem__("nest.step", ["nest", True]),
                "a path holding a huge index": lambda b: b["paths"].__setitem__("nest.step", ["nest", 10**400]),
                }[case]
        _rewrite(tmp_path / "d", edit)
        message = "past|malformed|order|truncated|'values'"
    with pytest.raises(CheckpointCorruptError, match=message) as caught:
        dcp.load_all(tmp_path / "d")
    assert INDEX in str(caught.value) or ".distcp" in str(caught.value)


def test_no_dcp_index_is_made_from_metadata_missing_a_record(tmp_path):
    """A writer thread that failed leaves DCP's metadata without some records; the save is refused afterwards
    (test_integrity.py), and no index may describe bytes that were never written."""
    import pickle

    from ckptio.formats.safetensors.chunk_index import encode_dcp

    _dcp_saved(tmp_path / "d")
    md = pickle.loads((tmp_path / "d" / ".metadata").read_bytes())  # our own test file
    assert encode_dcp(md, 1) is not None
    md.storage_data.pop(next(iter(md.storage_data)))
    assert encode_dcp(md, 1) is None
