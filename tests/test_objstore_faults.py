"""Faults in front of the GCS and Azure servers (fake-gcs-server, Azurite; the ``store`` fixture), through the contract
tests' faulty proxy (tests/test_s3.py): a write refused at the commit, a server that stalls past the client's read
timeout, a read whose answer is cut mid-body, a commit whose answer is lost. Each ends in a clear ckptio error or a
retry that succeeds, never a committed step that is torn, and the steps before it restore bitwise.

(503s, dropped connections and a server that keeps failing are tested in tests/test_s3.py and tests/test_azure.py.)
"""

from __future__ import annotations

import contextlib
import time
from urllib.parse import quote

import pytest
import torch

import test_s3 as contract
from ckptio import committed_checkpoints
from ckptio.errors import CheckpointError

BOTH = pytest.mark.parametrize("store", ["gs", "az"], indirect=True)


@contextlib.contextmanager
def _faulty(store, request, monkeypatch, rule):
    """The store's client talks to its server through the faulty proxy applying ``rule``, retrying for a short while
    (GCS: 3 s of retries; Azure: one retry) with a read timeout of 1 s."""
    from ckptio.storage import azure, gcs

    monkeypatch.setattr(gcs._client, "DEADLINE", 3.0)
    monkeypatch.setattr(gcs._client, "READ_TIMEOUT", 1)
    monkeypatch.setattr(azure._client, "READ_TIMEOUT", 1)
    if store.scheme == "gs":
        with contract._through(request.getfixturevalue("gcs_server"), monkeypatch, rule,
                               "STORAGE_EMULATOR_HOST") as proxy:
            yield proxy
    else:
        import test_azure

        with test_azure._through(request.getfixturevalue("azure_server"), monkeypatch, rule, retries=1) as proxy:
            yield proxy


def _hits(store, key: str, methods: tuple[str, ...]):
    """A proxy rule's match: a request of ``methods`` naming the object ``key`` or one below it (GCS: URL-encoded, in
    the query of an upload or the path; Azure: in the path)."""
    encoded = quote(key, safe="")

    def match(method: str, path: str, query: str) -> bool:
        if method not in methods:
            return False
        if store.scheme == "gs":
            return f"name={encoded}" in query or f"/o/{encoded}" in path
        return f"/{store.bucket}/{key}" in path

    return match


def _while(on: dict, match, action: str):
    return lambda method, path, query: action if on["on"] and match(method, path, query) else "pass"


def _saved_then_failing(store, request, monkeypatch, rule, on: dict, run: str):
    """Step 1 saved cleanly; with the fault on, step 2's save raises: (the error, step 1's model state)."""
    model, opt, mgr = contract._setup(store.url(run))
    with mgr:
        with _faulty(store, request, monkeypatch, rule):
            mgr.save(step=1)
            at_one = {k: v.clone() for k, v in model.state_dict().items()}
            contract._train(model, opt, 1, 3)
            on["on"] = True
            start = time.time()
            with pytest.raises(CheckpointError) as failed:
                mgr.save(step=2)
            elapsed = time.time() - start
            on["on"] = False
        assert elapsed < 45, f"the failing save took {elapsed:.0f} s: retries are not bounded"
        mgr.save(step=3)  # the fault gone, the run saves on
    return failed.value, at_one


def _steps_then_step_one_restores(store, run: str, at_one: dict) -> None:
    """Nothing of step 2 is committed; step 1 restores bitwise."""
    assert [e.step for e in committed_checkpoints(store.url(run))] == [1, 3]
    assert not any(k.startswith(f"{run}/epoch_0_step_2/") and k.endswith("manifest.json") for k in store.keys(run))
    model, _, again = contract._setup(store.url(run), verify="full")
    with again:
        assert again.restore(store.url(f"{run}/epoch_0_step_1")).step == 1
    assert all(torch.equal(at_one[k], v) for k, v in model.state_dict().items())


@BOTH
def test_a_refused_commit_fails_the_save_by_name_and_keeps_the_steps_before(store, request, monkeypatch):
    on = {"on": False}
    rule = _while(on, _hits(store, "refused/epoch_0_step_2/manifest.json", ("POST", "PUT")), "refuse")
    error, at_one = _saved_then_failing(store, request, monkeypatch, rule, on, "refused")
    assert "refused/epoch_0_step_2/manifest.json" in str(error) and "403" in str(error), error
    _steps_then_step_one_restores(store, "refused", at_one)


@BOTH
def test_a_server_stalling_past_the_read_timeout_fails_the_save_naming_the_timeout(store, request, monkeypatch):
    on = {"on": False}
    rule = _while(on, _hits(store, "stalled/epoch_0_step_2/", ("POST", "PUT")), "stall")
    error, at_one = _saved_then_failing(store, request, monkeypatch, rule, on, "stalled")
    assert "stalled/epoch_0_step_2/" in str(error) and "timed out" in str(error).lower(), error
    _steps_then_step_one_restores(store, "stalled", at_one)


@BOTH
def test_a_read_cut_mid_body_is_read_again_and_restores_bitwise(store, request, monkeypatch):
    model, _, mgr = contract._setup(store.url("cut"))
    with mgr:
        mgr.save(step=1)
    data = _hits(store, "cut/epoch_0_step_1/model", ("GET",))
    rule = contract._nth(lambda method, path: data(method, *path.partition("?")[::2]), {1: "cut"})
    with _faulty(store, request, monkeypatch, lambda m, p, q: rule(m, f"{p}?{q}", q)) as proxy:
        model2, _, again = contract._setup(store.url("cut"), verify="full")
        with again:
            assert again.restore().step == 1
    assert [f[0] for f in proxy.faults] == ["cut"], proxy.faults
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


@pytest.mark.parametrize("store", ["gs"], indirect=True)  # Azure's: tests/test_azure.py
def test_a_commit_whose_answer_was_lost_is_committed_once(store, request, monkeypatch):
    """The manifest's create-only write lands, its answer is lost; the retry is refused (the object is there) and the
    save tells its own manifest from another writer's by its bytes."""
    match = _hits(store, "lost/epoch_0_step_1/manifest.json", ("POST", "PUT"))
    rule = contract._nth(lambda method, path: match(method, path, path.partition("?")[2]), {1: "lost"})
    with _faulty(store, request, monkeypatch, lambda m, p, q: rule(m, f"{p}?{q}", q)) as proxy:
        model, _, mgr = contract._setup(store.url("lost"))
        with mgr:
            mgr.save(step=1)
    assert [f[0] for f in proxy.faults] == ["lost"], proxy.faults
    contract._resumes_exactly(store.url("lost"), model, 1)
