"""The long fuzzing run of ckptio's readers (the suite runs the same properties with fewer examples).

    .venv/bin/python benchmarks/fuzz_readers.py [--examples 3000]

Mutates valid sharded safetensors files, DCP metadata pickles and manifests at random and checks that
every reader raises only ckptio's own errors. A failing input is printed by hypothesis; add it to
tests/test_hostile.py as a named case so it stays fixed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=3000, help="examples per property")
    args = p.parse_args()
    env = {**os.environ, "CKPTIO_HYPOTHESIS_PROFILE": "fuzz", "CKPTIO_FUZZ_EXAMPLES": str(args.examples)}
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_hostile.py"), "-q", "-p", "no:cacheprovider",
           "-k", "mutated or random", "--hypothesis-show-statistics"]
    return subprocess.call(cmd, env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
