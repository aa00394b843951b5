"""The Azure backend's own behaviour, beyond the object-store contract tests that run on it through the ``store``
fixture (tests/test_s3.py and the others): credentials as Azure users set them, ``abfs://``, a container that does
not exist, and faults in front of the server — against Azurite on 127.0.0.1 (tests/azuriteserver.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
import torch

import test_s3 as contract
from cli_here import ckptio_here
from ckptio import committed_checkpoints
from ckptio.storage import open_storage

pytest.importorskip("azure.storage.blob")


def _account(monkeypatch, azure_server: str, **env: str) -> None:
    """The settings ``env`` alone (every other Azure variable unset), for a client made afresh."""
    from ckptio.storage import azure

    for name in azure._client._ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_an_account_url_with_its_key_or_a_sas_token(azure_container, azure_server, monkeypatch):
    """Without a connection string: the account's URL with its key (the ``az`` CLI's variable names), then a SAS
    token the key signed; each saves, resumes, and copies server-side (a copy's source is authorised by the SAS)."""
    from datetime import datetime, timedelta, timezone

    import azuriteserver
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server,
             AZURE_STORAGE_ACCOUNT=azuriteserver.ACCOUNT, AZURE_STORAGE_KEY=azuriteserver.KEY)
    url = f"az://{azure_container}/keyed"
    model, opt, mgr = contract._setup(url)
    with mgr:
        mgr.save(step=1)
    sas = generate_account_sas(azuriteserver.ACCOUNT, azuriteserver.KEY, ResourceTypes(object=True, container=True),
                               AccountSasPermissions(read=True, write=True, delete=True, list=True, create=True),
                               expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server, AZURE_STORAGE_SAS_TOKEN="?" + sas)
    storage = open_storage(url)
    storage.store.copy("keyed/epoch_0_step_1/manifest.json", "copied/manifest.json")
    assert storage.store.get("copied/manifest.json", 1 << 20)[0] == \
        storage.store.get("keyed/epoch_0_step_1/manifest.json", 1 << 20)[0]
    model2, _, again = contract._setup(url, verify="full")
    with again:
        assert again.restore().step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_missing_or_wrong_credentials_are_named(azure_container, azure_server, monkeypatch):
    from ckptio.storage.azure import AzureError

    _account(monkeypatch, azure_server)
    with pytest.raises(AzureError, match="AZURE_STORAGE_CONNECTION_STRING.*AZURE_STORAGE_ACCOUNT_NAME"):
        open_storage(f"az://{azure_container}/run").folder().listdir()
    # an account without a key: DefaultAzureCredential, which needs azure-identity (made missing here: named)
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server)
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    with pytest.raises(AzureError, match=r"install azure-identity for DefaultAzureCredential.*ckptio\[azure\]"):
        open_storage(f"az://{azure_container}/run").folder().listdir()
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server,
             AZURE_STORAGE_ACCOUNT_NAME="devstoreaccount1", AZURE_STORAGE_ACCOUNT_KEY="d3Jvbmcga2V5")  # "wrong key"
    with pytest.raises(AzureError, match=rf"listing az://{azure_container}/run failed: 403 .*check the account's credentials"):
        open_storage(f"az://{azure_container}/run").folder().listdir()


def test_an_abfs_location_is_the_same_folder_and_printed_as_given(azure_container):
    model, opt, mgr = contract._setup(f"abfs://{azure_container}/run")
    with mgr:
        mgr.save(step=1)
    (entry,) = committed_checkpoints(f"az://{azure_container}/run")
    assert entry.step == 1
    assert str(open_storage(f"abfs://{azure_container}/run/LATEST").root) == f"abfs://{azure_container}/run/" \
        f"{entry.name}"


def test_a_location_naming_its_account_as_fsspec_does(azure_container, azure_server, monkeypatch):
    """``abfs://container@account.dfs.core.windows.net/path`` (and ``.blob.``, and ``az://``): the same folder as
    ``az://container/path`` when the credentials are that account's (a connection string, or the account's key),
    printed as given; credentials of another account are refused naming both."""
    import azuriteserver

    from ckptio.errors import ConfigError

    account = azuriteserver.ACCOUNT
    named = f"abfs://{azure_container}@{account}.dfs.core.windows.net/run"
    model, opt, mgr = contract._setup(named)
    with mgr:
        mgr.save(step=1)
    (entry,) = committed_checkpoints(f"az://{azure_container}/run")
    assert str(open_storage(f"{named}/LATEST").root) == f"{named}/{entry.name}"
    # the account's key alone, its name from the location (the endpoint: Azurite's, not <account>.blob...)
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server,
             AZURE_STORAGE_ACCOUNT_KEY=azuriteserver.KEY)
    model2, _, again = contract._setup(f"az://{azure_container}@{account}.blob.core.windows.net/run", verify="full")
    with again:
        assert again.restore().step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    _account(monkeypatch, azure_server, AZURE_STORAGE_CONNECTION_STRING=azuriteserver.connection_string(azure_server))
    with pytest.raises(ConfigError, match=f"names the storage account 'other1' but AZURE_STORAGE_CONNECTION_STRING "
                                          f"is for the account '{account}'"):
        committed_checkpoints(f"abfs://{azure_container}@other1.dfs.core.windows.net/run")


def test_an_account_without_a_key_uses_default_azure_credential(azure_container, azure_server, monkeypatch):
    """No connection string, key or SAS token: the account's requests carry a token of ``DefaultAzureCredential``
    (azure-identity, installed here), for the account the settings or the location name. A token is never sent over
    plain HTTP (Azurite's): that is refused by name, not with a traceback."""
    pytest.importorskip("azure.identity")
    from azure.identity import DefaultAzureCredential

    from ckptio.storage import azure

    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_NAME="someaccount")
    made = azure.client()
    assert isinstance(made.credential, DefaultAzureCredential) and made.account_name == "someaccount"
    assert made.url == "https://someaccount.blob.core.windows.net/"
    _account(monkeypatch, azure_server)  # the account named in the location only
    assert isinstance(azure.client("other1").credential, DefaultAzureCredential)
    # Azurite speaks HTTP, over which the client sends no token: refused by name, before any request
    _account(monkeypatch, azure_server, AZURE_STORAGE_ACCOUNT_URL=azure_server)
    with pytest.raises(azure.AzureError, match=rf"{azure_server} cannot be used: Token credential is only supported "
                                               "with HTTPS"):
        committed_checkpoints(f"az://{azure_container}/run")


def test_a_container_that_does_not_exist_is_named_when_the_manager_is_made(azure_container):
    missing = f"{azure_container}-missing"
    out = subprocess.run([sys.executable, "-c", contract._NO_BUCKET_SCRIPT, f"az://{missing}/run1"],
                         capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ckptio.storage.azure._client.AzureError: az://{missing}/run1: the container"), last
    assert "never creates one" in last
    for args in (["list", f"az://{missing}/run1"], ["verify", f"az://{missing}/run1/LATEST"]):
        done = ckptio_here(*args)
        assert done.returncode == 2 and f"the container {missing!r} does not exist" in done.stderr, (args, done.stderr)


@contextlib.contextmanager
def _through(azure_server: str, monkeypatch, rule, retries: int):
    """The client talks to Azurite through the contract tests' faulty proxy applying ``rule`` inside the block, and
    tries a request ``retries`` more times."""
    import azuriteserver

    from ckptio.storage import azure

    monkeypatch.setattr(azure._client, "RETRIES", retries)
    proxy = contract._FaultyProxy(azure_server, rule)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       azuriteserver.connection_string(f"{proxy.url}/{azuriteserver.ACCOUNT}"))
    try:
        yield proxy
    finally:
        proxy.close()
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azuriteserver.connection_string(azure_server))


@pytest.mark.slow  # the client's backoff between tries
def test_transient_server_errors_and_dropped_connections_are_retried(azure_container, azure_server, monkeypatch):
    """503s (Azure's 'ServerBusy') and a dropped connection mid-save are retried by the client, writes included, and
    the checkpoints are exact."""
    rule = contract._nth(lambda method, path: method == "PUT" and "/r2/" in path, {1: "503", 4: "drop", 7: "503"})
    with _through(azure_server, monkeypatch, rule, retries=3) as proxy:
        model, opt, mgr = contract._setup(f"az://{azure_container}/r2")
        with mgr:
            mgr.save(step=1)
            contract._train(model, opt, 1, 3)
            mgr.save(step=2)
    assert [f[0] for f in proxy.faults] == ["503", "drop", "503"], proxy.faults
    contract._resumes_exactly(f"az://{azure_container}/r2", model, 2)


def test_a_server_that_keeps_failing_fails_the_save_cleanly(azure_container, azure_server, monkeypatch):
    """Writes of the second step always answered 503: the save raises once the client's tries are spent (1 here),
    naming the blob and the answer; the first checkpoint stays the one a resume takes."""
    from ckptio.storage.azure import AzureError

    failing = {"on": False}

    def rule(method: str, path: str, query: str) -> str:
        return "503" if failing["on"] and method == "PUT" and "/r3/epoch_0_step_2/" in path else "pass"

    with _through(azure_server, monkeypatch, rule, retries=1):
        model, opt, mgr = contract._setup(f"az://{azure_container}/r3")
        with mgr:
            mgr.save(step=1)
            failing["on"] = True
            start = time.time()
            with pytest.raises(AzureError, match=rf"az://{azure_container}/r3/epoch_0_step_2/.* 503"):
                mgr.save(step=2)
            assert time.time() - start < 60
    assert not any(o.key.endswith("epoch_0_step_2/manifest.json") for o in open_storage(
        f"az://{azure_container}").store.listing("r3/", delimiter=False)[0])
    _, _, again = contract._setup(f"az://{azure_container}/r3")
    with again:
        assert again.restore().step == 1


def test_a_manifest_whose_answer_was_lost_is_not_taken_for_another_writers(azure_container, azure_server, monkeypatch):
    """The manifest's create-only upload lands but its answer is lost; the client's retry is refused (409
    BlobAlreadyExists). The save tells its own manifest from another writer's by its bytes and is committed."""
    rule = contract._nth(lambda method, path: method == "PUT" and path.endswith("/lost/epoch_0_step_1/manifest.json"),
                         {1: "lost"})
    with _through(azure_server, monkeypatch, rule, retries=3) as proxy:
        model, _, mgr = contract._setup(f"az://{azure_container}/lost")
        with mgr:
            mgr.save(step=1)
    assert [f[0] for f in proxy.faults] == ["lost"], proxy.faults
    contract._resumes_exactly(f"az://{azure_container}/lost", model, 1)


def test_a_large_file_goes_up_in_blocks_committed_create_only(azure_container, monkeypatch, tmp_path):
    """Above the single-request size the client sends blocks and commits their list with the condition: a second
    create-only upload of the name (a manifest over 8 MiB, say) is refused as the single request is."""
    from ckptio.storage import azure
    from ckptio.storage.objstore import PreconditionFailed

    monkeypatch.setattr(azure._client, "SINGLE_PUT", 1 << 20)
    monkeypatch.setattr(azure._client, "BLOCK", 1 << 20)
    bucket = open_storage(f"az://{azure_container}").store
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "big").write_bytes(data)
    bucket.upload_file(tmp_path / "big", "big/manifest.json", if_absent=True)
    blocks = azure.client().get_blob_client(azure_container, "big/manifest.json").get_block_list()[0]
    assert len(blocks) == 3, blocks
    (tmp_path / "other").write_bytes(data[::-1])
    with pytest.raises(PreconditionFailed, match="409 BlobAlreadyExists"):
        bucket.upload_file(tmp_path / "other", "big/manifest.json", if_absent=True)
    assert bucket.get("big/manifest.json", 1 << 30)[0] == data


def test_the_clients_transport_is_the_one_azure_storage_blob_makes_less_the_per_request_proxy_lookup(azure_container):
    """ckptio's client settings (the environment's proxies read once, its timeouts, its read size) leave the
    transport azure-storage-blob makes, with ckptio's timeouts; it reads answers in blocks of ``READ_BLOCK`` (4 MiB),
    no smaller than azure-storage-blob's (256 KiB; azure-core's own default, 4 KiB, costs a restore twice the CPU)."""
    import os

    from azure.storage.blob import BlobServiceClient

    from ckptio.storage.azure import _client

    ours = _client.client()._pipeline._transport.connection_config
    plain = BlobServiceClient.from_connection_string(
        os.environ["AZURE_STORAGE_CONNECTION_STRING"])._pipeline._transport.connection_config
    assert ours.data_block_size == _client.READ_BLOCK >= plain.data_block_size
    assert (ours.timeout, ours.read_timeout) == (_client.CONNECT_TIMEOUT, _client.READ_TIMEOUT)


def _ranges(monkeypatch) -> list[tuple[str, str | None]]:
    """(method, ``x-ms-range``) of every HTTP request the client sends from now on."""
    from urllib3.connectionpool import HTTPConnectionPool

    sent: list[tuple[str, str | None]] = []
    real = HTTPConnectionPool.urlopen

    def urlopen(self, method, url, *args, **kwargs):
        sent.append((method, (kwargs.get("headers") or {}).get("x-ms-range")))
        return real(self, method, url, *args, **kwargs)

    monkeypatch.setattr(HTTPConnectionPool, "urlopen", urlopen)
    return sent


def _random(n: int, seed: int = 0) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_a_large_read_is_one_ranged_get_on_a_kept_connection(azure_container, monkeypatch):
    """A read of 48 MiB is one ranged GET, its body read into the caller's buffer (the client's download was a GET of
    each 16 MiB, each joined into new bytes before the copy into the buffer; each request costs the client more CPU
    than a MB of data); reads that follow go over the same connection, none made anew."""
    from urllib3.connectionpool import HTTPConnectionPool

    data = _random(48 << 20)
    store = open_storage(f"az://{azure_container}").store
    store.put("big", data)
    view = memoryview(bytearray(len(data)))
    with monkeypatch.context() as patched:
        sent = _ranges(patched)
        assert store.read_into("big", 0, view) == len(data)
    assert bytes(view) == data
    assert sent == [("GET", f"bytes=0-{len(data) - 1}")], sent
    made = {"n": 0}
    real = HTTPConnectionPool._new_conn

    def new_conn(self):
        made["n"] += 1
        return real(self)

    monkeypatch.setattr(HTTPConnectionPool, "_new_conn", new_conn)
    for offset in (5, 1 << 20, (48 << 20) - 1000):
        part = memoryview(bytearray(1000))
        assert store.read_into("big", offset, part) == 1000 and bytes(part) == data[offset:offset + 1000]
    assert made["n"] == 0, f"{made['n']} connections made for 3 reads: a read's connection was not kept"


def test_a_read_past_the_end_or_of_a_missing_blob(azure_container):
    """A read running past a blob's end returns the bytes there are (the reader names the truncation); a missing blob
    is CheckpointNotFoundError, a missing container named as such."""
    from ckptio.errors import CheckpointNotFoundError
    from ckptio.storage.azure import AzureError

    data = _random(3000)
    store = open_storage(f"az://{azure_container}").store
    store.put("small", data)
    view = memoryview(bytearray(2000))
    assert store.read_into("small", 2000, view) == 1000 and bytes(view[:1000]) == data[2000:]
    with pytest.raises(CheckpointNotFoundError, match=f"az://{azure_container}/gone: missing"):
        store.read_into("gone", 0, view)
    with pytest.raises(AzureError, match="ContainerNotFound"):
        open_storage(f"az://{azure_container}-missing").store.read_into("small", 0, view)


def test_a_window_fetched_short_is_not_kept_and_its_unfilled_bytes_never_served(azure_container):
    """A window fetched short is not kept (a buffer not zeroed before its fetch would otherwise serve memory no
    answer filled): a blob that became shorter than its listing said is named truncated at every read of it, and a
    read of the bytes that did come is fetched again rather than served from the window's unfilled memory; a full
    window serves every read inside it with no request."""
    from ckptio.errors import CheckpointCorruptError

    data = _random(3 << 20, seed=3)
    storage = open_storage(f"az://{azure_container}/w")
    storage.store.put("w/blob", data)
    with storage.session():
        folder = storage.folder()
        handle = folder.open("blob")
        assert handle.read(5, 100) == data[5:105]  # a window fetched: every read inside it from memory
        assert handle.read((2 << 20) + 7, 1000) == data[(2 << 20) + 7:(2 << 20) + 1007]
    storage.store.put("w/blob", data[:1 << 20])  # replaced by a shorter blob after the listing below
    with storage.session():
        folder = storage.folder()
        handle = folder.open("blob")
        assert handle.size == 1 << 20
        storage.store.put("w/blob", data[:1000])
        for _ in range(2):
            with pytest.raises(CheckpointCorruptError, match="truncated"):
                handle.read(10, 100)
        whole = _random(1 << 20, seed=4)
        storage.store.put("w/blob", whole)  # its listed size again: the short window was not kept, so it is fetched
        assert handle.read(2000, 100) == whole[2000:2100]


def test_a_large_window_is_memory_mapped_at_once_and_what_it_handed_out_stays_valid(azure_container, monkeypatch):
    """A window larger than MAPPED is an anonymous mapping made present in one call (a bytearray that large was a new
    mapping zeroed and faulted in page by page: ~30 ms of CPU for each 42 MB window of a restore): every read inside
    it is served from it with no request; a view of it still held keeps its bytes after its window is dropped from
    the cache, the session ended and a new window fetched; a large window fetched short is not kept."""
    import mmap

    from ckptio.errors import CheckpointCorruptError
    from ckptio.storage.azure.bucket import AzureBucket
    from ckptio.storage.objstore import reader

    size = reader.MAPPED + (3 << 20)
    data = _random(size, seed=5)
    storage = open_storage(f"az://{azure_container}/m")
    storage.store.put("m/blob", data)
    calls: list = []
    monkeypatch.setattr(AzureBucket, "read_into", contract._counted(AzureBucket, "read_into", calls))
    with storage.session():
        handle = storage.folder().open("blob")
        handle.advise([(0, size)])
        assert handle.read(7, 100) == data[7:107]
        windows = list(handle.cache._windows.values())
        assert len(windows) == 1 and isinstance(windows[0], mmap.mmap) and len(windows[0]) == size
        for offset in range(1000, size - (4 << 20), 5 << 20):
            assert handle.read(offset, 4 << 20) == data[offset:offset + (4 << 20)]
        assert calls == [("read_into", "m/blob")], calls
        with handle.cache.lock:
            held = handle.cache.find("m/blob", size - 1000, 1000)
        assert held is not None
        handle.cache.add("other", 0, bytearray(handle.cache.limit))  # evicts the window
        assert not any(k == "m/blob" for k, _ in handle.cache._windows)
    storage.store.put("m/blob", _random(size, seed=6))
    with storage.session():
        again = storage.folder().open("blob")
        again.advise([(0, size)])
        assert again.read(5, 10) == _random(size, seed=6)[5:15]
    assert bytes(held) == data[size - 1000:]
    with storage.session():
        short = storage.folder().open("blob")
        storage.store.put("m/blob", _random(size, seed=7)[:size - 1])  # shorter than it was listed
        short.advise([(0, size)])
        with pytest.raises(CheckpointCorruptError, match="truncated"):
            short.read(10, 100)
        assert not short.cache._windows


def test_a_read_cut_mid_body_goes_on_from_where_it_stopped(azure_container, azure_server, monkeypatch):
    """The answer to a read is cut halfway: the rest is asked for (not the whole range again), and the bytes are the
    blob's; a read cut every time fails once its tries are spent, naming the blob and how far it got."""
    from ckptio.storage.azure import AzureError

    data = _random(3 << 20, seed=1)
    open_storage(f"az://{azure_container}").store.put("cut", data)
    cuts = {"on": 1}

    def rule(method: str, path: str, query: str) -> str:
        if method == "GET" and path.endswith("/cut") and cuts["on"]:
            cuts["on"] -= 1
            return "cut"
        return "pass"

    with _through(azure_server, monkeypatch, rule, retries=1) as proxy:
        store = open_storage(f"az://{azure_container}").store
        view = memoryview(bytearray(len(data)))
        with monkeypatch.context() as patched:
            sent = _ranges(patched)
            assert store.read_into("cut", 0, view) == len(data)
        assert bytes(view) == data
        assert [f[0] for f in proxy.faults] == ["cut"], proxy.faults
        half = len(data) // 2
        assert sent == [("GET", f"bytes=0-{len(data) - 1}"), ("GET", f"bytes={half}-{len(data) - 1}")], sent
        cuts["on"] = 10
        with pytest.raises(AzureError, match=rf"reading az://{azure_container}/cut failed: .*cut off"):
            store.read_into("cut", 0, view)
        assert [f[0] for f in proxy.faults] == ["cut"] * 3, proxy.faults  # the read and its one retry


def test_a_read_goes_on_only_from_the_version_it_began_with(azure_container, azure_server, monkeypatch):
    """The blob is replaced between a cut answer and the request for the rest: that request names the version the
    read began with (``If-Match``), and the read fails naming the blob rather than joining two versions' bytes."""
    from ckptio.storage.objstore import PreconditionFailed

    direct = open_storage(f"az://{azure_container}").store  # past the proxy: the server itself
    old, new = _random(2 << 20, seed=2), _random(2 << 20, seed=3)
    direct.put("swapped", old)
    gets = {"n": 0}

    def rule(method: str, path: str, query: str) -> str:
        if method != "GET" or not path.endswith("/swapped"):
            return "pass"
        gets["n"] += 1
        if gets["n"] == 2:
            direct.put("swapped", new)  # another writer, before the rest is asked for
        return "cut" if gets["n"] == 1 else "pass"

    with _through(azure_server, monkeypatch, rule, retries=1):
        store = open_storage(f"az://{azure_container}").store
        with pytest.raises(PreconditionFailed, match=rf"reading az://{azure_container}/swapped failed: 412"):
            store.read_into("swapped", 0, memoryview(bytearray(len(old))))


MB = 1 << 20


def _stream_up(container: str, rel: str, data: bytes, piece: int = 3 * MB // 2):
    """``data`` written as a serialiser writes it (pieces not aligned with the blocks) into ``rel`` of a new step
    ``<rel's folder>/s``; returns the closed stream."""
    writer = open_storage(f"az://{container}/{rel.rpartition('/')[0]}").begin_step("s")
    with writer.open(rel.rpartition("/")[2]) as stream:
        for i in range(0, len(data), piece):
            stream.write(memoryview(data)[i:i + piece])
    return stream


@pytest.mark.parametrize("size, blocks", [(3 * MB, []), (4 * MB, []), (6 * MB + 5, [4 * MB, MB, MB, 5])])
def test_a_saved_file_is_one_request_up_to_the_single_put_size_then_blocks_after_a_first_of_that_size(
        azure_container, monkeypatch, size, blocks):
    """A file a save writes goes up in one ``Put Blob`` (no blocks) when it stays within the client's single-put size
    (``SINGLE_PUT``, as azure-storage-blob's ``upload_blob`` sends it); a larger one's first block is that size, the
    rest of ``UPLOAD_BLOCK``: each request costs the client's pipeline ~1.6 ms of CPU (16 MiB blocks made a 40 MB
    file 4 requests where ``upload_blob`` sends 1)."""
    import os

    from ckptio.storage import azure
    from ckptio.storage.checksum import bytes_checksum

    monkeypatch.setattr(azure._client, "SINGLE_PUT", 4 * MB)
    monkeypatch.setattr(azure._client, "UPLOAD_BLOCK", MB)
    data = os.urandom(size)
    stream = _stream_up(azure_container, "one/f.bin", data)
    assert stream.close() == bytes_checksum(data)
    committed = azure.client().get_blob_client(azure_container, "one/s/f.bin").get_block_list()[0]
    assert [b.size for b in committed] == blocks
    assert open_storage(f"az://{azure_container}").store.get("one/s/f.bin", 1 << 30)[0] == data


def test_a_file_within_one_request_goes_up_from_its_buffer_with_no_copy(azure_container):
    """The one request of a file within the single-put size sends the part's buffer itself (azure-storage-blob's
    ``upload_blob`` takes ``bytes`` only: a copy of up to 64 MiB, a new mapping of memory whose pages are faulted in
    again at every file, ~1 CPU-s/GB here)."""
    import os
    import tracemalloc

    data = os.urandom(12 * MB)
    writer = open_storage(f"az://{azure_container}/nocopy").begin_step("s")
    with writer.open("f.bin") as stream:
        stream.write(data)
        tracemalloc.start()
        try:
            stream.close()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < MB, f"{peak} bytes allocated to upload a file of {len(data)}"
    assert open_storage(f"az://{azure_container}").store.get("nocopy/s/f.bin", 1 << 30)[0] == data


def test_a_file_whose_one_request_is_dropped_is_sent_again_whole(azure_container, azure_server, monkeypatch):
    """The one request of a file within the single-put size (its part's buffer, not ``bytes``) is sent again whole
    when its connection drops, and the blob is exactly the bytes written."""
    import os

    from ckptio.storage import azure
    from ckptio.storage.checksum import bytes_checksum

    monkeypatch.setattr(azure._client, "READ_TIMEOUT", 30)
    data = os.urandom(12 * MB)
    rule = contract._nth(lambda method, path: method == "PUT" and path.endswith("/dropped/s/f.bin"), {1: "drop"})
    with _through(azure_server, monkeypatch, rule, retries=1) as proxy:
        stream = _stream_up(azure_container, "dropped/f.bin", data)
        assert stream.close() == bytes_checksum(data)
    assert [f[0] for f in proxy.faults] == ["drop"], proxy.faults
    assert azure.client().get_blob_client(azure_container, "dropped/s/f.bin").get_block_list()[0] == []
    assert open_storage(f"az://{azure_container}").store.get("dropped/s/f.bin", 1 << 30)[0] == data
