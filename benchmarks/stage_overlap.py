"""Would a background save finish sooner if its writer started while the state is still being staged?

    .venv/bin/python benchmarks/stage_overlap.py --size 1.8GB --repeats 6

A background save copies the state into staging buffers (``save()`` blocks for that copy), then a
thread writes the buffers and fsyncs. This measures, on one process, three ways of writing the same
bytes to one file with a CRC-32C of every byte, as ckptio's writer does:

* ``sync``: write straight from the live tensors (a synchronous save);
* ``stage, then write``: copy into the buffers, then write them (what ckptio does);
* ``overlapped``: a writer thread starts at once and writes each buffer as soon as its copy is done.

It prints, as medians after a warm-up round in a shuffled order, how long the caller is blocked (the
copy) and how long until the file is durable, each against the synchronous write. Overlapping pays only
if it shortens the time to durable by more than it lengthens the pause.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

from ckptio.formats.safetensors.hf_bundle import parse_size
from ckptio.storage.checksum import RunningChecksum


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.8GB")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder on this disk)")
    args = p.parse_args()
    per = 6 << 20  # 6 MiB tensors, about a medium Llama's attention and MLP shards
    count = max(1, parse_size(args.size) // per)
    live = [torch.randn(per // 4) for _ in range(count)]
    buffers = [torch.empty_like(t) for t in live]
    for b, t in zip(buffers, live):
        b.copy_(t)  # allocated and touched once, as reused staging buffers are
    tmp = tempfile.TemporaryDirectory(dir=args.dir)
    path = os.path.join(tmp.name, "state.bin")

    def write(tensors: list[torch.Tensor], ready=None) -> None:
        crc = RunningChecksum()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i, t in enumerate(tensors):
                if ready is not None:
                    ready(i)
                view = memoryview(t.numpy()).cast("B")
                os.write(fd, view)
                crc.update(view)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync() -> tuple[float, float]:
        t0 = time.perf_counter()
        write(live)
        return 0.0, time.perf_counter() - t0

    def staged() -> tuple[float, float]:
        t0 = time.perf_counter()
        for b, t in zip(buffers, live):
            b.copy_(t)
        blocked = time.perf_counter() - t0
        write(buffers)
        return blocked, time.perf_counter() - t0

    def overlapped() -> tuple[float, float]:
        cond, done = threading.Condition(), [0]

        def ready(i: int) -> None:
            with cond:
                cond.wait_for(lambda: done[0] > i)

        t0 = time.perf_counter()
        writer = threading.Thread(target=write, args=(buffers, ready))
        writer.start()
        for i, (b, t) in enumerate(zip(buffers, live)):
            b.copy_(t)
            with cond:
                done[0] = i + 1
                cond.notify_all()
        blocked = time.perf_counter() - t0
        writer.join()
        return blocked, time.perf_counter() - t0

    def memcpy() -> tuple[float, float]:
        t0 = time.perf_counter()
        for b, t in zip(buffers, live):
            b.copy_(t)
        return time.perf_counter() - t0, 0.0

    lanes = {"sync": sync, "stage, then write": staged, "overlapped": overlapped, "memory copy": memcpy}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in lanes}
    for r in range(args.repeats + 1):
        order = list(lanes)
        random.Random(r).shuffle(order)
        for name in order:
            os.sync()
            res = lanes[name]()
            if r:
                results[name].append(res)
        print(f"  round {r}{' (warm-up)' if r == 0 else ''} done", flush=True)
    sync_t = statistics.median(d for _, d in results["sync"])
    copy_t = statistics.median(b for b, _ in results["memory copy"])
    print(f"\n{count * per / 1e9:.2f} GB in {count} tensors; medians of {args.repeats} rounds")
    print(f"  {'':<20} {'blocked':>8} {'÷ memcpy':>9} {'durable':>8} {'÷ sync':>7}  durable min-max")
    for name in ("sync", "stage, then write", "overlapped"):
        blocked = statistics.median(b for b, _ in results[name])
        durable = [d for _, d in results[name]]
        print(f"  {name:<20} {blocked:7.3f}s {blocked / copy_t:9.2f} {statistics.median(durable):7.3f}s "
              f"{statistics.median(durable) / sync_t:7.2f}  {min(durable):.2f}-{max(durable):.2f}")
    print(f"  {'memory copy':<20} {copy_t:7.3f}s")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
