"""Checkpoint folders in object storage (``s3://bucket/prefix``), against a real S3-compatible server.

The server is moto's standalone server, started on 127.0.0.1 by these tests and reached over HTTP by the
real boto3 client, configured only through the standard AWS environment variables.

The tests of the folder's contract (save, resume, retention and prune, the lease, a torn save, the CLI, the read
gate) take the ``store`` fixture and run on Google Cloud Storage too (``gs://``): fake-gcs-server on 127.0.0.1,
reached by the real ``google-cloud-storage`` client through ``STORAGE_EMULATOR_HOST`` (tests/gcsserver.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from ckptio import CheckpointConfig, CheckpointManager, _faults, committed_checkpoints  # noqa: E402
from ckptio.errors import CheckpointError, ConfigError  # noqa: E402
from ckptio.engine.layout import LATEST, pointer_target, scan  # noqa: E402
from ckptio.storage import open_storage  # noqa: E402
from ckptio.storage import s3 as s3mod  # noqa: E402
from ckptio.storage.verify import Verifier  # noqa: E402
from cli_here import ckptio_here  # noqa: E402


def _keys(bucket: str, prefix: str = "") -> dict[str, int]:
    out = {}
    for page in s3mod.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _setup(url: str, **config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, CheckpointManager(CheckpointConfig(checkpoint_dir=url, **config), model=model, optimizer=opt)


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_save_resume_and_retention_in_a_bucket(store, fmt):
    url = store.url("runs/one")
    model, opt, mgr = _setup(url, model_save_format=fmt, keep_latest=2)
    with mgr:
        for step in (1, 2, 3):
            _train(model, opt, 2, step)
            mgr.save(step=step)
    keys = store.keys("runs/one/")
    assert not any(k.startswith("runs/one/epoch_0_step_1/") for k in keys), "retention left step 1"
    assert "runs/one/epoch_0_step_3/manifest.json" in keys and "runs/one/LATEST" in keys
    assert "runs/one/.ckptio.lock" not in keys  # released at close
    assert [e.name for e in committed_checkpoints(open_storage(url))] == ["epoch_0_step_2", "epoch_0_step_3"]

    model2, opt2, again = _setup(url, model_save_format=fmt, verify="full")
    with again:
        info = again.restore()
    assert info is not None and info.step == 3 and str(info.path) == f"{url}/epoch_0_step_3"
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    _train(model, opt, 1, 99)
    _train(model2, opt2, 1, 99)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))  # optimizer too


def test_an_uncommitted_step_is_never_resumed_and_is_swept(store):
    url = store.url("r")
    model, opt, mgr = _setup(url)
    with mgr:
        mgr.save(step=1)
    storage = open_storage(url)
    writer = storage.begin_step("epoch_0_step_2")  # a save killed before its manifest
    writer.write_bytes("model/shard-00000-model-00001-of-00001.safetensors", b"partial")
    # its local spool is held by this process's lock: a killed process's is swept (tests/test_scratch.py)
    assert (writer.spool / "owner.lock").is_file() and writer.spool.name.startswith(
        f"ckptio-{store.scheme}-epoch_0_step_2-")
    entries = {e.name: e for e in scan(storage)}
    assert entries["epoch_0_step_2"].problem and "missing" in entries["epoch_0_step_2"].problem
    _, _, again = _setup(url)
    with again:
        assert again.restore().step == 1
    removed = storage.sweep()
    assert [p.name for p in removed] == ["epoch_0_step_2"]
    assert not store.keys("r/epoch_0_step_2/")


def test_sweep_and_retention_never_remove_a_folder_ckptio_did_not_begin(store):
    """A step folder without ckptio's in-progress mark (copied from NeMo AutoModel, say) is not an interrupted
    save: sweep leaves it, and a step whose removal was cut short is marked so that the next sweep finishes it."""
    url = store.url("r")
    store.put("r/epoch_0_step_9/model/shard-00001-model-00001-of-00001.safetensors", b"not ours")
    model, opt, mgr = _setup(url)
    with mgr:
        mgr.save(step=1)
    storage = open_storage(url)
    assert ".ckptio-pending" not in "".join(store.keys("r/epoch_0_step_1/"))  # committed: the mark is gone
    assert storage.sweep() == []
    assert store.keys("r/epoch_0_step_9/")
    class Killed(BaseException):
        pass

    def die(point: str) -> None:
        if point == "delete.after_hide":
            raise Killed

    _faults.set_hook(die)
    try:
        with pytest.raises(Killed):
            storage.remove_step("epoch_0_step_1")
    finally:
        _faults.set_hook(None)
    entry = {e.name: e for e in scan(storage)}["epoch_0_step_1"]
    assert not entry.committed and not entry.candidate and "uncommitted" in entry.problem
    assert [p.name for p in storage.sweep()] == ["epoch_0_step_1"]
    assert not store.keys("r/epoch_0_step_1/") and store.keys("r/epoch_0_step_9/")


def test_parts_go_up_while_the_file_is_written_and_a_discarded_file_leaves_no_upload(bucket, monkeypatch):
    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)
    s3 = s3mod.client()
    storage = open_storage(f"s3://{bucket}/stream")
    data = torch.randint(0, 256, (13 << 20,), dtype=torch.uint8).numpy().tobytes()
    writer = storage.begin_step("s")
    stream = writer.open("blob.bin")
    stream.write(data[:11 << 20])  # two whole parts spooled: sent before the file is closed
    (upload,) = s3.list_multipart_uploads(Bucket=bucket, Prefix="stream/")["Uploads"]
    for sent in stream._parts.futures:  # parts go up in parallel: the second may land before the first
        sent.result()
    assert len(s3.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])["Parts"]) == 2
    stream.write(data[11 << 20:])
    stream.close()  # the last, short part, then the upload is completed
    assert s3.get_object(Bucket=bucket, Key="stream/s/blob.bin")["Body"].read() == data
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix="stream/").get("Uploads")
    dropped = writer.open("dropped.bin")
    dropped.write(data)
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix="stream/").get("Uploads")
    dropped.discard()
    assert not s3.list_multipart_uploads(Bucket=bucket, Prefix="stream/").get("Uploads")
    assert "stream/s/dropped.bin" not in _keys(bucket, "stream/")


def test_two_writers_cannot_both_commit_a_step(store):
    storage = open_storage(store.url("race"))
    first = storage.begin_step("epoch_0_step_5")
    second = storage.attach_step(first.token, "epoch_0_step_5")
    first.write_bytes("a", b"one")
    second.write_bytes("b", b"two")
    first.commit(("manifest.json", b'{"first": true}'))
    with pytest.raises(CheckpointError, match="another writer committed this step first"):
        second.commit(("manifest.json", b'{"second": true}'))
    assert store.get("race/epoch_0_step_5/manifest.json") == b'{"first": true}'


def test_large_files_go_up_in_parts_and_read_back_verified(store, monkeypatch):
    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)  # S3's smallest part: 3 parts of a 12 MiB file
    if store.scheme == "az":  # blocks above 8 MiB here (64 MiB by default), committed create-only as a list
        from ckptio.storage import azure

        monkeypatch.setattr(azure._client, "SINGLE_PUT", 8 << 20)
    storage = open_storage(store.url("big"))  # on GCS: one resumable upload (over 8 MiB)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    writer = storage.begin_step("s")
    with writer.open("blob.bin") as stream:
        for i in range(0, len(data), 1 << 20):
            stream.write(data[i:i + (1 << 20)])
    digest = stream.close()
    writer.commit(("manifest.json", b"{}"))
    assert store.scheme != "s3" or not s3mod.client().list_multipart_uploads(Bucket=store.bucket).get("Uploads")
    folder = storage.folder("s")
    assert folder.size("blob.bin") == len(data)
    verifier = Verifier(folder, {"blob.bin": digest})
    with storage.folder("s", verifier=verifier).open("blob.bin") as h:
        assert h.read(7 << 20, 1000) == data[7 << 20:(7 << 20) + 1000]
    assert verifier.finish(["blob.bin"]) == []
    bad = Verifier(folder, {"blob.bin": "crc32c:00000000"})
    problems = bad.finish(["blob.bin"])
    assert len(problems) == 1 and f"{store.scheme}://" in problems[0] and "blob.bin" in problems[0]


def test_an_aborted_multipart_upload_is_swept(bucket):
    s3 = s3mod.client()
    s3.create_multipart_upload(Bucket=bucket, Key="m/epoch_0_step_1/x.bin")
    storage = open_storage(f"s3://{bucket}/m")
    removed = storage.sweep()
    assert any(p.name == "x.bin" for p in removed)
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_hostile_keys_and_pointers_are_refused(store):
    url = store.url("h")
    model, opt, mgr = _setup(url)
    with mgr:
        mgr.save(step=1)
    # Azure keeps no blob with a '..' segment (the client resolves it before signing, and Azure's naming rules
    # forbid a segment ending in '.'): that name is planted on the other stores only
    dots = store.scheme != "az"
    if dots:
        store.put("h/epoch_0_step_1/../../escape", b"x")
    store.put("h/epoch_0_step_1//double", b"x")
    folder = open_storage(url).folder("epoch_0_step_1")
    kinds = {e.name: e.kind for e in folder.listdir()}
    assert kinds.get("..") == ("other" if dots else None) and "escape" not in kinds and kinds.get("") in (None, "other")
    assert kinds.get("") == "other" or store.scheme != "az"  # the empty segment is listed and never read
    store.put("h/LATEST", b"../elsewhere\n")
    with pytest.raises(CheckpointError, match="LATEST: the pointer names"):
        pointer_target(open_storage(url), LATEST)
    _, _, again = _setup(url, restore_from="LATEST")  # a damaged LATEST falls back to the newest usable
    with again:
        assert again.restore().step == 1


# many requests: on Azurite (a Node server, ~15 ms a request) 10-15 s, marked slow there
@pytest.mark.parametrize("store", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)], indirect=True)
def test_a_second_process_is_refused_by_the_lease(store):
    url = store.url("lease")
    model, opt, mgr = _setup(url)
    with mgr:
        mgr.save(step=1)
        code = textwrap.dedent(f"""
            import torch
            from ckptio import CheckpointConfig, CheckpointManager
            m = torch.nn.Linear(2, 2)
            try:
                with CheckpointManager(CheckpointConfig(checkpoint_dir={url!r}), model=m) as mgr:
                    mgr.save(step=2)
            except Exception as exc:
                print(type(exc).__name__, exc)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "CheckpointDirLocked" in out.stdout and "in use by pid" in out.stdout, out.stdout + out.stderr
        _, _, second = _setup(url)  # the same process shares it
        with second:
            second.save(step=3)
    assert [e.name for e in committed_checkpoints(open_storage(url))] == ["epoch_0_step_1", "epoch_0_step_3"]


def test_a_hostile_lease_is_read_as_unreadable_and_taken_over(store):
    """A lease object whose fields have the wrong types or a number no float holds (a 400-digit integer) is an
    unreadable lease, never a bare OverflowError: a holder that cannot be read is one that stopped renewing."""
    import json

    for body in ({"holder": "pid 1 on elsewhere", "renewed": 10 ** 400}, {"holder": ["x"], "renewed": "soon"}, [1]):
        store.put("hostile/.ckptio.lock", json.dumps(body).encode())
        model, opt, mgr = _setup(store.url("hostile"))
        with mgr:
            mgr.save(step=1)


def test_configuration_of_s3_locations(bucket):
    with pytest.raises(ConfigError, match="no bucket name"):
        CheckpointConfig(checkpoint_dir="s3:///prefix")
    with pytest.raises(ConfigError, match="plain names"):
        CheckpointConfig(checkpoint_dir="s3://b/a/../c")
    with pytest.raises(ConfigError, match="hdfs:// locations are not supported"):
        CheckpointConfig(checkpoint_dir="hdfs://b/c")


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_the_consolidated_bundle_is_written_into_the_bucket(bucket, tmp_path, fmt):
    """``save_consolidated`` with an s3:// folder: the bundle is built from the step's uploaded shards and its
    files are the same bytes as from a local save of the same model; transformers loads them."""
    from transformers import AutoModelForCausalLM

    from toy import make_model

    model = make_model(seed=4, tie_word_embeddings=False)
    for where in (f"s3://{bucket}/hf", str(tmp_path / "local")):
        with CheckpointManager(CheckpointConfig(checkpoint_dir=where, model_save_format=fmt, save_consolidated=True),
                               model=model, rng=False) as mgr:
            mgr.save(step=1)
    prefix = "hf/epoch_0_step_1/model/consolidated/"
    remote = {k[len(prefix):]: k for k in _keys(bucket, prefix)}
    local = tmp_path / "local" / "epoch_0_step_1" / "model" / "consolidated"
    assert sorted(remote) == sorted(p.name for p in local.iterdir()) and "config.json" in remote
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for name, key in remote.items():
        s3mod.client().download_file(bucket, key, str(fetched / name))
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            assert (fetched / name).read_bytes() == (local / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(fetched)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def _fsdp_rank(url: str, resume: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from toy import full_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url, async_save=not resume, keep_latest=1),
                           model=model, optimizer=opt, rng=False) as mgr:
        if resume:
            info = mgr.restore()
            return {"step": info.step, "state": full_state(model, opt)}
        torch.manual_seed(1)
        for step in range(1, 5):
            model(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % 2 == 0:
                mgr.save(step=step)
        mgr.wait()
        return {"state": full_state(model, opt)}


def _counted(kind: type, name: str, calls: list):
    """The store class ``kind``'s method ``name``, appending ``(name, key)`` to ``calls`` before each call (the store
    itself runs: real requests to the loopback server, counted)."""
    real = getattr(kind, name)

    def call(self, key, *args, **kwargs):
        calls.append((name, key))
        return real(self, key, *args, **kwargs)
    return call


def _counted_restore_rank(url: str) -> dict:
    """A rank of a 2-rank FSDP restore: the requests the restore made to the bucket, (method, key) each."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls: list[tuple[str, str]] = []
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, optimizer=opt, rng=False) as mgr:
        kind = type(mgr.storage.store)
        for name in ("listing", "head", "get", "read_into"):
            setattr(kind, name, _counted(kind, name, calls))
        dist.barrier()
        step = mgr.restore().step
    return {"step": step, "calls": calls}


def test_on_several_ranks_rank_0_alone_lists_and_reads_the_small_objects(store):
    """A restore on 2 ranks: the folder's and the step's listings, the manifest and the other small objects every
    rank needs (DCP's .metadata, the training state) are asked of the store by rank 0 alone and sent to the others
    (each request costs a rank's client more CPU than a MB of data); the others read their share of the data."""
    from distributed import run_ranks

    url = store.url("few")
    run_ranks(2, _fsdp_rank, url=url, resume=False)
    ranks = run_ranks(2, _counted_restore_rank, url=url)
    assert [r["step"] for r in ranks] == [4, 4]
    zero, one = ranks[0]["calls"], ranks[1]["calls"]
    assert [c for c in one if c[0] in ("listing", "head", "get")] == [], one
    small = {key for name, key in zero if name == "read_into"} - {key for name, key in one}
    assert any(k.endswith("manifest.json") for k in small) and any(k.endswith(".metadata") for k in small), zero
    assert not any(k.endswith(("manifest.json", ".metadata", ".json", ".pt")) for _, k in one), one
    assert [k for _, k in zero].count("few/epoch_0_step_4/manifest.json") == 1, zero


WRITES = ("put", "open_stream", "upload_file")


def _counted_rank(url: str, restore: bool) -> list:
    """A rank of a 2-rank save (``restore``: restore) of a small FSDP state: every request it made to the bucket,
    (method, key) each, counted from before its manager was made (the run's record is read there)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    calls: list[tuple[str, str]] = []
    kind = type(open_storage(url).store)
    for name in ("listing", "head", "get", "read_into", "delete", "copy", "put"):
        setattr(kind, name, _counted(kind, name, calls))
    for name in ("open_stream", "upload_file"):  # (a local path, the key)
        real = getattr(kind, name)
        setattr(kind, name, lambda self, path, key, *a, _real=real, _name=name, **k: (
            calls.append((_name, key)), _real(self, path, key, *a, **k))[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    dist.barrier()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, rng=False) as mgr:
        if restore:
            assert mgr.restore().step == 1
        else:
            mgr.save(step=1)
    return calls


def test_on_several_ranks_only_rank_0_reads_the_run_record_and_the_others_ask_nothing_but_their_writes(store):
    """Rank 0 alone reads and writes the run's record (``.ckptio_record.json``): another rank asks the bucket
    nothing in a save but the uploads of its own files, and nothing at all in a restore of a small state (rank 0
    sends it the listings and small objects). Each request costs a rank's client ~1-3 ms of CPU: the record's listing
    and read on every rank were a third of a 4-rank tiny restore's fixed cost."""
    from distributed import run_ranks

    url = store.url("asks")
    zero, one = run_ranks(2, _counted_rank, url=url, restore=False)
    assert one and all(name in WRITES and key.startswith("asks/epoch_0_step_1/") for name, key in one), one
    assert ("listing", "asks/") in zero, zero  # rank 0 still reads the record (and the folder)
    zero, one = run_ranks(2, _counted_rank, url=url, restore=True)
    assert one == [], one
    assert [k for _, k in zero].count("asks/.ckptio_record.json") >= 1, zero


def _made_rank(url: str) -> dict:
    """A rank of a 2-rank job making managers made to train (an optimizer: the bucket is checked) into ``url``: the
    HTTP requests it sent while making each, and the error making one into a bucket that does not exist raised."""
    from urllib3.connectionpool import HTTPConnectionPool

    model = torch.nn.Linear(8, 8)
    sent: list[str] = []
    real = HTTPConnectionPool.urlopen

    def urlopen(self, *args, **kwargs):  # requests passes method and url by name
        sent.append(" ".join(str(a) for a in (*args[:2], kwargs.get("method", ""), kwargs.get("url", "")) if a))
        return real(self, *args, **kwargs)

    HTTPConnectionPool.urlopen = urlopen
    try:
        counts = []
        for _ in range(2):
            before = len(sent)
            mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model,
                                    optimizer=torch.optim.AdamW(model.parameters()), rng=False)
            counts.append(sent[before:])
            mgr.close()
    finally:
        HTTPConnectionPool.urlopen = real
    scheme, _, rest = url.partition("://")
    try:
        CheckpointManager(CheckpointConfig(checkpoint_dir=f"{scheme}://{rest.split('/')[0]}-missing/run"),
                          model=model, optimizer=torch.optim.AdamW(model.parameters()), rng=False)
        error = None
    except CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"sent": counts, "error": error}


def test_on_several_ranks_only_rank_0_checks_the_bucket_exists_when_a_manager_is_made(store):
    """A manager made to train checks its bucket exists: rank 0 alone asks, and tells the others (a request costs
    GCS's and Azure's clients several ms of CPU, a broadcast ~0.5 ms); another rank sends nothing when its manager is
    made. A bucket that does not exist is still refused on every rank, naming it."""
    from distributed import run_ranks

    zero, one = run_ranks(2, _made_rank, url=store.url("made"))
    assert one["sent"] == [[], []], one["sent"]
    assert all(zero["sent"]), zero["sent"]  # rank 0 still asks (the bucket, the run's record)
    for rank in (zero, one):
        assert rank["error"] is not None and "does not exist" in rank["error"], rank["error"]
        assert "never creates one" in rank["error"], rank["error"]


def _counted_second_save(url: str, frozen_on_rank_1: bool = True) -> list:
    """A rank of a 2-rank save of step 2 by a new manager, in a folder holding step 1: the requests of the save.
    ``frozen_on_rank_1``: rank 1's bias is frozen (a file that may be shared with step 1; rank 0 has none)."""
    import torch.distributed as dist

    model = torch.nn.Linear(64, 64)
    if frozen_on_rank_1 and dist.get_rank() == 1:
        model.bias.requires_grad_(False)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, rng=False) as mgr:
        mgr.save(step=1)
    calls: list[tuple[str, str]] = []
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, rng=False) as mgr:
        kind = type(mgr.storage.store)
        for name in ("listing", "head", "get", "read_into"):
            setattr(kind, name, _counted(kind, name, calls))
        dist.barrier()
        mgr.save(step=2)
    return calls


def test_a_save_lists_the_folder_once_to_sweep_it_and_find_what_latest_offers(store):
    """Before a save on several ranks, rank 0 sweeps the folder (its first save) and reads what the checkpoint
    ``LATEST`` names offers to share (its manifest, and every committed step's): one listing of the folder and one
    read of the manifest serve both (each was asked for again: 3 listings and 2 reads of it)."""
    from distributed import run_ranks

    url = store.url("once")
    zero = run_ranks(2, _counted_second_save, url=url)[0]
    assert zero.count(("listing", "once/")) == 1, zero
    assert [k for _, k in zero].count("once/epoch_0_step_1/manifest.json") == 1, zero


def test_a_save_reads_what_latest_offers_only_when_some_rank_has_frozen_tensors_to_share(store):
    """What ``LATEST`` offers to share (the pointer, its manifest, every committed step's) serves only a rank with
    frozen tensors, grouped into files of their own: without any on any rank (full training), rank 0 reads none of
    it before a save (3 requests and more, each costing GCS's and Azure's clients several ms of CPU). With them on
    another rank only (a pipeline's stage), it still does (the test above)."""
    from distributed import run_ranks

    url = store.url("none")
    zero = run_ranks(2, _counted_second_save, url=url, frozen_on_rank_1=False)[0]
    assert zero.count(("listing", "none/")) == 1, zero  # the sweep of the manager's first save
    assert not [c for c in zero if c[0] in ("get", "read_into")], zero


def _restore_rank_0_through(url: str, proxy: str) -> dict:
    """A rank of a 2-rank FSDP restore, rank 0 reaching the server through ``proxy``: the error the restore raised."""
    import os

    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.environ["AWS_ENDPOINT_URL"] = proxy
    try:
        _counted_restore_rank(url)
    except CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def test_on_several_ranks_a_failure_of_rank_0s_small_reads_fails_the_restore_on_every_rank(bucket, s3_server):
    """Rank 0 alone reads the step's small objects for every rank: its failure (the optimizer's DCP .metadata
    refused, 403) is a clean error on each rank, naming the object, not a hang of the others."""
    from distributed import run_ranks

    url = f"s3://{bucket}/few"
    run_ranks(2, _fsdp_rank, url=url, resume=False)
    proxy = _FaultyProxy(s3_server, lambda method, path, query: "refuse" if method == "GET" and path.endswith(
        "/optim/.metadata") else "pass")
    try:
        errors = [r["error"] for r in run_ranks(2, _restore_rank_0_through, timeout=120, url=url, proxy=proxy.url)]
    finally:
        proxy.close()
    assert len(errors) == 2 and all(e is not None and "few/epoch_0_step_4/optim/.metadata" in e and "AccessDenied" in e
                                    for e in errors), errors


@pytest.mark.slow
def test_two_ranks_save_in_the_background_and_one_resumes(store):
    from distributed import run_ranks

    url = store.url("fsdp")
    saved = run_ranks(2, _fsdp_rank, url=url, resume=False)[0]
    keys = store.keys("fsdp/")
    assert {k.split("/")[1] for k in keys if k.count("/") > 1} == {"epoch_0_step_4"}  # keep_latest=1
    assert any("shard-00001" in k for k in keys), "rank 1 uploaded nothing"
    resumed = run_ranks(1, _fsdp_rank, url=url, resume=True)[0]
    assert resumed["step"] == 4
    for key, value in saved["state"].items():
        assert torch.equal(resumed["state"][key], value), key


@pytest.mark.parametrize("store", ["s3", pytest.param("gs", marks=pytest.mark.slow),
                                   pytest.param("az", marks=pytest.mark.slow)], indirect=True)
def test_list_verify_and_prune_on_a_bucket(store):
    """The ``ckptio`` commands on a bucket's folder: list (with an interrupted save), inspect (through the
    LATEST pointer), verify (a flipped byte found), prune (retention, the lock taken and given back). The first list
    runs the real executable (a fresh process finds the bucket from its environment alone); the others run in this
    process (``ckptio_here``: no torch import each)."""
    import json
    import os
    from pathlib import Path

    exe = [str(Path(sys.executable).parent / "ckptio")]
    url = store.url("cli")
    model, opt, mgr = _setup(url)
    with mgr:
        for step in (1, 2, 3):
            mgr.save(step=step, metrics={"loss": 1.0 / step})
    open_storage(url).begin_step("epoch_0_step_4").write_bytes("half.bin", b"x")  # a killed save

    def run(*args: str) -> subprocess.CompletedProcess:
        return ckptio_here(*args)

    listed = subprocess.run(exe + ["list", url, "--json"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ))
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)["checkpoints"]}
    assert [n for n, r in rows.items() if r["committed"]] == ["epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_3"]
    assert not rows["epoch_0_step_4"]["committed"] and rows["epoch_0_step_4"]["bytes"] == 1
    assert json.loads(listed.stdout)["latest"] == "epoch_0_step_3"
    shown = run("inspect", f"{url}/LATEST", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["step"] == 3, shown.stderr

    good = run("verify", f"{url}/epoch_0_step_3")
    assert good.returncode == 0 and f"OK   {url}/epoch_0_step_3" in good.stdout, good.stdout + good.stderr
    key = next(k for k in store.keys("cli/epoch_0_step_2/model/") if k.endswith(".safetensors"))
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))
    bad = run("verify", url, "--no-progress")
    assert bad.returncode == 1 and f"BAD  {url}/epoch_0_step_2" in bad.stdout and "checksum" in bad.stdout, bad.stdout

    pruned = run("prune", url, "--keep-latest", "1", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(json.loads(pruned.stdout)["delete"]) == ["epoch_0_step_1", "epoch_0_step_2"]
    assert [e.name for e in committed_checkpoints(open_storage(url))] == ["epoch_0_step_3"]
    assert "cli/.ckptio.lock" not in store.keys("cli/")
    missing = run("list", f"{store.url()}-nope/x")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr


class _FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server that answers some requests itself with a 503
    (``SlowDown``, as S3 does under load), a 409 (``ConditionalRequestConflict``, as S3 answers a
    conditional write racing another; moto never does), a 403 (``refuse``: a write the server will not take, retried by
    no client), drops the connection without an answer, before (``drop``) or after (``lost``) the server carried the
    request out, answers half the body then drops (``cut``), forwards the request with a byte of its body flipped (``flip``), or holds the request :attr:`stall_s` seconds before
    carrying it out (``stall``: a server slower than the client's read timeout), or refuses a body whose CRC-32C is not
    the one its ``x-amz-checksum-crc32c`` names as S3 does (``check``: ``400 BadDigest``; moto does not check it), by
    a rule on (method, path, query)."""

    stall_s = 4.0

    def __init__(self, upstream: str, rule) -> None:
        import http.client
        import http.server
        import threading
        import re
        from urllib.parse import quote, urlsplit

        self.rule, self.faults = rule, []
        self.signed: list[tuple[str, str, str | None, str | None]] = []
        """Each request's method, path, ``x-amz-content-sha256`` and ``x-amz-checksum-crc32c``."""
        host, port = urlsplit(upstream).hostname, urlsplit(upstream).port
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def _handle(self) -> None:
                body = self._body()
                proxy.signed.append((self.command, self.path, self.headers.get("x-amz-content-sha256"),
                                     self.headers.get("x-amz-checksum-crc32c")))
                path, _, query = self.path.partition("?")
                if "uploadType=multipart" in query:  # GCS names the object in the body's metadata: the rule sees it
                    named = re.search(rb'"name": ?"([^"]+)"', body)
                    query += f"&name={quote(named.group(1).decode(), safe='')}" if named else ""
                action = proxy.rule(self.command, path, query)
                if action == "drop":
                    proxy.faults.append(("drop", self.command, self.path))
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if action in ("503", "409", "refuse"):
                    proxy.faults.append((action, self.command, self.path))
                    xml = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>" \
                        if action == "503" else b"<Error><Code>ConditionalRequestConflict</Code><Message>A " \
                        b"conflicting conditional operation is currently in progress against this resource." \
                        b"</Message></Error>" if action == "409" else \
                        b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                    self.send_response(403 if action == "refuse" else int(action))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                if action == "check" and self.headers.get("x-amz-checksum-crc32c") not in (None, _crc_b64(body)):
                    proxy.faults.append(("baddigest", self.command, self.path))
                    xml = b"<Error><Code>BadDigest</Code><Message>The CRC32C you specified did not match the " \
                        b"calculated checksum.</Message></Error>"
                    self.send_response(400)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                if action == "stall":
                    proxy.faults.append(("stall", self.command, self.path))
                    time.sleep(proxy.stall_s)
                if action == "flip" and body:  # one byte of the request's body damaged on the way
                    proxy.faults.append(("flip", self.command, self.path))
                    body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1:]
                conn = http.client.HTTPConnection(host, port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                if action == "lost":  # the server did it; its answer never reaches the client
                    proxy.faults.append(("lost", self.command, self.path))
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # a HEAD's answer has no body but the length of the object it describes (Azure's size of a blob)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if action == "cut":  # the announced length, half of it sent, then the connection drops
                    proxy.faults.append(("cut", self.command, self.path))
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                elif self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _crc_b64(data: bytes) -> str:
    """A CRC-32C as S3's ``x-amz-checksum-crc32c`` carries it."""
    import base64

    from crc32c import crc32c

    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


@contextlib.contextmanager
def _through(server: str, monkeypatch, rule, variable: str = "AWS_ENDPOINT_URL"):
    """The client talks to the server through a :class:`_FaultyProxy` applying ``rule`` inside the block (the
    endpoint in ``variable``: ``STORAGE_EMULATOR_HOST`` for the GCS client)."""
    proxy = _FaultyProxy(server, rule)
    monkeypatch.setenv(variable, proxy.url)
    try:
        yield proxy
    finally:
        proxy.close()
        monkeypatch.setenv(variable, server)


def _resumes_exactly(url: str, model, step: int) -> None:
    """Past the proxy, straight to the server: a fully verified resume takes ``step`` with ``model``'s exact weights."""
    model2, _, again = _setup(url, verify="full")
    with again:
        assert again.restore().step == step
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def _nth(match, answers: dict[int, str]):
    """A proxy rule: the n-th request ``match(method, path)`` accepts gets ``answers[n]`` (else passes)."""
    calls = {"n": 0}

    def rule(method: str, path: str, query: str) -> str:
        if not match(method, path):
            return "pass"
        calls["n"] += 1
        return answers.get(calls["n"], "pass")

    return rule


def test_transient_server_errors_and_dropped_connections_are_retried(bucket, s3_server, monkeypatch):
    rule = _nth(lambda method, path: method in ("PUT", "POST") and "/r2/" in path, {1: "503", 4: "drop", 7: "503"})
    with _through(s3_server, monkeypatch, rule) as proxy:
        model, opt, mgr = _setup(f"s3://{bucket}/r2")
        with mgr:
            mgr.save(step=1)
            _train(model, opt, 1, 3)
            mgr.save(step=2)
    assert {f[0] for f in proxy.faults} == {"503", "drop"}, proxy.faults
    _resumes_exactly(f"s3://{bucket}/r2", model, 2)


def test_a_server_that_keeps_failing_fails_the_save_cleanly(bucket, s3_server, monkeypatch):
    """Uploads of the second step always answered 503: the save raises (bounded: 2 tries per request here),
    naming the object and the server's error; the first checkpoint stays the one a resume takes."""
    failing = {"on": False}

    def rule(method: str, path: str, query: str) -> str:
        return "503" if failing["on"] and method in ("PUT", "POST") and "epoch_0_step_2" in path else "pass"

    monkeypatch.setattr(s3mod._common, "MAX_ATTEMPTS", 2)
    with _through(s3_server, monkeypatch, rule):
        model, opt, mgr = _setup(f"s3://{bucket}/r3")
        with mgr:
            mgr.save(step=1)
            failing["on"] = True
            start = time.time()
            with pytest.raises(s3mod.S3Error, match=r"s3://.*/r3/epoch_0_step_2/.*SlowDown"):
                mgr.save(step=2)
            assert time.time() - start < 60
    assert "r3/epoch_0_step_2/manifest.json" not in _keys(bucket, "r3/")
    _, _, again = _setup(f"s3://{bucket}/r3")
    with again:
        assert again.restore().step == 1


def _gcs_object(prefix: str):
    """A proxy rule's match: a GCS JSON-API write (upload, delete) of an object whose name starts with ``prefix``
    (the name is in the query of an upload, where the proxy puts a multipart upload's, in the path otherwise,
    URL-encoded either way)."""
    from urllib.parse import quote

    encoded = quote(prefix, safe="")

    def match(method: str, path: str, query: str = "") -> bool:
        return method in ("POST", "PUT", "DELETE") and (f"name={encoded}" in query or f"/o/{encoded}" in path)

    return match


def test_gcs_transient_server_errors_and_dropped_connections_are_retried(gcs_bucket, gcs_server, monkeypatch):
    """The same faults in front of the GCS server: 503s and a dropped connection mid-save are retried by the
    client (ckptio's requests carry its retry policy, writes included) and the checkpoints are exact."""
    hit = _gcs_object("r2/")
    calls = {"n": 0}

    def rule(method: str, path: str, query: str) -> str:
        if not hit(method, path, query):
            return "pass"
        calls["n"] += 1
        return {1: "503", 4: "drop", 7: "503"}.get(calls["n"], "pass")

    with _through(gcs_server, monkeypatch, rule, "STORAGE_EMULATOR_HOST") as proxy:
        model, opt, mgr = _setup(f"gs://{gcs_bucket}/r2")
        with mgr:
            mgr.save(step=1)
            _train(model, opt, 1, 3)
            mgr.save(step=2)
    assert [f[0] for f in proxy.faults] == ["503", "drop", "503"], proxy.faults
    _resumes_exactly(f"gs://{gcs_bucket}/r2", model, 2)


def test_a_gcs_server_that_keeps_failing_fails_the_save_cleanly(gcs_bucket, gcs_server, monkeypatch):
    """Writes of the second step always answered 503 by GCS: the save raises within the retry deadline (2 s here),
    naming the object and the answer; the first checkpoint stays the one a resume takes."""
    from ckptio.storage import gcs

    hit, failing = _gcs_object("r3/epoch_0_step_2/"), {"on": False}
    monkeypatch.setattr(gcs._client, "DEADLINE", 2.0)
    with _through(gcs_server, monkeypatch, lambda m, p, q: "503" if failing["on"] and hit(m, p, q) else "pass",
                  "STORAGE_EMULATOR_HOST"):
        model, opt, mgr = _setup(f"gs://{gcs_bucket}/r3")
        with mgr:
            mgr.save(step=1)
            failing["on"] = True
            start = time.time()
            with pytest.raises(gcs.GCSError, match=r"gs://.*/r3/epoch_0_step_2/.*(503|Timeout)"):
                mgr.save(step=2)
            assert time.time() - start < 60
    assert "r3/epoch_0_step_2/manifest.json" not in _gcs_keys(gcs_bucket, "r3/")
    _, _, again = _setup(f"gs://{gcs_bucket}/r3")
    with again:
        assert again.restore().step == 1


def _gcs_keys(bucket: str, prefix: str) -> dict[str, int]:
    return {o.key: o.size for o in open_storage(f"gs://{bucket}").store.listing(prefix, delimiter=False)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("store", ["s3", "az"], indirect=True)
def test_sigkill_during_saves_to_a_bucket_never_leaves_a_torn_checkpoint(store):
    """2 FSDP2 ranks save to the bucket in a loop with retention; one is SIGKILLed at a random moment (mid-
    upload, mid-commit or mid-delete); every committed checkpoint is whole, the newest and the best survive,
    the next run takes over the dead job's lease and resumes. `tools/fault_injection.py --s3` runs more (S3)."""
    import random

    from test_kill import kill_trial

    rng = random.Random(7)
    mid_write = 0
    for trial in range(3):
        mid_write += kill_trial(store.url(f"kill{trial}"), "safetensors", True, rng)["killed_mid_write"]
    print(f"{store.scheme} kill tally: 3 trials, {mid_write} killed mid-write")


@pytest.mark.slow  # several CLI commands end to end
def test_inspect_and_convert_work_on_bucket_paths(store, tmp_path):
    """``ckptio inspect`` and ``convert`` take step directories in a bucket as sources and a bucket as destination; a
    source whose object was damaged is refused before anything is converted."""
    import json

    from toy import make_model

    model = make_model(seed=6, tie_word_embeddings=False)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=store.url("run")), model=model, rng=False) as mgr:
        mgr.save(step=2)
    step = store.url("run/epoch_0_step_2")
    shown = ckptio_here("inspect", step, "--json", "--tensors")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["step"] == 2 and info["kind"] == "step_dir" and "model.embed_tokens.weight" in info["tensor_list"]
    assert info["states"]["model"]["tensors"]["tensors"] == len(model.state_dict())

    out = ckptio_here("convert", step, str(tmp_path / "hf"), "--to", "hf", "--no-progress")
    assert out.returncode == 0, out.stderr
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    up = ckptio_here("convert", str(tmp_path / "hf"), store.url("exports/step2"), "--to", "step_dir",
                     "--no-progress")
    assert up.returncode == 0, up.stderr
    keys = store.keys("exports/step2/")
    assert "exports/step2/manifest.json" in keys and any(k.endswith(".safetensors") for k in keys)
    again = ckptio_here("convert", str(tmp_path / "hf"), store.url("exports/step2"), "--to", "hf")
    assert again.returncode == 2 and "already exists" in again.stderr

    shard = next(k for k in store.keys("run/epoch_0_step_2/model/") if k.endswith(".safetensors"))
    body = bytearray(store.get(shard))
    body[-1] ^= 0xFF
    store.put(shard, bytes(body))
    bad = ckptio_here("convert", step, str(tmp_path / "hf2"), "--to", "hf")
    assert bad.returncode == 2 and "do not match the manifest" in bad.stderr and "checksum" in bad.stderr
    assert not (tmp_path / "hf2").exists()


def test_a_conditional_write_conflict_is_retried(bucket, s3_server, monkeypatch):
    """Real S3 answers 409 ConditionalRequestConflict to a conditional PUT racing another one on the same key
    and asks for a retry: the manifest's create-only PUT is retried (with its body rewound) and commits."""
    rule = _nth(lambda method, path: method == "PUT" and path.endswith("/c409/epoch_0_step_1/manifest.json"),
                {1: "409", 2: "409"})
    with _through(s3_server, monkeypatch, rule) as proxy:
        model, _, mgr = _setup(f"s3://{bucket}/c409")
        with mgr:
            mgr.save(step=1)
    assert [f[0] for f in proxy.faults] == ["409", "409"], proxy.faults
    _resumes_exactly(f"s3://{bucket}/c409", model, 1)


def test_a_manifest_whose_answer_was_lost_is_not_taken_for_another_writers(bucket, s3_server, monkeypatch):
    """The manifest's create-only PUT lands but its answer is lost (the connection drops once the server has
    written it); the client's retry is refused (412: the object is there). The save tells its own manifest from
    another writer's by its bytes and is committed, not failed as if a second job had committed the step."""
    rule = _nth(lambda method, path: method == "PUT" and path.endswith("/lost/epoch_0_step_1/manifest.json"),
                {1: "lost"})
    with _through(s3_server, monkeypatch, rule) as proxy:
        model, _, mgr = _setup(f"s3://{bucket}/lost")
        with mgr:
            mgr.save(step=1)
    assert [f[0] for f in proxy.faults] == ["lost"], proxy.faults
    _resumes_exactly(f"s3://{bucket}/lost", model, 1)


@pytest.mark.slow  # several CLI commands end to end
def test_consolidate_a_checkpoint_in_a_bucket(bucket, tmp_path):
    """``ckptio consolidate s3://…/step`` adds the bundle to the checkpoint as a new version (manifest replaced
    last, listing and checksumming the bundle: a full verify passes) or writes it into a local --out."""
    import json

    from toy import make_model

    model = make_model(seed=8, tie_word_embeddings=False)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=f"s3://{bucket}/run"), model=model, rng=False) as mgr:
        mgr.save(step=5)
    step = f"s3://{bucket}/run/epoch_0_step_5"
    local = ckptio_here("consolidate", step, "--out", str(tmp_path / "bundle"), "--no-progress")
    assert local.returncode == 0, local.stderr
    inside = ckptio_here("consolidate", step, "--no-progress", "--json")
    assert inside.returncode == 0, inside.stderr
    assert json.loads(inside.stdout)["into_checkpoint"] is True
    keys = _keys(bucket, "run/epoch_0_step_5/model/consolidated/")
    for p in (tmp_path / "bundle").iterdir():
        remote = s3mod.client().get_object(Bucket=bucket, Key=f"run/epoch_0_step_5/model/consolidated/{p.name}")
        assert remote["Body"].read() == p.read_bytes(), p.name
    assert len(keys) == len(list((tmp_path / "bundle").iterdir()))
    verified = ckptio_here("verify", step)
    assert verified.returncode == 0 and "consolidated" in json.dumps(
        json.loads(ckptio_here("inspect", step, "--json").stdout)["files"])
    again = ckptio_here("consolidate", step)
    assert again.returncode == 2 and "already holds a consolidated bundle" in again.stderr
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bundle")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_consolidate_into_a_bucket_checkpoint_in_process(store, capsys):
    """The same command called in this process (a fast test of ``cli/consolidate_remote.py``): the manifest is
    replaced by one that lists and checksums the bundle, and a second consolidate is refused by name."""
    import json

    from toy import make_model

    from ckptio.cli import main
    from ckptio.engine.manifest import check_files, read_manifest
    from ckptio.storage import open_storage

    with CheckpointManager(CheckpointConfig(checkpoint_dir=store.url("fast")), rng=False,
                           model=make_model(seed=9, tie_word_embeddings=False)) as mgr:
        mgr.save(step=3)
    step = store.url("fast/epoch_0_step_3")
    assert main(["consolidate", step, "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["into_checkpoint"] is True
    folder = open_storage(store.url("fast")).folder("epoch_0_step_3")
    manifest = read_manifest(folder)
    bundle = [rel for rel in manifest.files if rel.startswith("model/consolidated/")]
    assert any(rel.endswith(".safetensors") for rel in bundle) and all(rel in manifest.checksums for rel in bundle)
    uploaded = store.keys("fast/epoch_0_step_3/model/consolidated/")
    assert set(bundle) == {k.removeprefix("fast/epoch_0_step_3/") for k in uploaded}
    assert not check_files(folder, manifest, checksums=True)
    assert main(["consolidate", step, "--no-progress"]) == 2
    assert "already holds a consolidated bundle" in capsys.readouterr().err


def test_restore_from_a_step_in_a_bucket_and_a_peft_adapter_there(bucket, tmp_path):
    """``restore_from`` may name a step directory in any bucket folder (a local run starting from it), and a
    PEFT run keeps its adapter checkpoints in a bucket as on a local folder."""
    from toy import make_model

    model, opt, mgr = _setup(f"s3://{bucket}/src")
    with mgr:
        mgr.save(step=7)
    model2, _, other = _setup(str(tmp_path / "local"), restore_from=f"s3://{bucket}/src/epoch_0_step_7")
    torch.manual_seed(1)
    for p in model2.parameters():
        p.data.normal_()
    with other:
        assert other.restore().step == 7
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))

    base = tmp_path / "base"
    peft = make_model(seed=2, peft=True, base_dir=str(base))
    with CheckpointManager(CheckpointConfig(checkpoint_dir=f"s3://{bucket}/lora", is_peft=True), model=peft,
                           base_model_path=str(base), rng=False) as m:
        m.save(step=1)
    assert any(k.endswith("adapter_model.safetensors") for k in _keys(bucket, "lora/"))
    again = make_model(seed=3, peft=True, base_dir=str(tmp_path / "base2"))
    with CheckpointManager(CheckpointConfig(checkpoint_dir=f"s3://{bucket}/lora", is_peft=True), model=again,
                           rng=False) as m:
        assert m.restore().step == 1
    trained = {k: v for k, v in peft.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(again.state_dict()[k], v) for k, v in trained.items())


def test_a_closed_file_larger_than_a_part_goes_up_in_parts(bucket, monkeypatch, tmp_path):
    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    s3mod.upload_file(tmp_path / "f.bin", bucket, "whole/f.bin", "s3://whole/f.bin", if_none_match=True)
    assert s3mod.client().get_object(Bucket=bucket, Key="whole/f.bin")["Body"].read() == data
    assert not s3mod.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_a_step_is_listed_in_one_request_and_a_restore_reads_it_whole(store, monkeypatch):
    """Opening a step lists its objects once, recursively: its folders (DCP's model/, optim/, ...) are listed from
    that answer, not with a request each; what the listing shows is the same, and the restore is exact."""
    model, opt, mgr = _setup(store.url("one"))
    _train(model, opt, 2, seed=1)
    with mgr:
        mgr.save(step=1)
    storage = open_storage(store.url("one"))
    (step,) = [e.name for e in storage.folder().listdir() if e.kind == "dir" and e.name.startswith("epoch_")]
    expected = {k[len(f"one/{step}/"):]: n for k, n in store.keys(f"one/{step}/").items()}
    assert len({rel.rpartition("/")[0] for rel in expected}) >= 2  # folders below the step
    asked = []
    real = type(storage.store).listing

    def counted(self, prefix, *, delimiter):
        asked.append(prefix)
        return real(self, prefix, delimiter=delimiter)

    with monkeypatch.context() as patched:
        patched.setattr(type(storage.store), "listing", counted)
        folder = storage.folder(step)
        assert {rel: e.size for rel, e in folder.walk_files()} == expected
    assert asked == ["one/", f"one/{step}/"], asked  # the checkpoint folder, the step
    model2, opt2, again = _setup(store.url("one"))
    with again:
        assert again.restore() is not None
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_every_upload_carries_the_crc32c_of_its_bytes_for_the_server_to_check(bucket, monkeypatch):
    """The CRC-32C ckptio computes anyway goes along with each request (``x-amz-checksum-crc32c``), in place of the
    CRC-32 boto3 would compute of every request itself: a whole object's is the one of the write pass, a part's its
    own; the server checks it and keeps it."""
    import base64

    from crc32c import crc32c

    def b64(data: bytes) -> str:
        return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()

    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)
    s3 = s3mod.client()
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    writer = open_storage(f"s3://{bucket}/sums").begin_step("s")
    for name, size in (("small.bin", 3 << 20), ("big.bin", len(data))):
        with writer.open(name) as stream:
            stream.write(data[:size])
        assert stream.close() == f"crc32c:{crc32c(data[:size]):08x}"
    got = s3.get_object_attributes(Bucket=bucket, Key="sums/s/small.bin", ObjectAttributes=["Checksum"])
    assert got.get("Checksum", {}).get("ChecksumCRC32C") == b64(data[:3 << 20])
    # in parts (5, 5 and 2 MiB): each part's own CRC-32C, which S3 combines into the object's (a CRC of the CRCs)
    parts = [data[i:i + (5 << 20)] for i in range(0, len(data), 5 << 20)]
    combined = b"".join(crc32c(p).to_bytes(4, "big") for p in parts)
    got = s3.get_object_attributes(Bucket=bucket, Key="sums/s/big.bin", ObjectAttributes=["Checksum"])
    assert got.get("Checksum", {}).get("ChecksumCRC32C", "").split("-")[0] == b64(combined)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("regions", [False, True])
def test_a_part_damaged_in_its_spool_file_after_it_was_written_is_refused(bucket, s3_server, monkeypatch, regions):
    """A part's CRC-32C is the one of the bytes handed to the stream, computed as they are written (each byte's CRC
    computed once; the spool is read once, to send the part), never one read back from the spool: a part whose
    spooled bytes changed after they were written goes with the CRC of the bytes written, and the server, which checks
    a part's body against its CRC (S3; here a proxy that does as S3 does), refuses it; the upload is aborted."""
    from crc32c import crc32c

    from ckptio.storage.regions import RegionedFile

    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    with _through(s3_server, monkeypatch, lambda method, path, query: "check") as proxy:
        writer = open_storage(f"s3://{bucket}/spooled").begin_step("s")
        stream = writer.open("f.bin")
        with pytest.raises(CheckpointError, match="BadDigest") as refused:
            if regions:  # as DCP's writer threads write one file: regions cut across the parts (5, 5, 2 MiB)
                cut = 7 << 20
                file = RegionedFile(stream, [cut, len(data) - cut])
                first, second = file.region(0), file.region(1)
                first.write(data[:cut])
                second.write(data[cut:])
                first.close()
                _flip_byte(stream.path, 11 << 20)  # in the last part, sent when the last region closes
                second.close()
            else:
                stream.write(data)  # two whole parts sent on the way; the last 2 MiB wait for close
                _flip_byte(stream.path, 11 << 20)
                stream.close()
        assert [f[0] for f in proxy.faults] == ["baddigest"], proxy.faults
        assert "spooled/s/f.bin" in str(refused.value), refused.value
        assert "spooled/s/f.bin" not in _keys(bucket, "spooled/")
        assert not s3mod.client().list_multipart_uploads(Bucket=bucket, Prefix="spooled/").get("Uploads")
        with writer.open("g.bin") as stream:  # undamaged, every part's CRC agrees with its body
            stream.write(data)
        assert stream.close() == f"crc32c:{crc32c(data):08x}" and not proxy.faults[1:]
    assert s3mod.client().get_object(Bucket=bucket, Key="spooled/s/g.bin")["Body"].read() == data


def test_an_uploaded_byte_is_hashed_once_for_its_crc32c_and_not_again_for_the_signature(bucket, s3_server, monkeypatch):
    """A request that carries the CRC-32C of its body, which the server checks, goes with an unsigned payload
    (``x-amz-content-sha256: UNSIGNED-PAYLOAD``): the client does not read the body once more for a SHA-256 of it
    (as boto3 does on an ``http://`` endpoint otherwise, and as its own upload with a trailing checksum does not)."""
    monkeypatch.setattr(s3mod._common, "PART_SIZE", 5 << 20)
    data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    with _through(s3_server, monkeypatch, lambda method, path, query: "check") as proxy:
        writer = open_storage(f"s3://{bucket}/signed").begin_step("s")
        for name, size in (("small.bin", 3 << 20), ("big.bin", len(data))):
            with writer.open(name) as stream:
                stream.write(data[:size])
    sent = [(sha, crc) for method, path, sha, crc in proxy.signed if method == "PUT" and path.endswith(".bin") or
            method == "PUT" and "partNumber=" in path]
    assert len(sent) == 4, proxy.signed  # one PUT, three parts
    assert all(crc and sha == "UNSIGNED-PAYLOAD" for sha, crc in sent), sent
    assert not proxy.faults
    assert s3mod.client().get_object(Bucket=bucket, Key="signed/s/big.bin")["Body"].read() == data


@pytest.mark.parametrize("store", ["s3", pytest.param("gs", marks=pytest.mark.slow),
                                   pytest.param("az", marks=pytest.mark.slow)], indirect=True)
def test_latest_and_best_resolve_in_a_bucket_in_every_command(store, tmp_path):
    """Issue 52, row 2: every CLI example uses ``…/LATEST``; in a bucket ``verify`` said "holds no checkpoints" and
    ``inspect`` "no such folder". The pointers resolve there as they do on disk, in every command."""
    import json

    from toy import make_model

    url = store.url("ptr")
    model = make_model(seed=3, tie_word_embeddings=False)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url, monitor="loss"), model=model, rng=False) as mgr:
        mgr.save(step=1, metrics={"loss": 0.5})
        mgr.save(step=2, metrics={"loss": 0.9})
    def run(*args: str) -> subprocess.CompletedProcess:
        done = ckptio_here(*args)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
        return done

    for pointer, step in (("LATEST", 2), ("BEST", 1)):
        assert f"OK   {url}/epoch_0_step_{step}" in run("verify", f"{url}/{pointer}", "--no-progress").stdout
        assert json.loads(run("inspect", f"{url}/{pointer}", "--json").stdout)["step"] == step
    run("convert", f"{url}/BEST", str(tmp_path / "hf"), "--to", "hf", "--no-progress")
    assert (tmp_path / "hf" / "config.json").is_file()
    run("consolidate", f"{url}/LATEST", "--no-progress")
    assert any(k.startswith("ptr/epoch_0_step_2/model/consolidated/") for k in store.keys("ptr/"))


def test_the_runs_record_lives_in_the_bucket_too(store):
    """Issue 49: ``.ckptio_record.json`` beside the steps in the bucket, one PUT per event; a restart reads it back
    through the gate and records its restore."""
    import json

    from ckptio.goodput.record import RECORD_NAME

    url = store.url("runs/rec")
    model, opt, mgr = _setup(url)
    with mgr:
        for step in (1, 2):
            _train(model, opt, 1, step)
            mgr.save(step=step)
    events = json.loads(store.get(f"runs/rec/{RECORD_NAME}"))["events"]
    assert [e["kind"] for e in events] == ["start", "save", "save", "end"]
    assert {e["storage"] for e in events if e["kind"] == "save"} == {store.scheme}
    _, _, again = _setup(url)
    with again:
        assert again.restore().step == 2
    events = json.loads(store.get(f"runs/rec/{RECORD_NAME}"))["events"]
    assert [e["kind"] for e in events][-3:] == ["start", "restore", "end"]
    assert next(e for e in events if e["kind"] == "restore")["step"] == 2
    # `ckptio report` reads it from the bucket (no storage probe there) and draws its page
    import io
    from contextlib import redirect_stdout

    from ckptio.cli import main as cli

    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["report", url, "--json"]) == 0
    data = json.loads(out.getvalue())
    assert [e["step"] for e in data["durable"]] == [1, 2] and data["storage_rate"] is None
    assert [e["step"] for e in data["restores"]] == [2] and len(data["processes"]) == 2


def test_a_flipped_bit_in_a_bucket_is_found_by_a_full_verify_and_the_older_step_loads(store):
    """``verify="full"`` checks every byte read from a bucket too (it once named the files by their printed path,
    ``s3://…``, found none of them among the manifest's, and checked nothing)."""
    url = store.url("flip")
    model, opt, mgr = _setup(url)
    with mgr:
        mgr.save(step=1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, opt, 1, 5)
        mgr.save(step=2)
    key = next(k for k in store.keys("flip/epoch_0_step_2/model/") if k.endswith(".safetensors"))
    data = bytearray(store.get(key))
    data[-3] ^= 0x01
    store.put(key, bytes(data))
    model2, _, again = _setup(url, verify="full")
    with again:
        info = again.restore()
    assert info is not None and info.step == 1  # step 2's damage was found, and step 1 loaded instead
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    model3, _, direct = _setup(url, verify="full")
    with direct, pytest.raises(CheckpointError, match=key.rsplit("/", 1)[-1]):
        direct.restore(f"{url}/epoch_0_step_2")


def test_restore_from_a_buckets_latest_or_best(bucket, tmp_path):
    """Issue 71, row 9: ``restore_from='s3://bucket/run1/LATEST'`` was refused ("not a directory"), while ``inspect``
    and ``verify`` take it. A script restores through the pointer, from the bucket's own folder and from elsewhere."""
    from test_errors import restore_through_pointer

    url = f"s3://{bucket}/run1"
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url, monitor="loss"), model=torch.nn.Linear(4, 4)) as mgr:
        mgr.save(step=5, metrics={"loss": 0.5})
        mgr.save(step=10, metrics={"loss": 0.9})
    assert restore_through_pointer(url, f"{url}/LATEST", tmp_path) == "restored step 10"
    assert restore_through_pointer(str(tmp_path / "local"), f"{url}/BEST", tmp_path) == "restored step 5"


_NO_BUCKET_SCRIPT = """
import sys, torch
from ckptio import CheckpointConfig, CheckpointManager, StepScheduler
model = torch.nn.Linear(4, 4)
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=sys.argv[1]), model=model,
                        optimizer=torch.optim.AdamW(model.parameters()), step_scheduler=StepScheduler(max_steps=2))
print("made", flush=True)
mgr.restore()
"""


def test_a_bucket_that_does_not_exist_is_named_as_such(bucket, tmp_path):
    """Issue 71, row 14: a run into ``s3://<no such bucket>/run1`` ended in a traceback whose last line was
    ``NoSuchBucket`` (after a warning that the run's record was "refused"). A ckptio error when the manager is made,
    saying the bucket must exist; every command says the same."""
    import os

    missing = f"{bucket}-missing"
    out = subprocess.run([sys.executable, "-c", _NO_BUCKET_SCRIPT, f"s3://{missing}/run1"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1 and "made" not in out.stdout and "record" not in out.stdout + out.stderr, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptio.storage.s3._common.S3Error: s3://" + missing + "/run1: the bucket"), last
    assert f"{missing!r} does not exist" in last and "never creates one" in last, last
    for args in (["list", f"s3://{missing}/run1"], ["verify", f"s3://{missing}/run1/LATEST"]):
        done = ckptio_here(*args)
        assert done.returncode == 2 and f"the bucket {missing!r} does not exist" in done.stderr, (args, done.stderr)


def test_a_gcs_bucket_that_does_not_exist_is_named_when_the_manager_is_made(gcs_bucket):
    """The same on GCS: a manager made to train into ``gs://<no such bucket>/run1`` is refused when it is made, by a
    ckptio error saying the bucket must exist, before anything is trained or recorded."""
    import os

    missing = f"{gcs_bucket}-missing"
    out = subprocess.run([sys.executable, "-c", _NO_BUCKET_SCRIPT, f"gs://{missing}/run1"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1 and "made" not in out.stdout, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptio.storage.gcs._client.GCSError: gs://" + missing + "/run1: the bucket"), last
    assert f"{missing!r} does not exist" in last and "never creates one" in last, last


def test_a_restore_lists_the_folder_and_its_step_once_and_reads_no_byte_twice(store, monkeypatch):
    """One restore (the manager's choice of step, its manifest, the states, the record of what it resumed from) asks
    the store for the checkpoint folder's listing once, for the step's once, and for no byte of an object twice: the
    folders it opens share what was listed and read (each request costs the client more CPU than a MB of data)."""
    model, opt, mgr = _setup(store.url("once"))
    _train(model, opt, 2, seed=1)
    with mgr:
        mgr.save(step=1)
    model2, opt2, again = _setup(store.url("once"), verify="full")
    storage = again.storage
    listed, read = [], []
    kind = type(storage.store)
    real_listing, real_read = kind.listing, kind.read_into

    def listing(self, prefix, *, delimiter):
        listed.append(prefix)
        return real_listing(self, prefix, delimiter=delimiter)

    def read_into(self, key, offset, view):
        read.append((key, offset, view.nbytes))
        return real_read(self, key, offset, view)

    with again, monkeypatch.context() as patched:
        patched.setattr(kind, "listing", listing)
        patched.setattr(kind, "read_into", read_into)
        assert again.restore() is not None
    assert sorted(listed) == ["once/", "once/epoch_0_step_1/"], listed
    for key in {k for k, _, _ in read}:
        spans = sorted((o, o + n) for k, o, n in read if k == key)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (key, read)
    assert [k for k, _, _ in read].count("once/epoch_0_step_1/manifest.json") == 1, read
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def _python_calls(fn) -> int:
    """The Python function calls ``fn()`` makes on this thread (C calls not counted)."""
    import sys

    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_large_read_goes_into_its_buffer_in_a_few_pieces(store):
    """A ranged read of 15 MiB (one request on each store) costs the client hardly more Python calls than one of
    1 KiB: its body is read into the caller's buffer in pieces of MiBs, not 8 KB at a time with a Python write each
    (GCS's download did: ~17,000 writes for a 140 MB file) nor 256 KiB at a time through Azure's stream generator."""
    data = torch.randint(0, 256, (15 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).numpy()
    store.put("big.bin", data.tobytes())
    small, large = bytearray(1 << 10), bytearray(len(data) - 7)
    store.raw.read_into("big.bin", 7, memoryview(small))  # the client and its connection made, before the count
    # the fewest of three of each: a connection the server closed in between is made again inside one of them
    base = min(_python_calls(lambda: store.raw.read_into("big.bin", 7, memoryview(small))) for _ in range(3))
    extra = min(_python_calls(lambda: store.raw.read_into("big.bin", 7, memoryview(large))) for _ in range(3)) - base
    assert bytes(small) == data[7:7 + len(small)].tobytes() and bytes(large) == data[7:].tobytes()
    assert extra < 600, f"a 15 MiB read made {extra} more Python calls than a 1 KiB one"


def test_a_save_makes_only_the_requests_its_guarantees_need(store, monkeypatch):
    """The requests of two saves in one manager (each costs the client more CPU than a MB of data): the folder is
    listed once per manager (the sweep of leftovers, which also shows nothing is under the first step's name), a step
    at most once (what was under its name, before, unless the sweep's listing showed it; the commit takes every
    rank's files from their writers, where it listed the step again: tests/test_commit_reports.py); no folder scan without a retention rule to apply, no lookup or server-side copy of DCP's
    ``.metadata`` (written whole under its name), no object written twice but the record (its ``start`` and ``save``,
    then its ``end``) and the ``LATEST`` pointer (once a save)."""
    model, opt, mgr = _setup(store.url("few"))
    kind = type(mgr.storage.store)
    calls: list[tuple[str, str]] = []
    with monkeypatch.context() as patched:
        for name in ("listing", "head", "put", "get", "read_into", "delete", "copy", "upload_file", "open_stream"):
            patched.setattr(kind, name, _counted(kind, name, calls))
        with mgr:
            for step in (1, 2):
                _train(model, opt, 1, seed=step)
                mgr.save(step=step)
    listed = [key for name, key in calls if name == "listing"]
    assert listed == ["few/", "few/epoch_0_step_2/"], listed  # the sweep's look at the folder; then the second step's
    assert not [c for c in calls if c[0] in ("head", "copy", "upload_file")], calls
    written = [key for name, key in calls if name == "put"]
    step = "few/epoch_0_step_{}/"
    assert sorted(written) == sorted(["few/.ckptio.lock", *(step.format(s) + p for s in (1, 2)
                                                              for p in (".ckptio-pending", "manifest.json")),
                                      "few/LATEST", "few/LATEST", *["few/.ckptio_record.json"] * 3]), written
    assert [key for name, key in calls if name == "delete"] == [
        step.format(1) + ".ckptio-pending", step.format(2) + ".ckptio-pending", "few/.ckptio.lock"], calls
    assert not [c for c in calls if c[0] in ("get", "read_into")], calls
    model2, opt2, again = _setup(store.url("few"), verify="full")
    with again:
        assert again.restore().step == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_a_save_looks_the_environments_proxies_up_once_per_client_not_per_request(store, monkeypatch):
    """GCS's and Azure's clients send through ``requests``, which looks the proxies up in the environment at every
    request (~1.5 ms of CPU each): ckptio's clients look them up once, when made. A proxy the environment names is
    still honoured: one for another host (NO_PROXY exempts the loopback server) changes nothing."""
    if store.scheme == "s3":
        pytest.skip("boto3 sends through urllib3, reading its proxies once per client")
    import requests.utils

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    looked: list[int] = []
    real = requests.utils.should_bypass_proxies

    def should_bypass_proxies(url, no_proxy):
        looked.append(1)
        return real(url, no_proxy)

    monkeypatch.setattr(requests.utils, "should_bypass_proxies", should_bypass_proxies)
    model, opt, mgr = _setup(store.url("env"))
    with mgr:
        mgr.save(step=1)
    assert len(looked) <= 2, len(looked)
    assert "env/epoch_0_step_1/manifest.json" in store.keys("env/")


def _http_requests(monkeypatch) -> list[tuple[str, str]]:
    """(method, path) of every HTTP request any of the three clients sends from now on (they all send through
    urllib3's connection pools: boto3, and requests under google-cloud-storage and azure-storage-blob)."""
    from urllib3.connectionpool import HTTPConnectionPool

    sent: list[tuple[str, str]] = []
    real = HTTPConnectionPool.urlopen

    def urlopen(self, method, url, *args, **kwargs):
        sent.append((method, url))
        return real(self, method, url, *args, **kwargs)

    monkeypatch.setattr(HTTPConnectionPool, "urlopen", urlopen)
    return sent


def test_a_restore_fetches_a_safetensors_file_in_at_most_two_requests(store, monkeypatch):
    """The header's length and the header are one request (the first bytes of the file), the data another: not
    three, each costing the client more CPU than a MB of data (a 4-rank restore reads a file on every rank)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))  # ~2 MB: beyond the head
    with CheckpointManager(CheckpointConfig(checkpoint_dir=store.url("st")), model=model) as mgr:
        mgr.save(step=1)
    model2 = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))
    names = [k.rsplit("/", 1)[-1] for k in store.keys("st/epoch_0_step_1/") if k.endswith(".safetensors")]
    with CheckpointManager(CheckpointConfig(checkpoint_dir=store.url("st"), verify="full"), model=model2) as again:
        with monkeypatch.context() as patched:
            sent = _http_requests(patched)
            assert again.restore() is not None
    assert names
    for name in names:
        gets = [url for method, url in sent if method == "GET" and name in url]
        assert 1 <= len(gets) <= 2, (name, gets)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_a_request_reads_no_proxy_setting_from_the_environment_and_a_proxy_set_is_used(store, monkeypatch):
    """The client looks the environment's proxy up once, not at every request (``requests`` scans the whole
    environment at each, with ``trust_env``: ~6% of a restore's CPU); a proxy set in the environment is still used."""
    import requests.sessions

    model, opt, mgr = _setup(store.url("env"))
    with mgr:
        mgr.save(step=1)
    looked = []
    real = requests.sessions.get_environ_proxies
    _, _, again = _setup(store.url("env"))
    with again, monkeypatch.context() as patched:
        patched.setattr(requests.sessions, "get_environ_proxies", lambda *a, **k: looked.append(a) or real(*a, **k))
        assert again.restore() is not None
    assert looked == []
    if store.scheme == "s3":
        return  # boto3's client, made before, keeps its proxies; its requests do not go through requests
    from ckptio.errors import CheckpointError
    from ckptio.storage import azure, gcs

    monkeypatch.setattr(azure._client, "RETRIES", 0)  # a new client (part of its key), failing at once
    monkeypatch.setattr(gcs._client, "DEADLINE", 0.5)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CheckpointError, match="(?i)proxy|connect"):
        open_storage(store.url("env")).store.get("env/LATEST", 100)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert open_storage(store.url("env")).store.get("env/LATEST", 100)[0]
