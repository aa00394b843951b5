"""Expected training lost per day to failures, with and without the memory tier, at 1k-10k GPUs (a simulation).

    .venv/bin/python benchmarks/lost_work_model.py [--failures-per-1k-gpu-day 0.53] [--durable-every-min 30]
        [--memory-every-min 1] [--node-loss 0.6] [--correlated 0.05] [--group 4] [--days 365] [--seed 0]

A job of N GPUs (8 per node) trains without pause except for failures. Failures arrive as a Poisson process,
``--failures-per-1k-gpu-day`` per thousand GPUs per day (the default, 0.53, is what Meta reported for Llama 3
pre-training: 466 interruptions in 54 days on 16,384 GPUs). Each failure stops the whole job; the work lost is the
time since the newest checkpoint the restart can use, plus the restart itself (``--restart-min``, the same for
every configuration, scheduling and start-up) and the restore.

Three kinds of failure: a share ``--correlated`` takes down a group of ``--group`` nodes that share a failure
domain (a rack, a switch, a power feed); a share ``--node-loss`` loses one node with its memory (a GPU or host
fault, the node replaced); the rest are crashes that leave every node's memory in place (software, a
network blip). The configurations compared (the same draws for all):

* **durable**: a durable checkpoint every ``--durable-every-min`` minutes, ready ``--durable-commit-min`` after it
  starts; a restore takes ``--durable-restore-min``.
* **K=1, K=2, K=3** (``memory_replicas``): the same durable checkpoints, plus a memory snapshot every
  ``--memory-every-min`` minutes, committed ``--memory-commit-min`` after it starts, each part on K nodes, placed
  without failure domains (``CKPTIO_FAILURE_DOMAIN`` unset): the copies of a part are on K nodes in a row, and the
  worst case is assumed, that node ranks follow the racks, so a group failure takes every copy of some part when
  the group is at least K nodes. K=1 loses the memory tier with any node.
* **K=2 + domains**: two copies on nodes of distinct domains: only a crash of the job itself, a node, or one
  group is modelled, and none of them takes both copies.

A failure that takes every copy of some part falls back to the durable tier. Prints, per job size and
configuration: the expected hours lost per failure, the GPU-hours lost per day, the share of the job's compute
that is, and the share of failures that fell back to the durable tier.
"""

from __future__ import annotations

import argparse
import random

CONFIGS = (("durable", 0, False), ("K=1", 1, False), ("K=2", 2, False), ("K=2 + domains", 2, True),
           ("K=3", 3, False))
"""(name, memory_replicas (0: no memory tier), copies on distinct domains)."""


def _memory_lost(kind: str, replicas: int, domains: bool, group: int) -> bool:
    """Whether a failure of ``kind`` takes every copy of some part."""
    if kind == "crash":
        return False
    if kind == "node":
        return replicas == 1
    return not (domains and replicas > 1) and group >= replicas  # a group of nodes in a row, one domain


def simulate(gpus: int, args: argparse.Namespace, rng: random.Random) -> dict[str, dict[str, float]]:
    """Lost minutes per configuration over ``args.days`` days of a job of ``gpus`` GPUs."""
    rate = args.failures_per_1k_gpu_day * gpus / 1000  # failures per day
    group = min(args.group, max(1, gpus // 8))
    t, failures = 0.0, 0
    lost = {name: 0.0 for name, _, _ in CONFIGS}
    fallbacks = {name: 0 for name, _, _ in CONFIGS}
    while True:
        t += rng.expovariate(rate)
        if t > args.days:
            break
        failures += 1
        draw = rng.random()
        kind = "group" if draw < args.correlated else "node" if draw < args.correlated + args.node_loss else "crash"
        since_durable = rng.uniform(0, args.durable_every_min) + args.durable_commit_min
        since_memory = min(rng.uniform(0, args.memory_every_min) + args.memory_commit_min, since_durable)
        for name, replicas, domains in CONFIGS:
            if replicas == 0 or _memory_lost(kind, replicas, domains, group):
                fallbacks[name] += replicas > 0
                lost[name] += since_durable + args.restart_min + args.durable_restore_min
            else:
                lost[name] += since_memory + args.restart_min + args.memory_restore_min
    n = max(failures, 1)
    return {name: {"failures/day": failures / args.days, "h/failure": lost[name] / 60 / n,
                   "GPU-h/day": lost[name] / 60 * gpus / args.days, "fallbacks": fallbacks[name] / n}
            for name, _, _ in CONFIGS}


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
    p.add_argument("--node-loss", type=float, default=0.6, help="share of failures that lose one node's memory")
    p.add_argument("--correlated", type=float, default=0.05, help="share of failures that take a group of nodes")
    p.add_argument("--group", type=int, default=4, help="nodes in a failure domain")
    p.add_argument("--days", type=float, default=365.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"failures: {args.failures_per_1k_gpu_day} per 1k GPUs per day ({args.node_loss:.0%} lose a node, "
          f"{args.correlated:.0%} a group of {args.group}); durable every {args.durable_every_min} min; memory every "
          f"{args.memory_every_min} min; restart {args.restart_min} min; {args.days:.0f} simulated days\n")
    names = [name for name, _, _ in CONFIGS]
    print("GPUs | failures/day | h lost/failure: " + ", ".join(names) + " | share of compute lost: " +
          ", ".join(names) + " | fell back to durable: " + ", ".join(names[1:]))
    for gpus in (int(g) for g in args.gpus.split(",")):
        r = simulate(gpus, args, random.Random(args.seed))
        print(f"{gpus} | {r['durable']['failures/day']:.2f} | "
              + ", ".join(f"{r[n]['h/failure']:.2f}" for n in names) + " | "
              + ", ".join(f"{r[n]['GPU-h/day'] / (24 * gpus):.2%}" for n in names) + " | "
              + ", ".join(f"{r[n]['fallbacks']:.0%}" for n in names[1:]))


if __name__ == "__main__":
    main()
