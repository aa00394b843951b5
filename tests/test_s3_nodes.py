"""Two "nodes" with no folder in common checkpoint to a bucket (S3, GCS, Azure); one is lost mid-save; the job
resumes on 3, then 1.

Each node is its own ``torchrun`` (``--nnodes 2 --node-rank i``, rendezvous on 127.0.0.1) with 2 ranks, its own
scratch folder (``TMPDIR``, where uploads are spooled, and its outputs) and nothing shared but the object store's
server on loopback (S3: moto; the same test on GCS: fake-gcs-server, on Azure: Azurite). An uninterrupted run records the whole state
at every saved step. The interrupted run loses node 1 while it saves step 4 (its ranks SIGKILLed after writing
their files, before the commit); node 0 is then killed as a job scheduler would. The bucket must then resume, on 3
ranks of one node, from step 2 with exactly the uninterrupted run's state (recorded once, by the first store's test:
the training is the same on every store); that job trains on to step 4 and saves,
and a 1-rank job must restore exactly what the 3 ranks saved.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import s3server
from distributed import free_port, kill_group, wait_or_kill

pytest.importorskip("boto3")
pytestmark = pytest.mark.slow  # several multi-rank torchrun jobs

WORKER = Path(__file__).with_name("s3_node_worker.py")


@pytest.fixture(scope="module", params=["s3", "gs", "az"])
def s3(request):
    """The environment of the jobs and the scheme of their bucket ``nodes``: the module's S3 server (moto), its GCS
    server (fake-gcs-server, tests/gcsserver.py) or its Azure server (Azurite, tests/azuriteserver.py)."""
    if request.param == "az":
        import azuriteserver
        from azure.storage.blob import BlobServiceClient

        connection = azuriteserver.connection_string(request.getfixturevalue("azure_server"))
        BlobServiceClient.from_connection_string(connection).create_container("nodes")
        return {"AZURE_STORAGE_CONNECTION_STRING": connection, "CKPTIO_TEST_SCHEME": "az"}
    if request.param == "gs":
        server = request.getfixturevalue("gcs_server")
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        storage.Client(project="test", credentials=AnonymousCredentials(),
                       client_options={"api_endpoint": server}).create_bucket("nodes")
        return {"STORAGE_EMULATOR_HOST": server, "CKPTIO_TEST_SCHEME": "gs"}
    import boto3

    s3_server = request.getfixturevalue("s3_server")
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="test", aws_secret_access_key="test",
                 region_name="us-east-1").create_bucket(Bucket="nodes")
    return {**s3server.ENV, "AWS_ENDPOINT_URL": s3_server, "CKPTIO_TEST_SCHEME": "s3"}


def _job(s3: dict, scratch: Path, launch: list[str], *args: str) -> subprocess.Popen:
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **s3, "TMPDIR": str(scratch / "tmp"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore", "CKPTIO_TOY_MODEL": "plain"}
    log = open(scratch / "log.txt", "a")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, str(WORKER), *args,
                             "--out", str(scratch)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=str(scratch))


def _nodes(s3: dict, scratches: list[Path], *args: str, node1_extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    port = free_port()
    return [_job(s3, scratch, ["--nnodes=2", f"--node-rank={i}", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                               f"--master-port={port}"], *args, *(node1_extra if i == 1 else ()))
            for i, scratch in enumerate(scratches)]


def _wait(proc: subprocess.Popen, scratch: Path, timeout: float = 400) -> int:
    return wait_or_kill(proc, timeout, lambda: (scratch / "log.txt").read_text()[-3000:])


def _ok(proc: subprocess.Popen, scratch: Path) -> None:
    code = _wait(proc, scratch)
    assert code == 0, f"job failed ({code}):\n{(scratch / 'log.txt').read_text()[-4000:]}"


def _same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys() and len([k for k in a if k.startswith("optim/")]) > 10, where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}: {k} differs"


_REFERENCE: dict[int, dict] = {}
"""The uninterrupted run's state at steps 2 and 4: the training is the same whatever the store, so the first store's
test records it (its 2 nodes saving to that bucket) and the others compare with it."""


def _reference(s3: dict, tmp_path: Path) -> dict[int, dict]:
    if not _REFERENCE:
        ref_nodes = [tmp_path / "ref-node0", tmp_path / "ref-node1"]
        ref_jobs = _nodes(s3, ref_nodes, "--ckpt", f"{s3['CKPTIO_TEST_SCHEME']}://nodes/ref", "--steps", "4",
                          "--save-every", "2")
        for proc, scratch in zip(ref_jobs, ref_nodes):
            _ok(proc, scratch)
        _REFERENCE.update({step: torch.load(ref_nodes[0] / f"state_{step}.pt") for step in (2, 4)})
    return _REFERENCE


def test_a_node_lost_mid_save_resumes_on_three_ranks_then_one(s3, tmp_path):
    scheme = s3["CKPTIO_TEST_SCHEME"]
    ref = _reference(s3, tmp_path)

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    common = ("--ckpt", f"{scheme}://nodes/run", "--steps", "4", "--save-every", "2")
    node0, node1 = _nodes(s3, nodes, *common, node1_extra=("--die-at-save", "4"))
    assert _wait(node1, nodes[1]) != 0, "node 1 was to be lost while saving step 4"
    time.sleep(2)
    kill_group(node0)  # the scheduler takes the rest of the job down
    assert (nodes[0] / "state_2.pt").exists() and not (nodes[0] / "state_4.pt").exists()

    three = tmp_path / "three"
    _ok(_job(s3, three, ["--standalone", "--nproc-per-node=3"], *common), three)
    restored = torch.load(three / "restored.pt")
    assert restored["step"] == 2, "step 4 was never committed: the newest complete checkpoint is step 2"
    _same(ref[2], restored["state"], "resumed on 3 ranks vs uninterrupted")
    saved_by_three = torch.load(three / "state_4.pt")

    one = tmp_path / "one"
    _ok(_job(s3, one, ["--standalone", "--nproc-per-node=1"], *common), one)
    restored = torch.load(one / "restored.pt")
    assert restored["step"] == 4
    _same(saved_by_three, restored["state"], "resumed on 1 rank vs what 3 ranks saved")
