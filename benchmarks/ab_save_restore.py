"""A/B check of a refactor: save and restore times of whichever ckptio is importable, to compare two trees.

    git worktree add /tmp/ckptio-before <commit>
    for side in before after before after; do
        root=$([ $side = before ] && echo /tmp/ckptio-before || echo .)
        PYTHONPATH=$root/src .venv/bin/python benchmarks/ab_save_restore.py --label $side
    done

One process builds a Llama + AdamW state (``--size``), then alternates sync saves with io_threads 1 and 2
and restores (warm page cache), each into a fresh folder, and prints medians (the first round is a
warm-up). Run the two trees alternately, twice each: this VM's disk varies between runs more than a
refactor should change anything, so only differences that repeat across the alternation count.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from save_load import _size, build_state

    from ckptio import CheckpointConfig, CheckpointManager

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="this tree")
    p.add_argument("--size", default="256MiB")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    model, opt = build_state(_size(args.size))
    base = Path(tempfile.mkdtemp(prefix="ckptio-ab-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    rows: dict[str, list[float]] = {"save io_threads=1": [], "save io_threads=2": [], "restore (warm)": []}
    try:
        for r in range(args.rounds):
            for threads in (1, 2):
                d = base / f"r{r}-{threads}"
                os.sync()
                t = time.perf_counter()
                with CheckpointManager(CheckpointConfig(checkpoint_dir=str(d), io_threads=threads), model=model,
                                       optimizer=opt, rng=False) as mgr:
                    mgr.save(step=1)
                rows[f"save io_threads={threads}"].append(time.perf_counter() - t)
            t = time.perf_counter()
            CheckpointManager(CheckpointConfig(checkpoint_dir=str(base / f"r{r}-1")), model=model, optimizer=opt,
                              rng=False).restore()
            rows["restore (warm)"].append(time.perf_counter() - t)
            for threads in (1, 2):
                shutil.rmtree(base / f"r{r}-{threads}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.label}: " + ", ".join(f"{k} {statistics.median(v[1:]):.3f} s" for k, v in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
