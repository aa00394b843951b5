"""How often the ranks of a restore wait for each other, and what those waits cost.

    .venv/bin/python benchmarks/restore_rounds.py [--world 2] [--repeats 7] [--layers 2] [--hidden 64]

Every rank saves a Llama-shaped model (``--layers``, ``--hidden``) with AdamW, an LR scheduler, the RNG and
a user object once, then restores it ``--repeats`` times into fresh objects with ``verify: full``, counting
the calls that reach ``torch.distributed`` during each restore (they all run for real, on gloo). Printed:
the collectives per restore, the median restore time, the median time of one bare ``all_gather_object``
round between the same ranks measured in the same run, and the share of the restore those rounds make.
Small states are where the rounds show: the bytes take no time, the waits do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

def _state(layers: int, hidden: int, seed: int):
    import torch
    from toy import Counter, make_model

    model = make_model(seed=seed, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 2), Counter()


def _rank(root: str, repeats: int, layers: int, hidden: int) -> dict:
    import torch
    import torch.distributed as dist
    from distributed import counting_collectives

    from ckptio import CheckpointConfig, CheckpointManager

    cfg = CheckpointConfig(checkpoint_dir=root, verify="full")
    model, opt, sched, counter = _state(layers, hidden, 0)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, extra_states={"c": counter}) as mgr:
        mgr.save(step=1)
    times, rounds, counts = [], [], {}
    for _ in range(repeats):
        model, opt, sched, counter = _state(layers, hidden, 1)
        mgr = CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, extra_states={"c": counter})
        dist.barrier()
        with counting_collectives() as counted:
            start = time.perf_counter()
            mgr.restore()
            times.append(time.perf_counter() - start)
        counts = dict(counted)
        mgr.close()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(20):
            dist.all_gather_object([None] * dist.get_world_size(), {"a": list(range(8))})
        rounds.append((time.perf_counter() - start) / 20)
    return {"collectives": sum(counts.values()), "by_kind": counts, "restore": statistics.median(times),
            "round": statistics.median(rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from distributed import run_ranks

    with tempfile.TemporaryDirectory(prefix="ckptio-rounds-") as tmp:
        results = run_ranks(args.world, _rank, timeout=900, root=f"{tmp}/ckpt", repeats=args.repeats,
                            layers=args.layers, hidden=args.hidden)
    slowest = max(r["restore"] for r in results)
    head = results[0]
    print(f"{args.world} ranks, {args.layers} layers x {args.hidden}, verify: full, median of {args.repeats}")
    print(f"  collectives per restore: {head['collectives']} {head['by_kind']}")
    print(f"  restore (slowest rank's median): {slowest * 1000:.1f} ms")
    print(f"  one all_gather_object round: {head['round'] * 1000:.2f} ms; "
          f"{head['collectives']} of them: {head['collectives'] * head['round'] * 1000:.1f} ms "
          f"({head['collectives'] * head['round'] / slowest:.0%} of the restore)")


if __name__ == "__main__":
    main()
