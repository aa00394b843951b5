"""A folder a command sees read-only, as on a read-only mount, for tests run as any user.

Not root: the folder's permissions (``0o555``) make it read-only for the process. Root writes through permissions,
so the command runs in a mount namespace of its own (``unshare -m``) where the folder is bind-mounted read-only:
the kernel answers EROFS as on a read-only filesystem. Without ``unshare`` or the right to mount, the test skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

_SCRIPT = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'


@contextlib.contextmanager
def read_only(folder: Path, argv: list[str]) -> Iterator[list[str]]:
    """``argv`` made to run with ``folder`` read-only; the folder is writable again afterwards."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield argv
        finally:
            folder.chmod(mode)
        return
    probe = [shutil.which("unshare") or "unshare", "-m", "sh", "-c", _SCRIPT + " && ! touch \"$0/.probe\"", str(folder),
             "true"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except OSError:
        ok = False
    if not ok:
        pytest.skip("running as root without a way to mount a folder read-only (unshare -m)")
    yield [shutil.which("unshare") or "unshare", "-m", "sh", "-c", _SCRIPT, str(folder), *argv]
