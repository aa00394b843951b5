"""Many SIGKILL trials against a saving job; prints the tally. The suite runs a few of the same trials.

    .venv/bin/python tools/fault_injection.py --trials 50

Each trial starts 2 gloo ranks that save a 16 MiB FSDP2 model in a loop (half the trials with top-k
retention, so deletions happen on every save; every other pair with background saves, which write
one checkpoint while the loop overwrites the parameters for the next), SIGKILLs one rank at a random moment, then checks that
every committed checkpoint is intact byte for byte, that nothing committed was lost (the latest and
the best, under retention), and that a new run resumes from the newest with the right values.

    .venv/bin/python tools/fault_injection.py --tolerance both --trials 50

runs the same trials with failure tolerance on (``failed_saves_allowed=3``, ``sync_saves_may_fail``: the rank that
survives its peer's kill fails its saves and goes on) and off (``failed_saves_allowed=0``), every other trial
(``on`` or ``off``: all of them; by default the configuration's defaults).

    .venv/bin/python tools/fault_injection.py --s3 --trials 20

runs the same trials against an ``s3://`` checkpoint folder on an S3-compatible server (moto's, started
here on 127.0.0.1): kills land mid-upload, mid-commit and mid-delete, and the restarted job must take
over the killed job's lease. ``--azure`` runs them against an ``az://`` folder on Azurite instead.

    .venv/bin/python tools/fault_injection.py --memory --trials 20

runs the memory tier's trials instead: a node of a 2-node ``torchrun`` job SIGKILLed at random, the job restarted
(``tools/fault_memory.py`` says what each trial checks).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kill import kill_trial  # noqa: E402


def _start_s3() -> str:
    """A moto S3 server on 127.0.0.1 (stopped when this process exits); returns a new bucket's name."""
    import atexit
    import os
    import uuid

    import s3server

    proc, url = s3server.start()
    atexit.register(proc.terminate)
    os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
    from ckptio.storage.s3 import client

    bucket = f"fault-{uuid.uuid4().hex[:8]}"
    client().create_bucket(Bucket=bucket)
    return bucket


def _start_azure() -> str:
    """Azurite on 127.0.0.1 (installed with npm on first use; stopped when this process exits); returns a new
    container's name."""
    import atexit
    import os
    import uuid

    import azuriteserver

    proc, url = azuriteserver.start()
    atexit.register(proc.terminate)
    os.environ["AZURE_STORAGE_CONNECTION_STRING"] = azuriteserver.connection_string(url)
    from ckptio.storage.azure import client

    container = f"fault-{uuid.uuid4().hex[:8]}"
    client().create_container(container)
    return container


def _memory(trials: int, seed: int) -> int:
    import collections

    import fault_memory

    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ckptio-fault-memory-") as tmp:
        ref, window = fault_memory.reference(Path(tmp) / "reference")
        print(f"reference job done ({window:.1f} s from its first snapshot to its end)", flush=True)
        for trial in range(trials):
            base = Path(tmp) / f"trial{trial}"
            base.mkdir()
            try:
                r = fault_memory.trial(base, ref, window, rng)
            except AssertionError as exc:
                tally["failed"] += 1
                print(f"trial {trial}: FAILED: {exc}", flush=True)
                continue
            finally:
                tally["trials"] += 1
            shutil.rmtree(base, ignore_errors=True)
            tally["passed"] += 1
            tally[f"restored from {r['tier'] or 'nothing'}"] += 1
            tally["node replaced (memory wiped)"] += r["replaced"]
            tally["job had ended before the kill"] += r["ended"]
            print(f"trial {trial:>3}: ok: node {r['victim']} lost after step {r['target']}'s snapshot"
                  f"{' and replaced' if r['replaced'] else ''}; "
                  f"durable steps {r['durable']}; newest that had to survive {r['floor']}; restored step "
                  f"{r['step']} from {r['tier']}, bitwise; final state bitwise", flush=True)
    print(f"\nmemory tier fault injection: {dict(tally)} in {time.monotonic() - start:.0f} s")
    return 1 if tally["failed"] else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--s3", action="store_true", help="checkpoint to s3:// on a local S3 server instead of a folder")
    p.add_argument("--azure", action="store_true", help="checkpoint to az:// on Azurite (tests/azuriteserver.py)")
    p.add_argument("--memory", action="store_true", help="the memory tier's trials: a node of a 2-node job lost")
    p.add_argument("--tolerance", choices=("default", "on", "off", "both"), default="default",
                   help="failure tolerance of the saving job: failed_saves_allowed=3 with sync_saves_may_fail (on), "
                        "failed_saves_allowed=0 (off), each every other trial (both), or the defaults")
    p.add_argument("--start", choices=("forkserver", "spawn"), default="forkserver",
                   help="how rank processes start: forked from a server that imported torch and ckptio once "
                        "(default: ~3 s less per trial), or each a fresh interpreter")
    args = p.parse_args()
    if args.start == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "torch.distributed.fsdp", "ckptio", "test_kill"])
    if args.memory:
        return _memory(args.trials, args.seed)
    bucket = _start_s3() if args.s3 else _start_azure() if args.azure else None
    scheme = "az" if args.azure else "s3"
    rng = random.Random(args.seed)
    tally = {"trials": 0, "passed": 0, "failed": 0, "killed_mid_write": 0, "killed_mid_delete": 0}
    start = time.monotonic()
    for trial in range(args.trials):
        fmt = ("safetensors", "torch_save")[trial % 2]
        retention = trial % 4 >= 2
        async_save = trial % 8 >= 4
        tolerant = {"default": None, "on": True, "off": False, "both": trial % 16 < 8}[args.tolerance]
        label = f"{fmt}, retention={retention}, async={async_save}" + \
            ("" if tolerant is None else f", tolerance={'on' if tolerant else 'off'}")
        with tempfile.TemporaryDirectory(prefix="ckptio-fault-") as local:
            root = f"{scheme}://{bucket}/trial{trial}" if bucket else local
            try:
                result = kill_trial(root, fmt, retention, rng, async_save, args.start, tolerant)
            except AssertionError as exc:
                tally["failed"] += 1
                print(f"trial {trial}: FAILED ({label}): {exc}", flush=True)
                continue
        tally["trials"] += 1
        tally["passed"] += 1
        tally["killed_mid_write"] += int(result["killed_mid_write"])
        tally["killed_mid_delete"] += int(result["killed_mid_delete"])
        print(f"trial {trial:>3}: ok ({label}) resumed at step {result['resumed_step']}"
              f"{' [mid-write]' if result['killed_mid_write'] else ''}"
              f"{' [mid-delete]' if result['killed_mid_delete'] else ''}", flush=True)
    tally["trials"] += tally["failed"]
    print(f"\nfault injection: {tally} in {time.monotonic() - start:.0f} s")
    return 1 if tally["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
