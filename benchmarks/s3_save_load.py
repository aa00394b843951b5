"""ckptio save and restore to an ``s3://`` folder against the same client's raw upload and download of the
same bytes, on a local S3-compatible server (moto's, started here on 127.0.0.1).

    .venv/bin/python benchmarks/s3_save_load.py --size 256MiB --repeats 3

The loopback server is slow and does most of the work, so only the ratios mean anything: ckptio's save
(manifest, checksums, commit protocol) over a raw ``put_object`` of every file of the same checkpoint,
and ckptio's restore (``verify="size"``) over a raw ``get_object`` of every file. Medians over
``--repeats`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB", help="model parameters in bytes (fp32); the optimizer adds 2x")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import os

    import s3server
    import torch

    proc, url = s3server.start()
    try:
        os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
        from ckptio import CheckpointConfig, CheckpointManager
        from ckptio.storage.s3 import client

        s3 = client()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        width = 1024
        layers = max(1, _size(args.size) // (width * width * 4))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        times: dict[str, list[float]] = {"save": [], "raw put": [], "restore": [], "raw get": []}
        total = 0
        for round_ in range(args.repeats):
            root = f"s3://{bucket}/r{round_}"
            start = time.perf_counter()
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, rng=False) as mgr:
                mgr.save(step=1)
            times["save"].append(time.perf_counter() - start)
            prefix = f"r{round_}/epoch_0_step_1/"
            objects = {}
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                objects.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
            total = sum(objects.values())
            # the raw baseline: the same files' bytes, read back once, then put and got with the same client
            blobs = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in objects}
            start = time.perf_counter()
            for key, data in blobs.items():
                s3.put_object(Bucket=bucket, Key=f"raw{round_}/{key}", Body=data)
            times["raw put"].append(time.perf_counter() - start)
            del blobs
            start = time.perf_counter()
            for key in objects:
                s3.get_object(Bucket=bucket, Key=f"raw{round_}/{key}")["Body"].read()
            times["raw get"].append(time.perf_counter() - start)
            fresh = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
            fresh_opt = torch.optim.AdamW(fresh.parameters())
            start = time.perf_counter()
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root, verify="size"), model=fresh,
                                   optimizer=fresh_opt, rng=False) as again:
                again.restore()
            times["restore"].append(time.perf_counter() - start)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\ncheckpoint: {total / 1e6:.0f} MB in {len(objects)} objects; medians of {args.repeats} rounds")
        print(f"  save     {med['save']:7.2f} s   ×{med['save'] / med['raw put']:.2f} of raw put ({med['raw put']:.2f} s)")
        print(f"  restore  {med['restore']:7.2f} s   ×{med['restore'] / med['raw get']:.2f} of raw get ({med['raw get']:.2f} s)")
    finally:
        proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
