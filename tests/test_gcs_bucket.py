"""The GCS bucket's requests (:class:`ckptio.storage.gcs.GCSBucket`, sent straight through the client's authorized
session) against a real GCS-compatible server (fake-gcs-server): object names that need quoting, the conditions of
a write and their failures, a missing object, a listing of several pages, the generation a read names, and how many
requests each operation costs."""

from __future__ import annotations

import pytest

from ckptio.errors import CheckpointNotFoundError

pytest.importorskip("google.cloud.storage")

ODD = "run 1/ünï #1?x=y&z=%20;+~*/data bin"
"""A key every part of which the JSON API's URL must quote: a space, non-ASCII, ``#``, ``?``, ``&``, ``=``, ``%``."""


@pytest.fixture
def bucket(gcs_bucket):
    from ckptio.storage.gcs import GCSBucket

    return GCSBucket(gcs_bucket)


def test_a_key_that_needs_quoting_is_the_same_object_in_every_request(bucket, tmp_path):
    data = b"odd bytes \x00\xff" * 100
    bucket.put(ODD, data)
    found = bucket.head(ODD)
    assert found is not None and found.key == ODD and found.size == len(data)
    assert bucket.get(ODD, 1 << 20) == (data, found.token)
    view = memoryview(bytearray(10))
    assert bucket.read_into(ODD, 5, view) == 10 and bytes(view) == data[5:15]
    objects, prefixes = bucket.listing("run 1/", delimiter=True)
    assert objects == [] and prefixes == ["run 1/ünï #1?x=y&z=%20;+~*/"]
    assert [o.key for o in bucket.listing("run 1/ünï #1?", delimiter=False)[0]] == [ODD]
    assert [o.key for o in bucket.listing("run 1/ünï #1?x=y&z=%20;+~*/", delimiter=True)[0]] == [ODD]
    with bucket.open_stream(None, ODD + ".stream") as stream:
        stream.write(data)
    (tmp_path / "f").write_bytes(data[::-1])
    bucket.upload_file(tmp_path / "f", ODD + ".file", if_absent=True)
    assert bucket.get(ODD + ".stream", 1 << 20)[0] == data and bucket.get(ODD + ".file", 1 << 20)[0] == data[::-1]
    for key in (ODD, ODD + ".stream", ODD + ".file"):
        bucket.delete(key)
        assert bucket.head(key) is None
    assert bucket.listing("run 1/", delimiter=False) == ([], [])


def test_a_write_whose_condition_fails_is_a_precondition_failure_naming_the_object(bucket, tmp_path):
    from ckptio.storage.gcs import GCSPreconditionFailed

    bucket.put("c/manifest.json", b"first", if_absent=True)
    with pytest.raises(GCSPreconditionFailed, match=r"gs://.*/c/manifest\.json.*412"):
        bucket.put("c/manifest.json", b"second", if_absent=True)
    (tmp_path / "f").write_bytes(b"third")
    with pytest.raises(GCSPreconditionFailed, match=r"gs://.*/c/manifest\.json.*412"):
        bucket.upload_file(tmp_path / "f", "c/manifest.json", if_absent=True)
    first = bucket.head("c/manifest.json").token
    bucket.put("c/manifest.json", b"fourth", if_token=first)
    with pytest.raises(GCSPreconditionFailed, match=r"gs://.*/c/manifest\.json.*412"):
        bucket.put("c/manifest.json", b"fifth", if_token=first)  # replaced since: not that version any more
    assert bucket.get("c/manifest.json", 100)[0] == b"fourth"
    with pytest.raises(GCSPreconditionFailed):
        bucket.put("c/never", b"x", if_token=first)  # a replacement of a version where there is none


def test_a_missing_object_is_not_found_by_name_and_its_removal_is_no_error(bucket):
    where = r"gs://.*/m/gone #1: missing \(404\)"
    with pytest.raises(CheckpointNotFoundError, match=where):
        bucket.get("m/gone #1", 100)
    with pytest.raises(CheckpointNotFoundError, match=where):
        bucket.read_into("m/gone #1", 0, memoryview(bytearray(4)))
    assert bucket.head("m/gone #1") is None
    bucket.delete("m/gone #1")
    assert bucket.listing("m/", delimiter=True) == ([], [])


def test_a_read_names_the_generation_of_its_bytes_even_of_an_empty_object(bucket):
    """The token :meth:`get` returns is the generation of the bytes it returns (the lease's takeover names it):
    a conditional write naming it succeeds, one naming an older version fails; an empty object has no byte to
    answer a ranged read with (``416``) and still names its generation."""
    from ckptio.storage.gcs import GCSPreconditionFailed

    bucket.put("g/empty", b"")
    data, token = bucket.get("g/empty", 4096)
    assert data == b"" and token == bucket.head("g/empty").token
    bucket.put("g/empty", b"now 12 bytes", if_token=token)
    data, newer = bucket.get("g/empty", 4096)
    assert data == b"now 12 bytes" and newer != token and newer == bucket.listing("g/", delimiter=False)[0][0].token
    assert bucket.get("g/empty", 3) == (b"now", newer)  # the first ``limit`` bytes
    # from a server whose answer does not name the generation: the version looked up, then its bytes
    assert bucket._get_pinned("g/empty", 3) == (b"now", newer)
    bucket.put("g/empty2", b"")
    assert bucket._get_pinned("g/empty2", 4096) == bucket.get("g/empty2", 4096) == (b"", bucket.head("g/empty2").token)
    with pytest.raises(GCSPreconditionFailed):
        bucket.put("g/empty", b"stale", if_token=token)


def test_a_listing_of_several_pages_lists_every_object_and_every_prefix(bucket, monkeypatch):
    """The JSON API answers a listing a page at a time (1,000 objects at most); a page of 3 here."""
    from ckptio.storage.gcs import bucket as module

    monkeypatch.setattr(module, "LIST_PAGE", 3)
    keys = [f"p/top{i}" for i in range(4)] + [f"p/sub{i}/x" for i in range(5)] + ["p/sub0/y/z", "q/other"]
    for key in keys:
        bucket.put(key, key.encode())
    objects, prefixes = bucket.listing("p/", delimiter=False)
    assert sorted(o.key for o in objects) == sorted(k for k in keys if k.startswith("p/")) and prefixes == []
    assert {o.key: o.size for o in objects}["p/sub0/y/z"] == len(b"p/sub0/y/z")
    objects, prefixes = bucket.listing("p/", delimiter=True)
    assert sorted(o.key for o in objects) == [f"p/top{i}" for i in range(4)]
    assert prefixes == [f"p/sub{i}/" for i in range(5)]
    assert all(o.mtime > 1.6e9 and isinstance(o.token, int) for o in objects)


def test_each_operation_is_one_request_naming_the_object_quoted_whole(bucket, gcs_server, monkeypatch):
    """Each operation a save or a restore uses is one request of the JSON API (a read of a small object was a
    lookup of its generation, then a read of its bytes), a listing one a page; an object's name is quoted whole in
    the request's path, its ``/`` too (GCS, unlike the server here, takes no other spelling)."""
    from urllib.parse import quote

    import test_s3 as contract

    key, other = "one/a b#?", "one/b"
    bucket.put(key, b"abc")
    quoted = f"/o/{quote(key, safe='')}"
    with contract._through(gcs_server, monkeypatch, lambda *a: "pass", "STORAGE_EMULATOR_HOST") as proxy:
        for fn, sends in ((lambda: bucket.put(other, b"x", if_absent=True), ["POST /o"]),
                          (lambda: bucket.put(other, b"y", if_token=bucket.head(other).token),
                           ["GET /o/one%2Fb", "POST /o"]),
                          (lambda: bucket.get(key, 4096), [f"GET {quoted}"]),
                          (lambda: bucket.head(key), [f"GET {quoted}"]),
                          (lambda: bucket.listing("one/", delimiter=True), ["GET /o"]),
                          (lambda: bucket.read_into(key, 1, memoryview(bytearray(2))), [f"GET {quoted}"]),
                          (lambda: bucket.delete(key), [f"DELETE {quoted}"])):
            before = len(proxy.signed)
            fn()
            sent = [(method, path.partition("?")[0]) for method, path, _, _ in proxy.signed[before:]]
            assert len(sent) == len(sends) and all(m == w.split()[0] and p.endswith(w.split()[1])
                                                   for (m, p), w in zip(sent, sends)), (sent, sends)


def test_a_refused_request_fails_naming_the_object_and_a_transient_one_is_retried(bucket, gcs_server, monkeypatch):
    """A 403 is no condition and no missing object: a :class:`GCSError` naming the object and the answer, not
    retried; a 503 and a dropped connection are retried with the client's policy, then succeed."""
    import test_s3 as contract
    from ckptio.storage.gcs import GCSError, GCSPreconditionFailed

    bucket.put("r/a b", b"abc")
    once: set[str] = set()

    def rule(method: str, path: str, query: str) -> str:
        if method == "DELETE":
            return "refuse"
        fault = "503" if path.endswith("/o/r%2Fa%20b") else "drop" if "prefix=r%2F" in query else None
        if fault is None or fault in once:
            return "pass"
        once.add(fault)
        return fault

    with contract._through(gcs_server, monkeypatch, rule, "STORAGE_EMULATOR_HOST") as proxy:
        with pytest.raises(GCSError, match=r"removing gs://[^/]+/r/a b failed: 403") as refused:
            bucket.delete("r/a b")
        assert not isinstance(refused.value, (GCSPreconditionFailed, CheckpointNotFoundError))
        assert bucket.head("r/a b").size == 3
        assert [o.key for o in bucket.listing("r/", delimiter=False)[0]] == ["r/a b"]
    assert [f[0] for f in proxy.faults] == ["refuse", "503", "drop"], proxy.faults
