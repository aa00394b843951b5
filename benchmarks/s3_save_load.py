"""ckptio save and restore to an ``s3://`` folder against the same client's raw upload and download of the
same bytes, on a local S3-compatible server (moto's, started here on 127.0.0.1), on 1 or more ranks.

    .venv/bin/python benchmarks/s3_save_load.py --size 256MB --repeats 3
    .venv/bin/python benchmarks/s3_save_load.py --size 256MB --repeats 3 --world 2   # gloo ranks, FSDP2 state

The state is the Llama + AdamW of ``save_load.py`` (``--size`` bytes in all, FSDP2-sharded on several ranks),
saved in the default layout. The loopback server is slow and does most of the work, so only the ratios mean
anything: ckptio's save (manifest, checksums, commit protocol) over a raw ``put_object`` of every object of
the same checkpoint, and ckptio's restore (``verify: size``) over a raw ``get_object`` of every object. On
several ranks the objects are dealt out to the ranks by size for the raw rows, every rank moving its share at
once, and each time is the slowest rank's (barrier to barrier). Medians over ``--repeats`` rounds, the
contenders interleaved in each round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _barrier()
    start = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - start


def run(args: argparse.Namespace, bucket: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager
    from ckptio.storage.s3 import client
    from save_load import _size, build_state

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    s3 = client()
    model, opt = build_state(_size(args.size), shard=world > 1)
    times: dict[str, list[float]] = {"save": [], "raw put": [], "restore": [], "raw get": []}
    total, count = 0, 0
    for round_ in range(args.repeats + 1):  # round 0 warms up and is not counted
        root = f"s3://{bucket}/r{round_}"

        def save() -> None:
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, rng=False) as m:
                m.save(step=1)

        def restore() -> None:
            fresh = torch.optim.AdamW(model.parameters())
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root, verify="size"), model=model, optimizer=fresh,
                                   rng=False) as again:
                assert again.restore() is not None

        saved = _timed(save)
        prefix = f"r{round_}/epoch_0_step_1/"
        objects: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            objects.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        total, count = sum(objects.values()), len(objects)
        mine = sorted(objects, key=lambda k: (-objects[k], k))[rank::world]  # dealt out by size
        blobs = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in mine}

        def raw_put() -> None:
            for key, data in blobs.items():
                s3.put_object(Bucket=bucket, Key=f"raw{round_}/{key}", Body=data)

        def raw_get() -> None:
            for key in mine:
                s3.get_object(Bucket=bucket, Key=f"raw{round_}/{key}")["Body"].read()

        put = _timed(raw_put)
        del blobs
        # the restores alternate with the raw reads in their order from round to round
        first, second = (restore, raw_get) if round_ % 2 else (raw_get, restore)
        a, b = _timed(first), _timed(second)
        got, restored = (a, b) if first is raw_get else (b, a)
        if round_:
            for key, value in (("save", saved), ("raw put", put), ("restore", restored), ("raw get", got)):
                times[key].append(value)
        if rank == 0:
            print(f"  round {round_}{' (warm-up)' if not round_ else ''}: save {saved:.2f} s, raw put {put:.2f} s, "
                  f"restore {restored:.2f} s, raw get {got:.2f} s", flush=True)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\ncheckpoint: {total / 1e6:.0f} MB in {count} objects on {world} rank(s); medians of {args.repeats} rounds")
        print(f"  save     {med['save']:7.2f} s   x{med['save'] / med['raw put']:.2f} of raw put ({med['raw put']:.2f} s)")
        print(f"  restore  {med['restore']:7.2f} s   x{med['restore'] / med['raw get']:.2f} of raw get "
              f"({med['raw get']:.2f} s)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MB", help="approximate bytes of model + optimizer state (all ranks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import s3server

    proc, url = s3server.start()
    try:
        os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
        from ckptio.storage.s3 import client

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client().create_bucket(Bucket=bucket)
        if args.world == 1:
            import torch

            torch.set_num_threads(1)
            run(args, bucket)
        else:
            import torch.multiprocessing as mp
            from save_load import rank_main

            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(rank_main, args=(args.world, os.path.join(tmp, "store"), run, args, bucket),
                                   nprocs=args.world, start_method="spawn")
    finally:
        proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
