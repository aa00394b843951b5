"""Many SIGKILL trials against a saving job; prints the tally. The suite runs a few of the same trials.

    .venv/bin/python benchmarks/fault_injection.py --trials 50

Each trial starts 2 gloo ranks that save a 16 MiB FSDP2 model in a loop (half the trials with top-k
retention, so deletions happen on every save; every other pair with background saves, which write
one checkpoint while the loop overwrites the parameters for the next), SIGKILLs one rank at a random moment, then checks that
every committed checkpoint is intact byte for byte, that nothing committed was lost (the latest and
the best, under retention), and that a new run resumes from the newest with the right values.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kill import kill_trial  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    tally = {"trials": 0, "passed": 0, "failed": 0, "killed_mid_write": 0, "killed_mid_delete": 0}
    start = time.monotonic()
    for trial in range(args.trials):
        fmt = ("safetensors", "torch_save")[trial % 2]
        retention = trial % 4 >= 2
        async_save = trial % 8 >= 4
        with tempfile.TemporaryDirectory(prefix="ckptio-fault-") as root:
            try:
                result = kill_trial(root, fmt, retention, rng, async_save)
            except AssertionError as exc:
                tally["failed"] += 1
                print(f"trial {trial}: FAILED ({fmt}, retention={retention}, async={async_save}): {exc}", flush=True)
                continue
        tally["trials"] += 1
        tally["passed"] += 1
        tally["killed_mid_write"] += int(result["killed_mid_write"])
        tally["killed_mid_delete"] += int(result["killed_mid_delete"])
        print(f"trial {trial:>3}: ok ({fmt}, retention={retention}, async={async_save}) resumed at step {result['resumed_step']}"
              f"{' [mid-write]' if result['killed_mid_write'] else ''}"
              f"{' [mid-delete]' if result['killed_mid_delete'] else ''}", flush=True)
    tally["trials"] += tally["failed"]
    print(f"\nfault injection: {tally} in {time.monotonic() - start:.0f} s")
    return 1 if tally["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
