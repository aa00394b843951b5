"""Scratch folders (``ckptio.storage.lock.Scratch``): what a SIGKILLed process leaves in the temporary folder is
removed by the next process that makes one; what a live process holds, another user's folder and anything else stay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from ckptio.storage.lock import SCRATCH_LOCK as LOCK, Scratch, sweep

_HOLD = textwrap.dedent("""
    import os, signal, sys, time
    from ckptio.storage.lock import Scratch
    scratch = Scratch("ckptio-s3-epoch_0_step_3-", dir=sys.argv[1])
    (scratch.path / "streams").mkdir()
    (scratch.path / "streams" / "part").write_bytes(b"x" * (1 << 20))  # a spooled part of an upload
    print(scratch.path, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # no finaliser, no atexit: as the OOM killer or a preemption would
    sys.stdin.read()  # alive until the parent closes its stdin
""")


def _start(root, how: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(root), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_process_scratch_is_swept_and_a_live_one_is_kept(tmp_path):
    live, live_path = _start(tmp_path, "live")
    dead, dead_path = _start(tmp_path, "die")  # its own sweep, before its folder, keeps the live one's
    assert dead.wait(timeout=60) == -signal.SIGKILL and os.path.isdir(dead_path)  # left behind, as before
    older = tmp_path / "ckptio-s3-epoch_0_step_1-abcdefgh"  # an older ckptio's spool: no lock file, left alone
    older.mkdir()
    other = tmp_path / "not-ours"
    other.mkdir()
    link = tmp_path / "ckptio-link"
    link.symlink_to(live_path)
    try:
        removed = sweep(str(tmp_path))
        assert [str(p) for p in removed] == [dead_path] and not os.path.exists(dead_path)
        assert os.path.isfile(os.path.join(live_path, "streams", "part")) and older.is_dir() and other.is_dir()
        assert link.is_symlink()
        # a new scratch folder sweeps first, once per folder and process (this process has not swept tmp_path)
        live.stdin.close()
        assert live.wait(timeout=60) == 0
        assert not os.path.exists(live_path)  # a normal exit removes its own (the finaliser at exit)
        dead2, dead2_path = _start(tmp_path, "die")
        dead2.wait(timeout=60)
        mine = Scratch("ckptio-s3-epoch_0_step_9-", dir=tmp_path)
        assert not os.path.exists(dead2_path) and (mine.path / LOCK).is_file()
        assert sweep(str(tmp_path)) == []  # its own folder is locked by this live process
        mine.remove()
        assert not mine.path.exists()
    finally:
        if live.poll() is None:
            live.kill()
