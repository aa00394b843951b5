"""A real S3-compatible server for tests and benchmarks: moto's standalone server on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def start() -> tuple[subprocess.Popen, str]:
    """(the server process, its endpoint URL); the caller terminates the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the S3 server (moto) did not start") from None
            time.sleep(0.1)


ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
"""Credentials and region the local server accepts (besides ``AWS_ENDPOINT_URL``)."""
