"""Each byte read once: a DDP-replicated restore on N ranks, with and without ``share_reads``, in one run.

    .venv/bin/python benchmarks/shared_reads.py --world 2 --size 600MB --repeats 3
    .venv/bin/python benchmarks/shared_reads.py --world 4 --size 600MB --repeats 3
    .venv/bin/python benchmarks/shared_reads.py --world 2 --size 600MB --repeats 3 --s3   # a local S3 server

Every rank holds the whole state (a Llama and its AdamW, as under DDP); it is saved once with the default layout
(safetensors model + DCP optimizer, ``verify: full``). Each round then restores it with ``share_reads=True`` (each
replicated byte read by one rank and sent to the others) and ``False`` (every rank reads all it restores), in a
shuffled order, from a warm page cache and, when this process may drop the page cache (root), from a cold one.

Printed per contender: the median restore time (slowest rank); the data bytes read summed over the ranks ÷ the
checkpoint's data bytes (``os.preadv`` on the ``.safetensors`` / ``.distcp`` files, or ranged ``GET`` s, counted in
each rank); from ``/proc/self/io``, ``rchar`` (every byte a read returned: a cross-check that nothing read around
the counter) and ``read_bytes`` (the bytes the storage device itself served: on one node the page cache lets
several ranks reading one file cost one device read); and the ratio of times.
Each restore is checked bitwise against the saved state (a CRC-32C of every tensor on every rank).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from save_load import _size, build_state, drop_caches, rank_main  # noqa: E402


def _digest(model, opt) -> dict[str, int]:
    """A CRC-32C of every tensor of the model and the optimizer, by name."""
    from crc32c import crc32c

    names = {p: n for n, p in model.named_parameters()}
    tensors = dict(model.state_dict())
    tensors.update({f"{names.get(p, i)}.{k}": v for i, (p, s) in enumerate(opt.state.items()) for k, v in s.items()})
    return {k: crc32c(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
            for k, t in tensors.items() if isinstance(t, torch.Tensor)}


DATA = (".safetensors", ".distcp")


class _Reads:
    """Bytes read from the checkpoint's data files in this process: ``os.preadv`` on a disk, ranged ``GET`` s from a
    bucket (the counters wrap the calls; every read still happens)."""

    def __init__(self, under: str) -> None:
        from ckptio.storage.s3.reader import S3ReadHandle

        self.counts: Counter = Counter()
        real, real_get = os.preadv, S3ReadHandle._get

        def preadv(fd, buffers, offset, *rest):
            got = real(fd, buffers, offset, *rest)
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return got
            if path.startswith(under) and path.endswith(DATA):
                self.counts["data"] += got
            return got

        def get(handle, view, offset):
            real_get(handle, view, offset)
            if str(handle.path).startswith(under) and str(handle.path).endswith(DATA):
                self.counts["data"] += view.nbytes

        os.preadv = preadv
        S3ReadHandle._get = get

    def take(self) -> int:
        n = self.counts["data"]
        self.counts.clear()
        return n


def _io() -> tuple[int, int]:
    """This process's ``rchar`` (bytes its reads returned, page cache or not) and ``read_bytes`` (bytes it had fetched
    from the storage device) from ``/proc/self/io``."""
    fields = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            fields[name] = int(value)
    return fields.get("rchar", 0), fields.get("read_bytes", 0)


def run(args: argparse.Namespace, base: Path) -> None:
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager

    import logging

    logging.getLogger("ckptio").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    model, opt = build_state(_size(args.size))
    want = _digest(model, opt)
    root = str(base / "ck") if args.bucket is None else f"s3://{args.bucket}/ck"
    CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, rng=False).save(step=1)
    step = f"{root}/epoch_0_step_1"
    data = _data_bytes(step)
    say(f"{world} ranks, DDP-replicated state: {data / 1e9:.2f} GB of data files in {step}")
    reads = _Reads(step)
    cold = args.bucket is None and _shared_flag(drop_caches() if rank == 0 else False)
    modes = ["warm", "cold"] if cold else ["bucket"] if args.bucket else ["warm"]
    contenders = ["share_reads=True", "share_reads=False"]
    samples: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    rng = random.Random(args.seed)
    # a fresh optimizer per restore (as a resumed run has) would add the same first-touch cost to both; the live
    # objects are reused, so the rows compare the reads and the transfer
    for r in range(args.repeats + 1):  # round 0 warms up (page cache, first-touch of the live state)
        order = [(m, c) for m in modes for c in contenders]
        rng.shuffle(order)
        for mode, name in order:
            for p in model.parameters():
                p.data.zero_()
            if mode == "cold":
                dist.barrier()
                if rank == 0:
                    drop_caches()
            dist.barrier()
            reads.take()
            before = _io()
            cfg = CheckpointConfig(checkpoint_dir=root, share_reads=name.endswith("True"))
            t0 = time.perf_counter()
            CheckpointManager(cfg, model=model, optimizer=opt, rng=False).restore(step)
            elapsed = time.perf_counter() - t0
            got = _digest(model, opt)
            after = _io()
            counted = reads.take()
            out = [None] * world
            wrong = sorted(k for k in want if got.get(k) != want[k])
            dist.all_gather_object(out, (elapsed, counted, after[0] - before[0], after[1] - before[1], wrong))
            if any(o[4] for o in out):
                raise SystemExit(f"{name} ({mode}) did not restore the saved state bitwise: "
                                 + "; ".join(f"rank {i}: {o[4][:3]}" for i, o in enumerate(out) if o[4]))
            if r:
                samples.setdefault((mode, name), []).append(
                    (max(o[0] for o in out), *(sum(o[i] for o in out) for i in (1, 2, 3))))
    say(f"\n{'restore':<28}{'median s':>10}{'read ÷ data':>13}{'rchar ÷ data':>14}{'device ÷ data':>15}"
        f"{'time ÷ share=False':>20}")
    rows: dict[str, dict] = {}
    for mode in modes:
        base_t = statistics.median(s[0] for s in samples[(mode, "share_reads=False")])
        for name in contenders:
            s = samples[(mode, name)]
            t = statistics.median(x[0] for x in s)
            cols = [statistics.median(x[i] for x in s) / data for i in (1, 2, 3)]
            rows[f"{mode}, {name}"] = {"seconds": t, "read": cols[0], "rchar": cols[1], "device": cols[2],
                                       "time_vs_unshared": t / base_t, "samples": s}
            say(f"{mode + ', ' + name:<28}{t:>10.3f}{cols[0]:>13.2f}"
                + (f"{'n/a':>14}{'n/a':>15}" if mode == "bucket" else f"{cols[1]:>14.2f}{cols[2]:>15.2f}")
                + f"{t / base_t:>20.2f}")
    say("every restore bitwise equal to the saved state on every rank; read: bytes the counters saw from the data "
        "files, rchar / device: /proc/self/io (all reads, and those the storage device served), all summed over ranks")
    if args.json and rank == 0:
        import json

        Path(args.json).write_text(json.dumps({"world": world, "data_bytes": data, "rows": rows}, indent=1))


def _data_bytes(step: str) -> int:
    """Bytes of the step's data files (``.safetensors``, ``.distcp``), on a disk or in a bucket."""
    if not step.startswith("s3://"):
        return sum(p.stat().st_size for p in Path(step).rglob("*") if p.suffix in DATA)
    from ckptio.storage.s3 import client

    bucket, _, prefix = step[len("s3://"):].partition("/")
    pages = client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(DATA))


def _shared_flag(cold: bool) -> bool:
    import torch.distributed as dist

    box = [cold]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="600MB", help="approximate bytes of model + optimizer state (each rank holds all)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder on this disk)")
    p.add_argument("--s3", action="store_true", help="keep the checkpoint in a bucket of a local S3 server (moto)")
    p.add_argument("--json", default=None, help="write the rows and samples here")
    args = p.parse_args()
    args.bucket = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import shutil
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckptio-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    server = None
    try:
        if args.s3:
            import uuid

            import s3server

            server, url = s3server.start()
            os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
            from ckptio.storage.s3 import client

            args.bucket = f"bench-{uuid.uuid4().hex[:8]}"
            client().create_bucket(Bucket=args.bucket)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(rank_main, args=(args.world, os.path.join(tmp, "store"), run, args, base),
                               nprocs=args.world, start_method="spawn")
    finally:
        if server is not None:
            server.terminate()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
