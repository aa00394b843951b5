"""One file written as regions by several threads (``storage/regions.py``): the DCP data file of each rank.

Its CRC-32C is the regions' checksums combined, which must equal that of the file's bytes; a region that
writes more or fewer bytes than planned fails its file instead of leaving a torn one; and a DCP save on
two writer threads gives the same folder, file for file and byte for byte, as one thread.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from ckptio.formats.dcp import save as dcp_save
from ckptio.storage import LocalFolderWriter
from ckptio.storage.checksum import crc32c_combine, file_checksum, format_digest
from ckptio.storage.regions import RegionedFile


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combined_crc_is_the_crc_of_the_concatenation(a, b):
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.mark.parametrize("length", [(1 << 29) - 1, (1 << 29) + 4097, (3 << 30) + 5])
def test_combining_holds_for_regions_of_half_a_gigabyte_and_more(length):
    """Regions of a big optimizer file are hundreds of MB: the combination must hold past 2^29 bytes, where a
    32-entry power table (as zlib keeps for CRC-32) would wrap. The B part is zeros, checksummed in chunks."""
    head = bytes(range(256)) * 3
    chunk = bytes(64 << 20)
    crc_b, left = 0, length
    while left:
        n = min(left, len(chunk))
        crc_b = crc32c(memoryview(chunk)[:n], crc_b)
        left -= n
    crc_ab = crc32c(head)
    left = length
    while left:
        n = min(left, len(chunk))
        crc_ab = crc32c(memoryview(chunk)[:n], crc_ab)
        left -= n
    assert crc32c_combine(crc32c(head), crc_b, length) == crc_ab


def test_regions_written_at_once_give_the_file_and_its_checksum(tmp_path):
    parts = [os.urandom(n) for n in (1 << 20, 3, 0, 777_777)]
    writer = LocalFolderWriter.in_place(tmp_path)
    file = RegionedFile(writer.open("f.bin"), [len(p) for p in parts])
    digests = []

    def write(i: int) -> None:
        region = file.region(i)
        for k in range(0, len(parts[i]), 4096):
            region.write(parts[i][k:k + 4096])
        digests.append(region.close())

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(parts))]
    for t in reversed(threads):  # the last region first: every region writes at its own offset
        t.start()
    for t in threads:
        t.join()
    data = b"".join(parts)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert [d for d in digests if d is not None] == [format_digest(crc32c(data))] == [file_checksum(tmp_path / "f.bin")]


def test_a_region_that_does_not_hold_its_planned_bytes_fails_the_file(tmp_path):
    writer = LocalFolderWriter.in_place(tmp_path)
    file = RegionedFile(writer.open("f.bin"), [4, 4])
    first, second = file.region(0), file.region(1)
    with pytest.raises(OSError, match="would grow past its planned 4 bytes"):
        first.write(b"12345")
    first.write(b"123")
    with pytest.raises(OSError, match="holds 3 bytes, 4 were planned"):
        first.close()
    second.write(b"abcd")
    assert second.close() is None and file.digest is None  # no digest: the file is not a finished one


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_writer_threads_write_the_same_dcp_folder_as_one(tmp_path):
    torch.manual_seed(0)
    state = {f"layer{i}.{k}": torch.randn(64 + i, 32) for i in range(7) for k in ("exp_avg", "exp_avg_sq")}
    state["step"] = torch.tensor(3.0)
    state["hyper"] = {"lr": 0.1, "betas": (0.9, 0.99)}
    sums = {n: dcp_save.save(state, tmp_path / f"t{n}", thread_count=n) for n in (1, 2, 3)}
    names = {n: sorted(p.name for p in (tmp_path / f"t{n}").iterdir()) for n in sums}
    assert names[1] == names[2] == names[3] == [".ckptio-chunks", ".metadata", "__0_0.distcp"]
    for n in (2, 3):  # DCP frames every item the same way; only the order of the items in the file differs
        assert (tmp_path / f"t{n}" / "__0_0.distcp").stat().st_size == (tmp_path / "t1" / "__0_0.distcp").stat().st_size
        assert sums[n]["__0_0.distcp"] == file_checksum(tmp_path / f"t{n}" / "__0_0.distcp")
    import torch.distributed.checkpoint as dcp

    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    back["hyper"] = {"lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(back, checkpoint_id=str(tmp_path / "t2"), no_dist=True)  # plain DCP reads it
    assert all(torch.equal(back[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert back["hyper"] == state["hyper"]


def test_durable_files_are_written_out_while_still_being_written(tmp_path, monkeypatch):
    """A durable local file asks the kernel to start writing each step of its bytes as they come (so the closing
    fsync finds most of it on the device): for a stream written front to back, and for each region of a file
    written by several threads. The bytes and checksums are those written; a non-durable stream asks nothing."""
    from ckptio.storage import posix
    from ckptio.storage.local import LocalWriteStream

    if posix._sync_file_range is None:
        pytest.skip("no sync_file_range on this system: durability rests on the fsync alone")
    monkeypatch.setattr(posix.Writeback, "step", 1 << 16)
    data = os.urandom(1 << 20)
    stream = LocalWriteStream(tmp_path / "one.bin")
    for k in range(0, len(data), 10_000):
        stream.write(data[k:k + 10_000])
    assert stream._writeback is not None and stream._writeback.kicked >= len(data) - (1 << 16) - 10_000
    assert stream.close() == format_digest(crc32c(data)) and (tmp_path / "one.bin").read_bytes() == data

    file = RegionedFile(LocalFolderWriter.in_place(tmp_path).open("two.bin"), [300_000, len(data) - 300_000])
    regions = [file.region(0), file.region(1)]
    for region in reversed(regions):
        for k in range(region.start, region.start + region.length, 10_000):
            region.write(data[k:min(k + 10_000, region.start + region.length)])
        assert region._writeback is not None and region._writeback.kicked > region.start + (1 << 16)
    assert [r.close() for r in regions][-1] == format_digest(crc32c(data))
    assert (tmp_path / "two.bin").read_bytes() == data

    spooled = LocalWriteStream(tmp_path / "spool.bin", durable=False)  # e.g. an S3 upload's spool file
    spooled.write(data)
    assert spooled._writeback is None
    spooled.close()
