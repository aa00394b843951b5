"""A real Azure Blob Storage-compatible server for tests: Azurite (the npm package Microsoft publishes) on
127.0.0.1, in memory, over HTTP.

Azurite is a Node program, not a Python package: :func:`ensure_installed` installs the pinned version with npm into
a cache folder outside the repository (``$CKPTIO_TEST_CACHE``, else ``~/.cache/ckptio-tests``), once (a later call
finds it there; ``scripts/setup.sh`` calls it too). Without node and npm the Azure tests are skipped, naming why.

Azurite checks the conditions the folder depends on as Azure does: a create-only upload (``If-None-Match: *``) of a
blob that exists is refused with ``409 BlobAlreadyExists`` (a single ``Put Blob`` and a block list's commit alike),
and an ``If-Match`` naming another ETag with ``412``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

VERSION = "3.35.0"
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's one built-in account and its key, published in Azure's documentation (no secret)."""


def cache() -> Path:
    base = os.environ.get("CKPTIO_TEST_CACHE") or Path.home() / ".cache" / "ckptio-tests"
    return Path(base) / f"azurite-{VERSION}"


def binary() -> Path:
    return cache() / "node_modules" / ".bin" / "azurite-blob"


def missing_tools() -> str | None:
    """Why Azurite cannot run here (node or npm not installed), or ``None``."""
    lacking = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    return f"{' and '.join(lacking)} not installed: Azurite (the Azure Blob Storage server the az:// tests run " \
           f"against) is a Node program" if lacking else None


def ensure_installed() -> Path:
    """The Azurite executable, installed with npm into :func:`cache` if it is not there yet (one process installs
    while the others wait on a lock)."""
    if binary().exists():
        return binary()
    folder = cache()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".azurite-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary().exists():
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(folder),
                                   f"azurite@{VERSION}"], capture_output=True, text=True, timeout=600)
            if done.returncode != 0 or not binary().exists():
                raise RuntimeError(f"npm could not install azurite@{VERSION} into {folder}: {done.stderr[-2000:]}")
    return binary()


def connection_string(url: str) -> str:
    return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={url};"


def start(location: str | None = None) -> tuple[subprocess.Popen, str]:
    """(the server process, its blob endpoint ``http://127.0.0.1:<port>/devstoreaccount1``); the caller terminates the
    process. Blobs are kept in memory, or in the folder ``location`` (the benchmarks' GB-sized rounds: the in-memory
    store keeps a deleted blob's bytes until its periodic clean-up and then refuses new ones,
    ``409 MemoryExtentStoreAtSizeLimit``)."""
    exe = ensure_installed()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # in memory (nothing written to the working folder) or in ``location``, no telemetry, any API version
    where = ["--location", location] if location else ["--inMemoryPersistence"]
    proc = subprocess.Popen([str(exe), "--blobHost", "127.0.0.1", "--blobPort", str(port), *where,
                             "--disableTelemetry", "--skipApiVersionCheck", "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}/{ACCOUNT}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the Azure Blob Storage server (Azurite) did not start") from None
            time.sleep(0.1)


if __name__ == "__main__":  # scripts/setup.sh: install it now rather than at the first test
    print(ensure_installed())
