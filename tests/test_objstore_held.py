"""GCS and Azure saves send a tensor's bytes from its own memory (``PartStream.write_held``, used by DCP's data writer),
against the real servers (fake-gcs-server, Azurite): held pieces and copied small writes, mixed and cut at the parts'
ends, make exactly the object written and its digest, and a held upload (DCP's data file, a model's safetensors
shard) allocates no copy of the tensors."""

from __future__ import annotations

import os
import tracemalloc

import pytest
import torch

from ckptio.storage import open_storage
from ckptio.storage.checksum import bytes_checksum
from ckptio.storage.objstore import upload

BOTH = pytest.mark.parametrize("store", ["gs", "az"], indirect=True)
KB, MB = 1 << 10, 1 << 20


def _small_parts(monkeypatch, part: int) -> None:
    """Parts (and Azure's first part) of ``part`` bytes, so a few MB of writes cross several of them."""
    from ckptio.storage import azure, gcs

    monkeypatch.setattr(gcs.upload, "PART", part)  # a multiple of 256 KiB, as GCS wants every request but the last
    monkeypatch.setattr(azure._client, "UPLOAD_BLOCK", part)
    monkeypatch.setattr(azure._client, "SINGLE_PUT", part)


# held pieces of several sizes (one below HELD, copied; one larger than a part, cut into several), small writes
# between them, pieces ending inside a part and exactly at its end
_WRITES = [("write", 100), ("held", 700 * KB), ("write", 5), ("held", 300 * KB), ("held", 24 * KB + 1),
           ("write", 1 * MB - 1), ("held", 2 * MB + 512 * KB), ("write", 3), ("held", 1 * MB), ("held", 600 * KB + 7),
           ("write", 200 * KB)]


@BOTH
@pytest.mark.parametrize("count", [1, 2, len(_WRITES)])  # an object of one request, of two parts, of many
def test_held_and_copied_writes_across_parts_make_the_object_written(store, monkeypatch, count):
    _small_parts(monkeypatch, 1 * MB)
    writes = _WRITES[:count] if count > 1 else [("held", 800 * KB)]
    pieces = [(how, os.urandom(size)) for how, size in writes]
    writer = open_storage(store.url("held")).begin_step(f"n{count}")
    with writer.open("f.bin") as stream:
        for how, data in pieces:
            view = memoryview(data)  # held: these bytes stay as they are until the stream is closed
            assert (stream.write_held(view) if how == "held" else stream.write(view)) == len(data)
        whole = b"".join(data for _, data in pieces)
        assert stream.tell() == len(whole)
        assert stream.digest == bytes_checksum(whole)  # before the last part is sent
    assert stream.close() == bytes_checksum(whole)
    assert store.get(f"held/n{count}/f.bin") == whole


@BOTH
def test_a_tensor_handed_to_the_dcp_writer_is_sent_from_its_memory_with_no_copy(store, monkeypatch):
    """The data writer hands a tensor's storage over as held pieces: a part holds views of it, not a copy (the
    copy into pooled part buffers cost ~4.6 ms of CPU per 64 MB a rank, and as much memory traffic again)."""
    from ckptio.formats.dcp.writer import _Gathered

    _small_parts(monkeypatch, 4 * MB)  # several parts: each would be a new buffer for the copy
    monkeypatch.setattr(upload, "_pool", {})  # none kept from another test: a copy would allocate its buffers
    tensor = torch.randn(6 << 20)  # 24 MiB
    writer = open_storage(store.url("nocopy")).begin_step("s")
    with writer.open("f.bin") as stream:
        out = _Gathered(stream)
        out.small(b"head")
        out.flush()  # the first part's buffer is taken (for the small bytes) before the trace starts
        tracemalloc.start()
        try:
            out.large(tensor)
            digest = stream.close()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    data = b"head" + tensor.numpy().tobytes()
    assert peak < MB, f"{peak} bytes allocated to upload a tensor of {tensor.nbytes}"
    assert digest == bytes_checksum(data)
    assert store.get("nocopy/s/f.bin") == data


@BOTH
def test_a_model_shard_saved_as_safetensors_is_sent_from_its_memory_with_no_copy(store, monkeypatch):
    """The sharded safetensors writer (a save's model state) hands each tensor over as a held write too."""
    from safetensors.torch import load

    from ckptio.formats.safetensors import sharded

    _small_parts(monkeypatch, 4 * MB)
    monkeypatch.setattr(upload, "_pool", {})
    state = {"a": torch.randn(3 << 20), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(2 << 20)}
    writer = open_storage(store.url("stnocopy")).begin_step("s")
    # a small file first: what the save imports, and one part buffer in the pool (for the header's bytes); a copy of
    # the tensors would need more buffers, allocated while traced
    sharded.save({"w": torch.zeros(4)}, writer, "warm", rank=0, world_size=1)
    tracemalloc.start()
    try:
        sums = sharded.save(state, writer, "model", rank=0, world_size=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MB, f"{peak} bytes allocated to upload {sum(t.nbytes for t in state.values())} bytes of tensors"
    ((name, digest),) = [(k, v) for k, v in sums.items() if k.endswith(".safetensors")]
    data = store.get(f"stnocopy/s/{name}")
    assert digest == bytes_checksum(data)
    got = load(data)
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_the_bytes_after_an_offset_are_the_pieces_sliced_not_copied():
    """What a GCS part sends again from where the server says it has the bytes (``after``)."""
    data = os.urandom(1000)
    pieces = [memoryview(data)[:10], memoryview(data)[10:10], memoryview(data)[10:600], memoryview(data)[600:]]
    for skip in (0, 5, 10, 11, 599, 600, 999, 1000):
        rest = upload.after(pieces, skip)
        assert b"".join(rest) == data[skip:], skip
        assert all(p.obj is data for p in rest)
        assert len(upload.Body(rest)) == len(data) - skip
    assert upload.checksum(pieces) == int(bytes_checksum(data).partition(":")[2], 16)
