"""How the load plan grows with the number of ranks that wrote a checkpoint (metadata only).

    .venv/bin/python benchmarks/plan_scaling.py [--ranks 128,256,512,1024] [--tensors 200] [--repeats 3]

For each rank count N a sharded-safetensors checkpoint is simulated: N shard files, each holding its
row block of ``--tensors`` tensors (a few bytes of data each; only the headers matter), exactly as N
FSDP ranks would write them. Then one rank of a job on N/2 ranks plans its load the way
``restore`` does: read every header and check that the chunks of each tensor cover it exactly once
(``scan``), then find the overlaps of every stored chunk with its own rows (``plan``). Printed: the
median of each phase, per-chunk cost, and the ratio to the previous row — about 2 for each doubling of
N means linear in ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROWS_PER_RANK = 2
COLS = 4


def write_checkpoint(folder: Path, ranks: int, tensors: int) -> None:
    import torch

    from ckptio.formats import _st_writer
    from ckptio.formats.safetensors_sharded import FORMAT_TAG, shard_file_name
    from ckptio.storage import LocalFolderWriter

    writer = LocalFolderWriter.in_place(folder)
    local = torch.zeros(ROWS_PER_RANK, COLS)
    for rank in range(ranks):
        shards = {f"layers.{i}.weight": {"shape": [ROWS_PER_RANK * ranks, COLS], "offsets": [ROWS_PER_RANK * rank, 0]}
                  for i in range(tensors)}
        meta = {"format": "pt", "ckptio_format": FORMAT_TAG, "ckptio_rank": str(rank),
                "ckptio_world_size": str(ranks), "ckptio_shards": json.dumps(shards, separators=(",", ":"))}
        entries = [_st_writer.Entry(k, local.dtype, tuple(local.shape), lambda: local) for k in shards]
        _st_writer.write(writer.open(shard_file_name(rank, ranks)), entries, meta)


def plan_once(folder: Path, ranks: int) -> tuple[float, float, int]:
    from ckptio.formats.safetensors_sharded import _scan
    from ckptio.plan import overlap

    t0 = time.perf_counter()
    chunks, infos = _scan(folder)
    t1 = time.perf_counter()
    loaders = max(1, ranks // 2)
    me = loaders // 2  # a rank in the middle of the new layout
    boxes = 0
    for key, parts in chunks.items():
        rows = infos[key].shape[0]
        lo = rows * me // loaders
        hi = rows * (me + 1) // loaders
        for c in parts:
            if overlap((lo, 0), (hi - lo, COLS), c.offsets, c.shape) is not None:
                boxes += 1
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, boxes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="128,256,512,1024")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    print(f"{args.tensors} tensors, each split over N ranks; one rank of an N/2-rank job plans its load")
    print(f"{'N':>6} {'chunks':>8} {'scan s':>8} {'plan s':>8} {'us/chunk':>9} {'x prev':>7}")
    previous = None
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="ckptio-plan-") as tmp:
            folder = Path(tmp)
            write_checkpoint(folder, n, args.tensors)
            runs = [plan_once(folder, n) for _ in range(args.repeats)]
        scan = statistics.median(r[0] for r in runs)
        plan = statistics.median(r[1] for r in runs)
        total = scan + plan
        chunks = n * args.tensors
        ratio = f"{total / previous:.2f}" if previous else "-"
        print(f"{n:>6} {chunks:>8} {scan:>8.3f} {plan:>8.3f} {total / chunks * 1e6:>9.2f} {ratio:>7}", flush=True)
        previous = total
    return 0


if __name__ == "__main__":
    sys.exit(main())
