"""Unchanged tensors stored once in a bucket (issue 47): a step's manifest refers to the objects of an earlier step
instead of uploading them again, and an object is deleted only when no committed manifest refers to it.

Against the real S3 server (moto's, on 127.0.0.1) with the real boto3 client, and against a real GCS-compatible
server (fake-gcs-server, tests/gcsserver.py) with the real google-cloud-storage client: what is uploaded and where,
every kept step resumed bitwise with ``verify="full"``, retention keeping the objects later steps refer to and the
sweep (``ckptio prune``) collecting them once nothing does, a step name written again handing its shared objects
over first, ``list`` and ``inspect`` showing owned and shared bytes, and ``verify`` on a step that refers to
another's object.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from ckptio.cli import main  # noqa: E402
from ckptio.engine.manifest import read_manifest  # noqa: E402
from ckptio.storage import open_storage  # noqa: E402
from toy import Run, full_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _keys(store, prefix: str) -> dict[str, int]:
    return {k[len(prefix):]: size for k, size in store.keys(prefix).items()}


def _manifests(url: str) -> dict[int, object]:
    storage = open_storage(url)
    out = {}
    for entry in storage.folder().listdir():
        if entry.kind == "dir" and storage.folder(entry.name).kind("manifest.json") == "file":
            m = read_manifest(storage.folder(entry.name))
            out[m.step] = m
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _restored(url: str, name: str) -> dict:
    other = Run(url, max_steps=100, seed=1, freeze=True, verify="full")
    other.mgr.restore(f"{url}/{name}")
    state = full_state(other.model, other.opt)
    other.mgr.close()
    return state


# many requests: on Azurite (a Node server, ~15 ms a request) 10-15 s, marked slow there
@pytest.mark.parametrize("store", ["s3", "gs", pytest.param("az", marks=pytest.mark.slow)], indirect=True)
def test_a_bucket_refers_to_unchanged_objects_and_deletes_one_only_when_nothing_refers_to_it(store, capsys):
    url = store.url("run")
    run = Run(url, max_steps=100, freeze=True, keep_latest=3)
    saved = {}
    for step in range(1, 6):
        if step == 5:  # a frozen tensor edited in place: its file is uploaded again, the others still shared
            with torch.no_grad():
                run.model.model.embed_tokens.weight[1, 2] += 1.0
        saved[step] = full_state(run.model, run.opt)
        run.mgr.save(step=step)
    manifests = _manifests(url)
    assert sorted(manifests) == [3, 4, 5]
    first = {rel for rel in manifests[3].contents}
    # step 2 uploads a second copy (two steps never use one object only), step 3 refers to it, step 4 uploads
    # again (two of the three kept steps use step 2's), step 5 refers to step 4's
    assert first and set(manifests[3].shared) == first  # step 3 uploads none of them: step 2's objects
    assert all(t.startswith("epoch_0_step_2/") for t in manifests[3].shared.values())
    assert not manifests[4].shared
    keys = _keys(store, "run/")
    for rel in first:  # step 2 is gone (retention) but the objects step 3 refers to stay, with the mark
        assert f"epoch_0_step_2/{rel}" in keys and f"epoch_0_step_3/{rel}" not in keys
    assert "epoch_0_step_2/manifest.json" not in keys and "epoch_0_step_2/.ckptio-pending" in keys
    assert not any(k.startswith("epoch_0_step_1/") for k in keys)  # step 1 owned what nobody kept refers to
    changed = set(manifests[5].contents) - set(manifests[5].shared)
    assert len(changed) == 1 and f"epoch_0_step_5/{changed.pop()}" in keys
    assert all(t.startswith("epoch_0_step_4/") for t in manifests[5].shared.values())
    for step in (3, 4, 5):
        _same(saved[step], _restored(url, manifests[step].name), f"step {step}")
        assert main(["verify", f"{url}/{manifests[step].name}"]) == 0
    capsys.readouterr()
    assert main(["list", "--json", url]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"] if r["committed"]}
    assert all(rows[m.name]["shared_bytes"] > 0 for m in manifests.values())
    # saves go on: once no kept step refers to an object of a removed step, the retention that removed its last
    # referrer collects it, in the same process; what a kept step refers to stays
    for step in range(6, 9):
        run.mgr.save(step=step)
        kept = _manifests(url)
        names = {m.name for m in kept.values()}
        left = {k for k in _keys(store, "run/") if "/" in k and k.split("/")[0] not in names
                and not k.endswith("/.ckptio-pending")}
        assert left == {t for m in kept.values() for t in m.shared.values() if t.split("/")[0] not in names}, step
    for check in ("retention", "prune"):
        keys = _keys(store, "run/")
        kept = _manifests(url)
        names = {m.name for m in kept.values()}
        referred = {t for m in kept.values() for t in m.shared.values()}
        left = {k for k in keys if "/" in k and k.split("/")[0] not in names and not k.endswith("/.ckptio-pending")}
        assert left == {t for t in referred if t.split("/")[0] not in names}, check
        for step, m in kept.items():  # every reference names an object that is there
            assert all(t in keys for t in m.shared.values()), (check, step)
        if check == "retention":
            run.mgr.close()
            assert main(["prune", url, "--keep-latest", "2"]) == 0


def test_a_step_name_written_again_hands_its_shared_objects_over_first(store):
    url = store.url("again")
    run = Run(url, max_steps=100, freeze=True)
    saved = {}
    for step in (1, 2, 3, 4):  # step 2 uploads a second copy, steps 3 and 4 refer to it
        saved[step] = full_state(run.model, run.opt)
        run.mgr.save(step=step)
    run.mgr.close()
    before = _manifests(url)
    assert not before[2].shared and before[3].shared and before[4].shared
    # a run resumed from step 2 with a frozen tensor changed saves "step 2" again: steps 3 and 4 keep their bytes
    again = Run(url, max_steps=100, seed=1, freeze=True)
    again.mgr.restore(f"{url}/{before[2].name}")
    with torch.no_grad():
        again.model.model.embed_tokens.weight.mul_(2)
    again.mgr.save(step=2)
    again.mgr.close()
    after = _manifests(url)
    assert not any(t.startswith(before[2].name + "/") for t in after[4].shared.values())
    assert not after[3].shared  # step 3 owns what it referred to; step 4 refers to step 3's copy
    assert all(t.startswith(before[3].name + "/") for t in after[4].shared.values())
    for step in (3, 4):
        _same(saved[step], _restored(url, after[step].name), f"step {step} after step 1 was written again")


def test_a_damaged_shared_object_is_named_in_every_step_that_refers_to_it(store, capsys):
    url = store.url("damaged")
    run = Run(url, max_steps=100, freeze=True)
    for step in (1, 2, 3):
        run.mgr.save(step=step)
    run.mgr.close()
    manifests = _manifests(url)
    rel, target = sorted(manifests[3].shared.items())[0]
    key = f"damaged/{target}"
    data = bytearray(store.get(key))
    assert target.startswith(manifests[2].name + "/")  # step 2's second copy: step 1 holds its own
    data[-5] ^= 0x20  # a bit flips in the object steps 2 and 3 use
    store.put(key, bytes(data))
    capsys.readouterr()
    for step, m in manifests.items():
        assert main(["verify", f"{url}/{m.name}"]) == (0 if step == 1 else 1)
        out = capsys.readouterr()
        assert (rel.rsplit("/", 1)[-1] in out.out + out.err) == (step != 1) and m.name in out.out + out.err, out
    other = Run(url, max_steps=100, seed=1, freeze=True, verify="full")
    info = other.mgr.restore()  # past steps 3 and 2 to step 1, which holds its own copy
    assert info is not None and info.step == 1
    other.mgr.close()
