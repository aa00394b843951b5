"""Expected training lost per day to failures, with and without the memory tier, at 1k-10k GPUs (a simulation).

    .venv/bin/python benchmarks/lost_work_model.py [--failures-per-1k-gpu-day 0.53] [--durable-every-min 30]
        [--memory-every-min 1] [--days 365] [--seed 0]

A job of N GPUs (8 per node) trains without pause except for failures. Failures arrive as a Poisson process,
``--failures-per-1k-gpu-day`` per thousand GPUs per day (the default, 0.53, is what Meta reported for Llama 3
pre-training: 466 interruptions in 54 days on 16,384 GPUs). Each failure stops the whole job; the work lost is the
time since the newest checkpoint the restart can use, plus the restart itself (``--restart-min``, the same for
both configurations, scheduling and start-up) and the restore.

* **durable only**: a durable checkpoint every ``--durable-every-min`` minutes, ready ``--durable-commit-min``
  after it starts; a restore takes ``--durable-restore-min``.
* **with the memory tier**: the same durable checkpoints, plus a memory snapshot every ``--memory-every-min``
  minutes, committed ``--memory-commit-min`` after it starts; a restore from it takes ``--memory-restore-min``. A
  failure loses the memory tier only when both copies of some rank's part are gone: a share
  ``--correlated`` of the failures take down a group of ``--group`` consecutive nodes (a rack, a switch, a power
  domain) and node ranks are assumed to follow that grouping (the worst case: a node and its ring successor go
  together). Every other failure (one node lost, or a crash that leaves every node's memory in place) restores
  one node is lost and its ranks' parts come from their replicas.

Prints, per job size: failures per day, the expected hours lost per failure and the GPU-hours lost per day for
each configuration, and the share of the job's compute that is.
"""

from __future__ import annotations

import argparse
import random


def simulate(gpus: int, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    rate = args.failures_per_1k_gpu_day * gpus / 1000  # failures per day
    t, failures = 0.0, 0
    lost = {"durable": 0.0, "memory": 0.0, "fallbacks": 0.0}
    nodes = max(1, gpus // 8)
    while True:
        t += rng.expovariate(rate)
        if t > args.days:
            break
        failures += 1
        since_durable = rng.uniform(0, args.durable_every_min) + args.durable_commit_min
        restart = args.restart_min
        lost["durable"] += since_durable + restart + args.durable_restore_min
        kind = rng.random()
        both_copies_gone = kind < args.correlated and min(args.group, nodes) > 1
        if both_copies_gone:
            lost["fallbacks"] += 1
            lost["memory"] += since_durable + restart + args.durable_restore_min
        else:  # a software crash, or one node lost (its replica is on the next node)
            since_memory = rng.uniform(0, args.memory_every_min) + args.memory_commit_min
            lost["memory"] += min(since_memory, since_durable) + restart + args.memory_restore_min
    days = args.days
    return {"failures/day": failures / days,
            "durable h/failure": lost["durable"] / 60 / max(failures, 1),
            "memory h/failure": lost["memory"] / 60 / max(failures, 1),
            "durable GPU-h/day": lost["durable"] / 60 * gpus / days,
            "memory GPU-h/day": lost["memory"] / 60 * gpus / days,
            "fallbacks": lost["fallbacks"] / max(failures, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1000,2000,5000,10000")
    p.add_argument("--failures-per-1k-gpu-day", type=float, default=0.53)
    p.add_argument("--durable-every-min", type=float, default=30.0)
    p.add_argument("--durable-commit-min", type=float, default=2.0)
    p.add_argument("--durable-restore-min", type=float, default=5.0)
    p.add_argument("--memory-every-min", type=float, default=1.0)
    p.add_argument("--memory-commit-min", type=float, default=0.2)
    p.add_argument("--memory-restore-min", type=float, default=0.5)
    p.add_argument("--restart-min", type=float, default=5.0)
    p.add_argument("--correlated", type=float, default=0.05)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--days", type=float, default=365.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    print(f"failures: {args.failures_per_1k_gpu_day} per 1k GPUs per day; durable every {args.durable_every_min} min; "
          f"memory every {args.memory_every_min} min; restart {args.restart_min} min; {args.correlated:.0%} of "
          f"failures take both copies; {args.days:.0f} simulated days\n")
    print("GPUs | failures/day | h lost/failure: durable, memory | GPU-h lost/day: durable, memory | share of compute: "
          "durable, memory | memory tier unusable")
    for gpus in (int(g) for g in args.gpus.split(",")):
        r = simulate(gpus, args, rng)
        print(f"{gpus} | {r['failures/day']:.2f} | {r['durable h/failure']:.2f}, {r['memory h/failure']:.2f} | "
              f"{r['durable GPU-h/day']:.0f}, {r['memory GPU-h/day']:.0f} | "
              f"{r['durable GPU-h/day'] / (24 * gpus):.2%}, {r['memory GPU-h/day'] / (24 * gpus):.2%} | "
              f"{r['fallbacks']:.1%} of failures")


if __name__ == "__main__":
    main()
