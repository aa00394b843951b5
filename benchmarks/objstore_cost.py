"""ckptio's save and restore to an object-store folder (``s3://``, ``gs://``, ``az://``) against the raw client's
upload and download of the same objects: wall time and the client's CPU seconds per GB, on 1 or more ranks.

    .venv/bin/python benchmarks/objstore_cost.py --backend all --world 1,2,4 --size 256MB --repeats 3
    .venv/bin/python benchmarks/objstore_cost.py --backend s3 --world 2          # gloo ranks, FSDP2 state

Each backend runs against its loopback server, started here in a process of its own (moto for S3,
fake-gcs-server for GCS, Azurite for Azure; see tests/*server.py), so the server's CPU is not counted. The state
is the Llama + AdamW of ``save_load.py`` (``--size`` bytes in all, FSDP2-sharded on several ranks), saved in the
default layout and restored with the default ``verify`` (``--verify`` to change it). The raw contenders move the
objects of the same checkpoint with the client as it is usually called, with its default transfer settings:
boto3's ``upload_fileobj``/``download_fileobj`` (managed transfer), google-cloud-storage's
``blob.upload_from_file``/``blob.download_to_file``, azure-storage-blob's ``upload_blob``/``download_blob``; the raw
upload starts from the bytes in memory, the raw download ends with them in memory. On several ranks the objects
are dealt out to the ranks by size, every rank moving its share at once.

Wall time is barrier to barrier (the slowest rank's); CPU is each rank process's user + system seconds
(``getrusage(RUSAGE_SELF)``, all its threads) over the call, summed over the ranks, per GB of the checkpoint.
One warm-up round, then ``--repeats`` rounds, the contenders interleaved in each round (the order of the
restore and the raw download alternating); medians. Each round's objects are deleted after it, untimed (the
loopback servers hold them in memory). The loopback servers are slow and share the machine's
cores, so the wall-clock ratios move more than the CPU ones.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BACKENDS = ("s3", "gs", "az")


# ----------------------------------------------------------------------------------- the loopback servers
_FOLDERS: list[str] = []
"""Folders the servers keep their objects in, removed once they stop."""


def start_server(backend: str):
    """(server process, environment pointing the clients at it)."""
    if backend == "s3":
        import s3server

        proc, url = s3server.start()
        return proc, {"AWS_ENDPOINT_URL": url, **s3server.ENV}
    if backend == "gs":
        import gcsserver

        proc, url = gcsserver.start()
        return proc, {"STORAGE_EMULATOR_HOST": url}
    import azuriteserver

    # on disk in a folder of its own: the in-memory store refused 1 GB rounds on 4 ranks (it frees deleted blobs late)
    folder = tempfile.mkdtemp(prefix="ckptio-bench-azurite-")
    _FOLDERS.append(folder)
    proc, url = azuriteserver.start(location=folder)
    return proc, {"AZURE_STORAGE_CONNECTION_STRING": azuriteserver.connection_string(url)}


# ----------------------------------------------------------------------------------- the raw clients
class Raw:
    """One bucket through the cloud's own client, called as its users usually call it (default settings)."""

    def __init__(self, backend: str, bucket: str) -> None:
        self.backend, self.bucket = backend, bucket
        if backend == "s3":
            import boto3

            self.client = boto3.session.Session().client("s3")
        elif backend == "gs":
            from google.cloud import storage

            self.client = storage.Client().bucket(bucket)
        else:
            from azure.storage.blob import BlobServiceClient

            self.client = BlobServiceClient.from_connection_string(
                os.environ["AZURE_STORAGE_CONNECTION_STRING"]).get_container_client(bucket)

    def create(self) -> None:
        if self.backend == "s3":
            self.client.create_bucket(Bucket=self.bucket)
        elif self.backend == "gs":
            from google.cloud import storage

            storage.Client().create_bucket(self.bucket)
        else:
            self.client.create_container()

    def put(self, key: str, data: bytes) -> None:
        if self.backend == "s3":
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, key)
        elif self.backend == "gs":
            self.client.blob(key).upload_from_file(io.BytesIO(data), size=len(data))
        else:
            self.client.upload_blob(key, data, overwrite=True)

    def get(self, key: str) -> bytes:
        if self.backend == "s3":
            sink = io.BytesIO()
            self.client.download_fileobj(self.bucket, key, sink)
            return sink.getvalue()
        if self.backend == "gs":
            sink = io.BytesIO()
            self.client.blob(key).download_to_file(sink)
            return sink.getvalue()
        return self.client.download_blob(key).readall()


# ----------------------------------------------------------------------------------- measuring
def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _measured(fn) -> tuple[float, float]:
    """(wall seconds, barrier to barrier; this rank's CPU seconds over ``fn``)."""
    _barrier()
    start, cpu = time.perf_counter(), _cpu()
    fn()
    cpu = _cpu() - cpu
    _barrier()
    return time.perf_counter() - start, cpu


def _sum(value: float) -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


NAMES = ("save", "raw put", "restore", "raw get")
TINY = ("tiny save", "tiny restore")
"""The same save and restore of a state of a few KB: what a save's protocol (manifest, commit, pointers, listings,
the lease) and a restore's fixed requests cost, whatever the size."""


def run(args: argparse.Namespace, backend: str, bucket: str) -> None:
    """Each ``--size`` in turn, on this rank."""
    for i, size in enumerate(args.size.split(",")):
        run_size(args, backend, bucket, size, f"s{i}")


def run_size(args: argparse.Namespace, backend: str, bucket: str, size: str, label: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager
    from ckptio.storage import open_storage
    from save_load import _size, build_state

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    raw = Raw(backend, bucket)
    model, opt = build_state(_size(size), shard=world > 1)
    tiny = torch.nn.Linear(32, 32)
    walls: dict[str, list[float]] = {k: [] for k in NAMES + TINY}
    cpus: dict[str, list[float]] = {k: [] for k in NAMES + TINY}
    total, count = 0, 0
    tag = f"w{world}{label}"
    for round_ in range(args.repeats + 1):  # round 0 warms up and is not counted
        root = f"{backend}://{bucket}/{tag}r{round_}"
        extra = {"verify": args.verify} if args.verify else {}

        def save(root: str = root, state: "torch.nn.Module" = model, optim: object = opt) -> None:
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=state, optimizer=optim, rng=False) as m:
                m.save(step=1)

        def restore(root: str = root, state: "torch.nn.Module" = model, optim: bool = True) -> None:
            fresh = torch.optim.AdamW(state.parameters()) if optim else None
            with CheckpointManager(CheckpointConfig(checkpoint_dir=root, **extra), model=state, optimizer=fresh,
                                   rng=False) as again:
                assert again.restore() is not None

        got: dict[str, tuple[float, float]] = {"save": _measured(save)}
        got["tiny save"] = _measured(lambda: save(root + "tiny", tiny, None))
        got["tiny restore"] = _measured(lambda: restore(root + "tiny", tiny, False))
        prefix = f"{tag}r{round_}/epoch_0_step_1/"
        objects = {o.key: o.size for o in open_storage(f"{backend}://{bucket}").store.listing(prefix, delimiter=False)[0]}
        total, count = sum(objects.values()), len(objects)
        mine = sorted(objects, key=lambda k: (-objects[k], k))[rank::world]  # dealt out by size
        blobs = {k: raw.get(k) for k in mine}

        def raw_put() -> None:
            for key, data in blobs.items():
                raw.put(f"raw{tag}{round_}/{key}", data)

        def raw_get() -> None:
            for key in mine:
                raw.get(f"raw{tag}{round_}/{key}")

        got["raw put"] = _measured(raw_put)
        del blobs
        # the restores alternate with the raw downloads in their order from round to round
        for name, fn in ((("restore", restore), ("raw get", raw_get)) if round_ % 2 else
                         (("raw get", raw_get), ("restore", restore))):
            got[name] = _measured(fn)
        _barrier()
        if rank == 0:  # the round's objects go (untimed): the loopback servers hold every object in memory
            store = open_storage(f"{backend}://{bucket}").store
            for prefix in (f"{tag}r{round_}", f"raw{tag}{round_}/"):
                keys = [o.key for o in store.listing(prefix, delimiter=False)[0]]
                if keys:
                    store.delete_many(keys, prefix)
        gb = total / 1e9
        line = []
        for name in NAMES:
            wall, cpu = got[name][0], _sum(got[name][1]) / gb
            line.append(f"{name} {wall:.2f} s {cpu:.2f} cpu-s/GB")
            if round_:
                walls[name].append(wall)
                cpus[name].append(cpu)
        for name in TINY:
            if round_:
                walls[name].append(got[name][0])
                cpus[name].append(_sum(got[name][1]))
        if rank == 0:
            print(f"  {backend} world {world} round {round_}{' (warm-up)' if not round_ else ''}: " + ", ".join(line),
                  flush=True)
    if rank == 0:
        w = {k: statistics.median(v) for k, v in walls.items()}
        c = {k: statistics.median(v) for k, v in cpus.items()}
        print(f"\n{backend}://, {world} rank(s): {total / 1e6:.0f} MB in {count} objects, medians of {args.repeats} "
              f"rounds\n"
              f"  RESULT {backend} world={world} save    CPU/GB x{c['save'] / c['raw put']:.2f} "
              f"({c['save']:.2f} vs {c['raw put']:.2f} cpu-s/GB)  wall x{w['save'] / w['raw put']:.2f} "
              f"({w['save']:.2f} vs {w['raw put']:.2f} s)\n"
              f"  RESULT {backend} world={world} restore CPU/GB x{c['restore'] / c['raw get']:.2f} "
              f"({c['restore']:.2f} vs {c['raw get']:.2f} cpu-s/GB)  wall x{w['restore'] / w['raw get']:.2f} "
              f"({w['restore']:.2f} vs {w['raw get']:.2f} s)\n"
              f"  fixed: a save of a {sum(p.numel() * 4 for p in tiny.parameters()) >> 10} KB state "
              f"{c['tiny save']:.3f} cpu-s ({c['tiny save'] / gb:.2f} cpu-s/GB of this checkpoint), its restore "
              f"{c['tiny restore']:.3f} cpu-s ({c['tiny restore'] / gb:.2f} cpu-s/GB)\n", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="all", help="s3, gs, az, a comma-separated list of them, or all")
    p.add_argument("--world", default="1", help="ranks (gloo on CPU, FSDP2 state): a number or a list, e.g. 1,2,4")
    p.add_argument("--size", default="256MB", help="approximate bytes of model + optimizer state (all ranks); a "
                   "comma-separated list measures each in turn (e.g. 256MB,1GB: a save's fixed cost over more bytes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify", default=None, help="the restore's verify setting (default: ckptio's default)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backends = BACKENDS if args.backend == "all" else tuple(args.backend.split(","))
    for backend in backends:
        proc, env = start_server(backend)
        try:
            os.environ.update(env)
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            Raw(backend, bucket).create()
            for world in (int(w) for w in args.world.split(",")):
                if world == 1:
                    import torch

                    torch.set_num_threads(1)
                    run(args, backend, bucket)
                    continue
                import torch.multiprocessing as mp
                from save_load import rank_main

                with tempfile.TemporaryDirectory() as tmp:
                    mp.start_processes(rank_main, args=(world, os.path.join(tmp, "store"), run, args, backend, bucket),
                                       nprocs=world, start_method="spawn")
        finally:
            for name in env:
                os.environ.pop(name, None)
            proc.terminate()
            proc.wait(timeout=30)
            while _FOLDERS:
                shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
