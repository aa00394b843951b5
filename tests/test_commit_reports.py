"""A step in a bucket is committed from what the ranks' writers made, not from a listing of the step (issue 70).

Every object a rank writes into a step goes through its writer (a stream, a rename, a library's local file
uploaded), and is confirmed by the store when it is made: each writer can say which objects it made, with their
sizes and checksums (:meth:`ObjectFolderWriter.written`), and the ranks send that to rank 0 in the round of the
checksums. Rank 0's commit took a listing of the whole step for it (~4 ms of its client's CPU every save on GCS,
as much as uploading several MB); the manifest built from the reports must list exactly the objects of the step,
with their sizes and checksums, and a restore verifies them. Against the real loopback servers (moto,
fake-gcs-server, Azurite) and real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from crc32c import crc32c

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.engine.manifest import check_files, read_manifest
from ckptio.engine.saving import step_files
from ckptio.errors import CheckpointError
from ckptio.storage import open_storage
from ckptio.storage.checksum import format_digest


def _counted_save_rank(url: str) -> list[tuple[str, str]]:
    """A rank of a 2-rank save of the tiny Llama (sharded safetensors, rank 0's config files written by
    ``transformers``, AdamW in DCP) into ``url`` by a kept manager: the bucket's listings it asked for in the second
    save, (name, prefix) each, counted as they go to the store (the store itself runs)."""
    import torch.distributed as dist
    from toy import make_model

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    calls: list[tuple[str, str]] = []
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
        kind = type(mgr.storage.store)
        real = kind.listing

        def listing(self, prefix, *args, **kwargs):
            calls.append(("listing", prefix))
            return real(self, prefix, *args, **kwargs)

        kind.listing = listing
        try:
            dist.barrier()
            mgr.save(step=2)
        finally:
            kind.listing = real
    return calls


def test_a_save_on_several_ranks_is_committed_from_their_reports_without_listing_the_step(store):
    """Rank 0 lists the step once in a save of a kept manager (emptying its name before writing: an older step or an
    interrupted save of that name), no more: the manifest's files come from the ranks' writers (it listed the whole
    step again to commit it). The manifest lists exactly the step's objects (rank 1's, rank 0's library-written
    config), with the sizes the store holds and the CRC-32C of their bytes, and a fully verified restore takes it."""
    from distributed import run_ranks

    url = store.url("reports")
    zero, one = run_ranks(2, _counted_save_rank, url=url)
    step = "reports/epoch_0_step_2/"
    assert zero.count(("listing", step)) == 1, zero
    assert one == [], one

    folder = open_storage(url).folder("epoch_0_step_2")
    manifest = read_manifest(folder)
    objects = {key[len(step):]: size for key, size in store.keys(step).items()}
    assert manifest.files == {rel: size for rel, size in objects.items() if rel != "manifest.json"}
    assert "model/config.json" in manifest.files and any("00002" in rel for rel in manifest.files), manifest.files
    assert manifest.checksums == {rel: format_digest(crc32c(store.get(step + rel))) for rel in manifest.files}
    assert check_files(folder, manifest, checksums=True) == []

    from toy import make_model

    with CheckpointManager(CheckpointConfig(checkpoint_dir=url, verify="full"), model=make_model(seed=1),
                           rng=False) as again:
        info = again.restore()
    assert info is not None and info.step == 2


def test_a_writer_reports_exactly_the_objects_it_made_with_their_sizes_and_checksums(store, tmp_path):
    """What :meth:`written` reports is what the bucket holds for that writer: streams closed, small writes, a file
    renamed under its new name only, a library's local file (uploaded first); not a stream whose block raised (no
    object), nor another writer's objects in the same step."""
    storage = open_storage(store.url("made"))
    writer = storage.begin_step("step")
    other = storage.attach_step(writer.token, "step")
    with writer.open("a/stream.bin") as stream:
        stream.write(b"x" * 1000)
        stream.write(memoryview(b"y" * 24))
    writer.write_bytes("small.txt", b"hello")
    writer.write_bytes("tmp.meta", b"renamed")
    writer.rename("tmp.meta", "final.meta")
    with pytest.raises(RuntimeError):
        with writer.open("failed.bin") as stream:
            stream.write(b"never made")
            raise RuntimeError("the writer failed mid-file")
    (writer.local_path("lib") / "config.json").write_text('{"library": true}')
    other.write_bytes("b/other.bin", b"another rank's")

    mine = writer.written()
    prefix = "made/step/"
    there = {key[len(prefix):]: store.get(key) for key in store.keys(prefix) if not key.endswith(".ckptio-pending")}
    assert set(there) == {"a/stream.bin", "small.txt", "final.meta", "lib/config.json", "b/other.bin"}
    assert mine == {rel: (len(data), format_digest(crc32c(data))) for rel, data in there.items()
                    if rel != "b/other.bin"}
    assert other.written() == {"b/other.bin": (14, format_digest(crc32c(b"another rank's")))}
    writer.abort()


def test_two_ranks_reporting_one_file_with_different_bytes_fail_the_commit_naming_it(store):
    """The step's files are the union of the ranks' reports: the same file made twice with different bytes (the
    store keeps one of them) is refused by name, as is a checksum a rank reported for a file its writer made with
    another; a file made by one rank comes with its size and checksum."""
    storage = open_storage(store.url("twice"))
    writer = storage.begin_step("step")
    other = storage.attach_step(writer.token, "step")
    writer.write_bytes("shared.bin", b"rank 0's bytes")
    other.write_bytes("shared.bin", b"rank 1's other bytes")
    with pytest.raises(CheckpointError, match="shared.bin: written by ranks 0 and 1 with different bytes"):
        step_files(writer, [writer.written(), other.written()], {})

    other.write_bytes("shared.bin", b"rank 0's bytes")
    sums: dict[str, str] = {}
    assert step_files(writer, [writer.written(), other.written()], sums) == {"shared.bin": 14}
    assert sums == {"shared.bin": format_digest(crc32c(b"rank 0's bytes"))}
    with pytest.raises(CheckpointError, match="shared.bin: its writer made it with checksum"):
        step_files(writer, [writer.written()], {"shared.bin": "crc32c:00000000"})
    writer.abort()


def test_a_local_folder_is_still_listed_for_its_commit(tmp_path):
    """A local disk's writer cannot say what libraries wrote into its folder: its commit lists the folder, summing
    the files no stream reported (a library's)."""
    storage = open_storage(str(tmp_path / "local"))
    writer = storage.begin_step("step")
    sums = {"a.bin": writer.write_bytes("a.bin", b"streamed")}
    (writer.local_path("lib") / "config.json").write_text("{}")
    assert getattr(writer, "written", None) is None
    assert step_files(writer, [None], sums) == {"a.bin": 8, "lib/config.json": 2}
    assert sums["lib/config.json"] == format_digest(crc32c(b"{}"))
    writer.abort()
