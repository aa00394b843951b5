"""The memory tier against a durable-only configuration, on 1, 2 and 4 ranks, in one run.

    .venv/bin/python benchmarks/memory_tier.py --size 256MB --repeats 5 [--worlds 1,2,4] [--durable s3]
        [--replicas 1,2,3] [--nodes 4]

Each world runs on real processes (gloo on CPU); its ranks form ``min(--nodes, ranks)`` "nodes" (default 2),
each with its own memory folder, so snapshots are replicated across nodes as on a cluster; each world runs once
per ``--replicas`` value (``memory_replicas``; a value above the node count is run once, capped). The state is an MLP (FSDP2 over the
ranks) with AdamW, about ``--size`` bytes in all. After one warm-up round, every round times, in a shuffled
order (seeded):

* ``memcpy``: copying the rank's part of the state (parameters and optimizer state) into buffers allocated once:
  the floor of any snapshot;
* ``memory``: ``save_memory()``: the *pause* (until it returns) and the *total* (until the snapshot is committed on
  every node), with the replication time and bytes from the tier's own figures;
* ``durable async``: ``save()`` with ``async_save`` to a local folder, or with ``--durable s3`` to a bucket of a
  loopback S3 server (moto) (pause, and total until committed);
* ``durable sync``: ``save()`` without it;
* restarts: a new manager (as a restarted process makes: the memory tier's group, node map and placement are set
  up again), ``restore()`` and one training step, timed to the end of that step: from the memory tier, and from
  the durable folder or bucket (a local folder's files are in the page cache);
* the memory the tier holds per node once a snapshot is committed (the fullest node's).

It prints medians (and ratios to ``memcpy``), then what follows for a run with a training step of ``--step-s``
seconds (default: this model's measured step) that may spend at most ``--overhead`` of its time pausing for
checkpoints: the shortest interval each configuration can keep (no more pause than the budget allows, and no save
started before the previous one is committed) and the steps a failure loses on average (half an interval, plus
the steps run while the newest save was still being written).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _size(text: str) -> int:
    from ckptio.formats.common import parse_size

    return parse_size(text)


def _build(size: int, world: int):
    import torch
    from torch import nn

    width = 1024
    layers = max(1, round(size / (12 * (width * width + width))))  # fp32 weights + AdamW's two moments
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, width


def _step(model, opt, width: int) -> float:
    import torch

    start = time.perf_counter()
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _local_tensors(model, opt) -> list:
    import torch

    out = []
    for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]:
        if isinstance(t, torch.Tensor):
            out.append(t.to_local() if hasattr(t, "to_local") else t)
    return [t.detach() for t in out]


def _rank(root: str, size: int, repeats: int, nodes: int, durable: str, replicas: int) -> dict:
    import torch
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    node = rank * nodes // world
    os.environ["CKPTIO_MEMORY_DIR"] = f"{root}/mem{node}"
    model, opt, width = _build(size, world)
    steps = [_step(model, opt, width) for _ in range(4)][1:]
    tensors = _local_tensors(model, opt)
    bufs = [torch.empty_like(t) for t in tensors]

    def manager(name: str, **kw):
        return CheckpointManager(CheckpointConfig(checkpoint_dir=f"{durable}/{name}", keep_latest=1, **kw),
                                 model=model, optimizer=opt, rng=False)

    tier = {"memory_every_steps": 1, "memory_replicas": replicas}
    mem, dur_async, dur_sync = manager("m", **tier), manager("a", async_save=True), manager("s")
    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "memory pause", "memory total", "write", "replicate",
                                                     "async pause", "async total", "sync total")}
    replicated: list[int] = []
    held: list[int] = []
    step = [0]

    def memcpy() -> None:
        start = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        times["memcpy"].append(time.perf_counter() - start)

    def timed(mgr, save, name: str) -> None:  # the pause until ``save`` returns, the total until committed
        step[0] += 1
        start = time.perf_counter()
        save(step=step[0])
        times[f"{name} pause"].append(time.perf_counter() - start)
        mgr.wait()
        times[f"{name} total"].append(time.perf_counter() - start)

    def memory() -> None:
        timed(mem, mem.save_memory, "memory")
        times["replicate"].append(mem.memory_tier.last["replicate_s"])
        times["write"].append(mem.memory_tier.last["write_s"])
        replicated.append(mem.memory_tier.last["replicated_bytes"])
        held.append(mem.memory_tier.last["node_bytes"])

    def durable_async() -> None:
        timed(dur_async, dur_async.save, "async")

    def durable_sync() -> None:
        step[0] += 1
        start = time.perf_counter()
        dur_sync.save(step=step[0])
        times["sync total"].append(time.perf_counter() - start)

    contenders = [memcpy, memory, durable_async, durable_sync]
    for c in contenders:  # warm-up: buffers allocated, folders made
        c()
    for k in times:
        times[k].clear()
    replicated.clear()
    order = random.Random(0)
    for _ in range(repeats):
        for c in order.sample(contenders, len(contenders)):  # the same order on every rank (same seed)
            c()
    restores: dict[str, list[float]] = {"restart memory": [], "restart durable": []}
    for _ in range(repeats):
        for name, made in (("restart memory", lambda: manager("m", **tier)), ("restart durable", lambda: manager("s"))):
            start = time.perf_counter()
            again = made()
            info = again.restore()
            _step(model, opt, width)
            restores[name].append(time.perf_counter() - start)
            assert info is not None and info.tier == name.split()[1], (name, info)
            again.close(free_memory=False)
    for mgr in (mem, dur_async, dur_sync):
        mgr.close()
    out = {k: statistics.median(v) for k, v in {**times, **restores}.items()}
    out["step"] = statistics.median(steps)
    out["bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["replicated"] = statistics.median(replicated) if replicated else 0
    out["held"] = statistics.median(held)
    out["copies"] = mem.memory_tier.nodes.placement.copies if mem.memory_tier.nodes is not None else 1
    return out


def _interval(pause: float, total: float, step: float, overhead: float) -> int:
    """The fewest steps between saves that keep the pauses within ``overhead`` and never start a save before the
    previous one is committed."""
    return max(1, math.ceil(pause / (overhead * step)), math.ceil(total / step))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MB", help="the whole state (all ranks): parameters + AdamW")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--step-s", type=float, default=None, help="training step time for the derived figures")
    p.add_argument("--overhead", type=float, default=0.05, help="share of training time checkpoints may pause it")
    p.add_argument("--durable", choices=("local", "s3"), default="local")
    p.add_argument("--replicas", default="2", help="memory_replicas values to run, e.g. 1,2,3")
    p.add_argument("--nodes", type=int, default=2, help="memory folders ('nodes') the ranks are spread over")
    args = p.parse_args()
    server = None
    if args.durable == "s3":
        import uuid

        import s3server

        server, url = s3server.start()
        os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
        from ckptio.storage.s3 import client

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client().create_bucket(Bucket=bucket)
    try:
        rows = _measure(args, None if server is None else bucket)
    finally:
        if server is not None:
            server.terminate()
    _report(args, rows)


def _measure(args: argparse.Namespace, bucket: str | None) -> list:
    from distributed import run_ranks

    size = _size(args.size)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        nodes = min(world, args.nodes)
        for k in sorted({min(int(k), nodes) for k in args.replicas.split(",")}):
            with tempfile.TemporaryDirectory(prefix="ckptio-memtier-") as root:
                durable = root if bucket is None else f"s3://{bucket}/w{world}k{k}"
                results = run_ranks(world, _rank, timeout=3600, root=root, size=size, repeats=args.repeats,
                                    nodes=nodes, durable=durable, replicas=k)
            worst = {key: max(r[key] for r in results) for key in results[0]}  # the slowest rank sets the pace
            rows.append((f"{world} on {nodes}, K={k}", worst))
    return rows


def _report(args: argparse.Namespace, rows: list) -> None:
    size = _size(args.size)
    print(f"\ndurable tier: {'a loopback S3 server' if args.durable == 's3' else 'a local folder'}; "
          f"state {size / 1e6:.0f} MB in all; medians of {args.repeats} rounds; times are the slowest rank's\n")
    head = ("ranks on nodes, K", "MB/rank", "MB held/node", "memcpy", "mem pause", "x memcpy", "write",
            "replicate (MB)", "mem total", "async pause", "async total", "sync total", "restart->step: mem",
            "durable", "durable/mem")
    print(" | ".join(head))
    for world, r in rows:
        print(" | ".join([str(world), f"{r['bytes'] / 1e6:.0f}", f"{r['held'] / 1e6:.0f}", f"{r['memcpy']:.3f}",
                          f"{r['memory pause']:.3f}", f"{r['memory pause'] / r['memcpy']:.2f}", f"{r['write']:.3f}",
                          f"{r['replicate']:.3f} ({r['replicated'] / 1e6:.0f})",
                          f"{r['memory total']:.3f}", f"{r['async pause']:.3f}", f"{r['async total']:.3f}",
                          f"{r['sync total']:.3f}", f"{r['restart memory']:.3f}", f"{r['restart durable']:.3f}",
                          f"{r['restart durable'] / r['restart memory']:.2f}"]))
    print(f"\nintervals and steps lost per failure, at most {args.overhead:.0%} of the time paused:")
    print("ranks | step s | memory: every / lost | durable async: every / lost | durable sync: every / lost")
    for world, r in rows:
        step = args.step_s or r["step"]
        cells = []
        for pause, total in ((r["memory pause"], r["memory total"]), (r["async pause"], r["async total"]),
                             (r["sync total"], r["sync total"])):
            every = _interval(pause, total, step, args.overhead)
            cells.append(f"{every} / {every / 2 + math.ceil(total / step):.1f}")
        print(f"{world} | {step:.3f} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
