"""What ``on_preemption`` costs a step: ``maybe_save()`` with and without it, on 2 gloo ranks of this machine.

    torchrun --nproc-per-node=2 benchmarks/preemption_flag.py [--calls 2000]

With ``on_preemption`` set, every ``maybe_save()`` all-reduces one integer (MAX) so that the ranks agree on whether
any of them got the signal; without it, ``maybe_save()`` makes no collective when nothing is due. Rank 0 prints the
median time of a call each way, alternating rounds (the first is a warm-up).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from ckptio import CheckpointConfig, CheckpointManager


def per_call_us(mgr: CheckpointManager, calls: int, first: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for step in range(first, first + calls):
        mgr.maybe_save(step=step)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    model = torch.nn.Linear(4, 4)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp]
        dist.broadcast_object_list(folder)
        never = 10 ** 9
        mgrs = {mode: CheckpointManager(CheckpointConfig(checkpoint_dir=f"{folder[0]}/{mode}", persist_every_steps=never,
                                                         on_preemption="return" if mode == "on" else None,
                                                         run_record=False), model=model)
                for mode in times}
        for r in range(args.rounds + 1):
            for mode, mgr in mgrs.items():
                us = per_call_us(mgr, args.calls, 1 + r * args.calls)
                if r:
                    times[mode].append(us)
        for mgr in mgrs.values():
            mgr.close()
        dist.barrier()
    if dist.get_rank() == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"maybe_save() per call, 2 gloo ranks: {off:.1f} us without on_preemption, {on:.1f} us with it "
              f"(+{on - off:.1f} us: the all-reduce of the flag)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
