"""The CPU a DCP save of an FSDP2 AdamW state costs each rank, split into the data (``write_data``: the tensors' bytes
into the rank's file) and the rest (DCP's planning, the rounds between the ranks, rank 0's ``.metadata``).

    PYTHONPATH=src python benchmarks/dcp_save_cpu.py --world 4 --size 256MB

Each of ``--world`` gloo ranks saves its share of the state (``ckptio.formats.dcp.save.save``) into a folder on
``/dev/shm`` ``--saves`` times after a first save (which fills torch's plan cache and the rounds' frame sizes); the
medians of the rank's process CPU are printed, per rank and the rest summed over the ranks. Run the old and the new
code alternately (PYTHONPATH) to compare them: CPU-seconds hold on a shared machine where wall-clock does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from save_load import _size, build_state
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ckptio.formats.dcp import save as dcp_save

    model, opt = build_state(_size(args.size), shard=True)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    in_data = [0.0]
    write_data = dcp_save._OneFilePerRank.write_data

    def timed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        start = time.process_time()
        try:
            return write_data(self, *a, **k)
        finally:
            in_data[0] += time.process_time() - start

    dcp_save._OneFilePerRank.write_data = timed  # type: ignore[method-assign]
    totals, data = [], []
    for i in range(args.saves + 1):
        folder = os.path.join(out, f"s{i}")
        in_data[0] = 0.0
        dist.barrier()
        start = time.process_time()
        dcp_save.save(state, folder)
        spent = time.process_time() - start
        if i:
            totals.append(spent)
            data.append(in_data[0])
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder)
    mine = (statistics.median(totals) * 1000, statistics.median(data) * 1000)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        print("save/write_data ms per rank: " + " ".join(f"{t:.1f}/{w:.1f}" for t, w in ranks)
              + " | the rest per rank: " + " ".join(f"{t - w:.1f}" for t, w in ranks)
              + f" | the rest summed: {sum(t - w for t, w in ranks):.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--size", default="256MB")
    parser.add_argument("--saves", type=int, default=7)
    args = parser.parse_args()
    import torch.multiprocessing as mp
    from save_load import rank_main

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        mp.start_processes(rank_main, args=(args.world, os.path.join(tmp, "store"), run, args, os.path.join(tmp, "ck")),
                           nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
