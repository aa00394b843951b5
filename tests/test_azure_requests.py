"""The Azure backend's small requests (``Put Blob``, ``Delete Blob``, ``Get Blob Properties``), sent by hand through
the client's pipeline (src/ckptio/storage/azure/_request.py): the same conditions, names, answers and errors as the
client's own calls, against Azurite on 127.0.0.1 (tests/azuriteserver.py)."""

from __future__ import annotations

import pytest
import torch

from ckptio.errors import CheckpointNotFoundError
from ckptio.storage import open_storage
from test_azure import _account, _through

pytest.importorskip("azure.storage.blob")

NAMES = ["plain.bin", "a b/c d.json", "per%25cent/100%", "hash#and?query&amp=1", "plus+tilde~/colon:x",
         "unicodé/名前/ünï", "semi;comma,eq=", "[brackets]/'quote'/\"dq\""]


def _bucket(container: str):
    return open_storage(f"az://{container}").store


def test_the_small_requests_of_a_save_make_no_blob_client(azure_container, monkeypatch):
    """A small write, a conditional one, a lookup, a removal and a part sent in one request cost no ``BlobClient``
    (each made one, with its generated client and serializer: a quarter of such a request's CPU)."""
    from azure.storage.blob import BlobClient

    made = []
    init = BlobClient.__init__

    def counting(self, *args, **kwargs):
        made.append(args[:3])
        init(self, *args, **kwargs)

    monkeypatch.setattr(BlobClient, "__init__", counting)
    bucket = _bucket(azure_container)
    bucket.put("k/a", b"one")
    bucket.put("k/b", b"two", if_absent=True)
    bucket.put("k/a", b"three", if_token=bucket.head("k/a").token)
    bucket.delete("k/b")
    bucket.get("k/a", 10)
    bucket.listing("k/", delimiter=True)
    writer = open_storage(f"az://{azure_container}/run").begin_step("s")
    with writer.open("f.bin") as stream:
        stream.write(b"x" * 1000)
    assert made == []
    assert bucket.get("k/a", 100)[0] == b"three" and bucket.head("k/b") is None


def test_conditions_and_answers_are_mapped_as_the_clients_calls_map_them(azure_container):
    """``If-None-Match: *`` on an existing blob and ``If-Match`` of an older version are refused as
    :class:`AzurePreconditionFailed` naming the blob; a lookup of a missing blob is ``None``, its removal nothing, its
    read :class:`CheckpointNotFoundError`; a lookup gives what the client's own ``get_blob_properties`` gives, a read
    the first bytes (of an empty blob: none) and the ETag a lookup gives."""
    from ckptio.storage import azure

    bucket = _bucket(azure_container)
    bucket.put("c/x", b"first", if_absent=True)
    first = bucket.head("c/x")
    with pytest.raises(azure.AzurePreconditionFailed, match=rf"writing az://{azure_container}/c/x failed: 409 "
                                                              "BlobAlreadyExists"):
        bucket.put("c/x", b"second", if_absent=True)
    bucket.put("c/x", b"second!", if_token=first.token)
    with pytest.raises(azure.AzurePreconditionFailed, match=rf"az://{azure_container}/c/x failed: 412 "
                                                              "ConditionNotMet"):
        bucket.put("c/x", b"third", if_token=first.token)
    now = bucket.head("c/x")
    props = azure.client().get_blob_client(azure_container, "c/x").get_blob_properties()
    assert (now.key, now.size, now.token) == ("c/x", 7, props.etag) != (first.key, first.size, first.token)
    assert now.mtime == props.last_modified.timestamp()
    assert bucket.get("c/x", 3) == (b"sec", now.token) and bucket.get("c/x", 100) == (b"second!", now.token)
    bucket.put("c/empty", b"")
    assert bucket.get("c/empty", 10) == (b"", bucket.head("c/empty").token) and bucket.head("c/empty").size == 0
    assert bucket.head("c/missing") is None
    bucket.delete("c/missing")
    bucket.delete("c/x")
    assert bucket.head("c/x") is None
    with pytest.raises(CheckpointNotFoundError):
        bucket.get("c/x", 10)


def test_names_are_quoted_as_the_client_quotes_them(azure_container):
    """Names with spaces, ``%``, ``#``, ``?``, ``+``, ``~``, non-ASCII letters... are written, looked up, listed and
    removed as those exact names (the URL is the one ``BlobClient`` makes)."""
    from ckptio.storage import azure
    from ckptio.storage.azure import _request

    bucket = _bucket(azure_container)
    container = azure.client().get_container_client(azure_container)
    for i, name in enumerate(NAMES):
        assert _request.blob_url(container, name) == container.get_blob_client(name).url
        bucket.put(name, bytes([i]) * (i + 1))
        assert bucket.head(name).size == i + 1
        assert container.get_blob_client(name).download_blob().readall() == bytes([i]) * (i + 1)
    assert sorted(o.key for o in bucket.listing("", delimiter=False)[0]) == sorted(NAMES)
    for name in NAMES:
        bucket.delete(name)
    assert bucket.listing("", delimiter=False)[0] == []


def test_a_sas_tokens_url_keeps_its_query_after_the_name(azure_container, azure_server, monkeypatch):
    """With a SAS token the blob's URL is the name then the token's query, as ``BlobClient`` makes it."""
    from datetime import datetime, timedelta, timezone

    import azuriteserver
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from ckptio.storage import azure
    from ckptio.storage.azure import _request

    sas = generate_container_sas(azuriteserver.ACCOUNT, azure_container, account_key=azuriteserver.KEY,
                                 permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True,
                                                                    create=True),
                                 expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server,
             AZURE_STORAGE_SAS_TOKEN=sas)
    container = azure.client().get_container_client(azure_container)
    assert _request.blob_url(container, "a b/c") == container.get_blob_client("a b/c").url
    assert "?" in container.get_blob_client("a b/c").url
    bucket = _bucket(azure_container)
    bucket.put("a b/c", b"sas", if_absent=True)
    assert bucket.head("a b/c").size == 3
    bucket.delete("a b/c")
    assert bucket.head("a b/c") is None


def test_failures_name_the_blob_and_the_answer(azure_container, azure_server, monkeypatch):
    """A missing container is named as such (not a missing blob); wrong credentials are a 403 with the hint; an
    answer the server keeps failing (503) or a conflict that is no condition (409 ConditionalRequestConflict, its
    code in the body) is an :class:`AzureError` naming the blob, not a failed condition."""
    import azuriteserver

    from ckptio.storage import azure

    gone = _bucket(f"{azure_container}-gone")
    for call in (lambda: gone.put("k", b"x"), lambda: gone.delete("k"), lambda: gone.put("k", b"x", if_absent=True),
                 lambda: gone.listing("", delimiter=True)):
        with pytest.raises(azure.AzureError, match="the container .* does not exist"):
            call()
    faults = {"path": None, "action": "pass"}

    def rule(method: str, path: str, query: str) -> str:
        return faults["action"] if path.endswith(f"/{azure_container}/f/x") else "pass"

    with _through(azure_server, monkeypatch, rule, retries=0) as proxy:
        bucket = _bucket(azure_container)
        for action, code in (("503", "503 SlowDown"), ("409", "409 ConditionalRequestConflict")):
            faults["action"] = action
            for call in (lambda: bucket.put("f/x", b"x", if_absent=True), lambda: bucket.delete("f/x"),
                         lambda: bucket.get("f/x", 10)):
                with pytest.raises(azure.AzureError, match=rf"az://{azure_container}/f/x failed: {code}") as got:
                    call()
                assert not isinstance(got.value, azure.AzurePreconditionFailed)
        assert len(proxy.faults) == 6
    _account(monkeypatch, azure_server, AZURE_STORAGE_CONNECTION_STRING=azuriteserver.connection_string(
        azure_server).replace(azuriteserver.KEY, "d3Jvbmc=" * 11))
    bucket = _bucket(azure_container)
    for call in (lambda: bucket.put("f/y", b"x"), lambda: bucket.head("f/y"), lambda: bucket.delete("f/y"),
                 lambda: bucket.get("f/y", 10),
                 lambda: bucket.listing("f/y", delimiter=False)):
        with pytest.raises(azure.AzureError, match=rf"az://{azure_container}/f/y failed: 403 .*credentials"):
            call()


def test_a_listing_reads_every_page_and_gives_what_the_client_lists(azure_container, monkeypatch):
    """A listing (by hand: the client's models cost ~0.25 ms of CPU a blob) goes through every page, splits names
    from prefixes at a ``/``, takes prefixes with any character literally, and gives each blob's size, time and ETag
    as the client's own listing and lookup give them."""
    from ckptio.storage import azure
    from ckptio.storage.azure import _request

    monkeypatch.setattr(_request, "PAGE", 2)
    bucket = _bucket(azure_container)
    for i, name in enumerate(NAMES):
        bucket.put(f"p+ü %/{name}", bytes(i))
    bucket.put("p+ü %", b"not under the prefix")
    bucket.put("p+x/other", b"")
    listed, prefixes = bucket.listing("p+ü %/", delimiter=False)
    assert prefixes == [] and [o.key for o in listed] == sorted(f"p+ü %/{n}" for n in NAMES)
    client = {b.name: b for b in azure.client().get_container_client(azure_container).list_blobs("p+ü %/")}
    for obj in listed:
        assert (obj.size, obj.mtime, obj.token) == (client[obj.key].size, client[obj.key].last_modified.timestamp(),
                                                    bucket.head(obj.key).token)
    top, dirs = bucket.listing("p+ü %/", delimiter=True)
    assert [o.key for o in top] == sorted(f"p+ü %/{n}" for n in NAMES if "/" not in n)
    assert dirs == sorted({f"p+ü %/{n.split('/')[0]}/" for n in NAMES if "/" in n})
    assert bucket.listing("p+ü %/nothing", delimiter=True) == ([], [])
    assert [o.key for o in bucket.listing("p+", delimiter=True)[0]] == ["p+ü %"]
    assert bucket.listing("p+", delimiter=True)[1] == ["p+x/", "p+ü %/"]


def _blob_clients(monkeypatch) -> list:
    """The ``BlobClient``s made from now on (the class's own ``__init__`` runs: each is a real client)."""
    from azure.storage.blob import BlobClient

    made: list = []
    init = BlobClient.__init__

    def counting(self, *args, **kwargs):
        made.append(args[:3])
        init(self, *args, **kwargs)

    monkeypatch.setattr(BlobClient, "__init__", counting)
    return made


def test_a_read_a_local_files_upload_and_the_containers_lookup_make_no_blob_client(azure_container, monkeypatch,
                                                                                 tmp_path):
    """A restore's ranged read, a save's upload of a file of its local folder (a model's ``config.json``) and the
    lookup of the container go through the module's requests as the rest (each made a ``BlobClient``, or ran the
    generated client: ~0.5 ms of CPU a request), with the same answers: the bytes from an offset, a create-only
    upload refused naming the blob, a missing container told apart."""
    from ckptio.storage import azure

    made = _blob_clients(monkeypatch)
    bucket = _bucket(azure_container)
    data = bytes(range(256)) * 40
    bucket.put("r/a", data)
    view = memoryview(bytearray(1000))
    assert bucket.read_into("r/a", 7, view) == 1000 and bytes(view) == data[7:1007]
    local = tmp_path / "config.json"
    local.write_bytes(b'{"hidden_size": 8}')
    bucket.upload_file(local, "r/config.json", if_absent=True)
    with pytest.raises(azure.AzurePreconditionFailed, match=rf"uploading az://{azure_container}/r/config.json "
                                                              rf"failed: 409 BlobAlreadyExists"):
        bucket.upload_file(local, "r/config.json", if_absent=True)
    local.write_bytes(b"")
    bucket.upload_file(local, "r/empty")
    assert bucket.exists() and not azure.AzureBucket(f"{azure_container}-missing").exists()
    assert made == []
    assert bucket.get("r/config.json", 100)[0] == b'{"hidden_size": 8}' and bucket.head("r/empty").size == 0


SAVE_REQUESTS = {"HEAD": 1, "GET": 2, "PUT": 13, "DELETE": 2}
"""A 1-rank save of a small state in a new folder: the container looked up; 2 listings (the commit takes the step's
files from what the writers made, not a third listing); 13 puts (the lease, the
in-progress mark, the files, the chunk indexes, the run record, the manifest, the pointer); the mark and the
lease removed."""


def test_every_request_of_a_save_and_a_restore_runs_through_the_containers_one_pipeline(azure_container,
                                                                                        monkeypatch):
    """A save (a new manager in a new folder: the container's lookup, the lease, the files, the manifest, the
    pointers) and a restore on Azure send every request through the container's pipeline, as :mod:`._request`
    builds it (a ``BlobClient``'s pipeline is another: per blob, its own policies' objects and generated client);
    counted at the pipeline, which still sends each. The requests a save sends, by method: what this test pins (a
    change of the protocol's requests shows here first)."""
    from collections import Counter

    import test_s3 as contract
    from azure.core.pipeline import Pipeline
    from azure.storage.blob import ContainerClient

    runs: list[tuple[int, str]] = []
    real = Pipeline.run

    def run(self, request, **kwargs):
        runs.append((id(self), request.method))
        return real(self, request, **kwargs)

    containers: set[int] = set()  # the pipelines of the ContainerClients made (each AzureBucket makes one)
    init = ContainerClient.__init__

    def made(self, *args, **kwargs):
        init(self, *args, **kwargs)
        containers.add(id(self._pipeline))

    monkeypatch.setattr(Pipeline, "run", run)
    monkeypatch.setattr(ContainerClient, "__init__", made)
    url = f"az://{azure_container}/pinned"
    model, opt, mgr = contract._setup(url)
    with mgr:
        mgr.save(step=1)
    saved = Counter(method for _, method in runs)
    model2, opt2, again = contract._setup(url)
    with again:
        assert again.restore() is not None
    assert runs and {pipeline for pipeline, _ in runs} <= containers, "a request went through a BlobClient's pipeline"
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert dict(saved) == SAVE_REQUESTS, dict(saved)

