"""How planning a restore grows with the number of ranks that wrote the checkpoint (metadata only, no data).

    .venv/bin/python benchmarks/plan_scaling.py [--ranks 128,256,512,1024] [--tensors 200] [--repeats 3]

For each rank count N, a checkpoint in the default layout is simulated: the model as N sharded-safetensors
files, each holding its row block of ``--tensors`` tensors (a few bytes of data each: only the metadata
matters), with the chunk index rank 0 writes beside them; and the optimizer as a DCP folder whose
``.metadata`` lists two moments per tensor in N chunks (the data files are sparse). Both are built with the
functions a real save uses. Then one rank of a job on N/2 ranks plans its load the way ``restore`` does, and
each phase is timed (median of ``--repeats``):

* model ``headers``: planned from every shard's header (a folder without the chunk index: AutoModel's shards,
  an older ckptio's), exact cover checked, then the chunks that overlap this rank's rows selected;
* model ``index``: the same plan from the folder's one chunk index;
* optimizer ``.metadata``: DCP's pickled metadata read (allow-list unpickler), validated and planned;
* optimizer ``index``: the same from the DCP folder's chunk index;
* ``before`` / ``now``: what a restore of the default layout spends planning without / with the indexes
  (goal: at most 1 s at 1,024 ranks). ``x prev``: ``now`` against the previous N (2 for each doubling is linear).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROWS_PER_RANK = 2
COLS = 4


def write_model(folder: Path, ranks: int, tensors: int) -> None:
    import torch

    from ckptio.formats.safetensors import _writer as _st_writer, chunk_index
    from ckptio.formats.safetensors.sharded import _metadata, shard_file_name
    from ckptio.storage import LocalFolderWriter

    writer = LocalFolderWriter.in_place(folder)
    local = torch.zeros(ROWS_PER_RANK, COLS)
    plans = []
    for rank in range(ranks):
        items = [chunk_index.Item(f"layers.{i}.weight", local.dtype, tuple(local.shape), (ROWS_PER_RANK * rank, 0),
                                  (ROWS_PER_RANK * ranks, COLS)) for i in range(tensors)]
        (plan,) = chunk_index.files_of(items, 1, lambda part, parts, r=rank: shard_file_name(r, ranks, part, parts))
        plans.append(plan)
        meta = _metadata({i.key: {"shape": list(i.global_shape), "offsets": list(i.offsets)} for i in items}, rank, ranks)
        entries = [_st_writer.Entry(i.key, i.dtype, i.shape, lambda: local) for i in items]
        _st_writer.write(writer.open(plan.name), entries, meta)
    writer.write_bytes(chunk_index.INDEX_NAME, chunk_index.encode(plans, ranks))


def write_optimizer(folder: Path, ranks: int, tensors: int, with_index: bool) -> None:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    folder.mkdir(parents=True)
    nbytes = ROWS_PER_RANK * COLS * 4 + 1024  # a stored tensor with its zip framing, roughly
    entries, storage = {}, {}
    keys = [f"state.layers.{i}.weight.{m}" for i in range(tensors) for m in ("exp_avg", "exp_avg_sq")]
    for k, key in enumerate(keys):
        chunks = [ChunkStorageMetadata(torch.Size([ROWS_PER_RANK * r, 0]), torch.Size([ROWS_PER_RANK, COLS]))
                  for r in range(ranks)]
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                             torch.Size([ROWS_PER_RANK * ranks, COLS]), chunks)
        for r, c in enumerate(chunks):
            storage[MetadataIndex(key, c.offsets)] = _StorageInfo(f"__{r}_0.distcp", k * nbytes, nbytes)
    metadata = Metadata(state_dict_metadata=entries, storage_data=storage)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    if with_index:
        from ckptio.formats.safetensors.chunk_index import INDEX_NAME, encode_dcp

        data = encode_dcp(metadata, ranks)
        assert data is not None  # every chunk has its record
        (folder / INDEX_NAME).write_bytes(data)
    for r in range(ranks):
        with open(folder / f"__{r}_0.distcp", "wb") as f:
            os.truncate(f.fileno(), len(keys) * nbytes)


def _my_rows(rows: int, loaders: int, me: int) -> tuple[int, int]:
    return rows * me // loaders, rows * (me + 1) // loaders


def plan_model(folder: Path, ranks: int, from_index: bool) -> int:
    """One rank of an N/2-rank job: the chunks it reads of every tensor (the restore's ``_scan`` + ``_fill`` plan)."""
    from ckptio.formats.safetensors import chunk_index
    from ckptio.formats.safetensors.sharded import _scan
    from ckptio.engine.plan import overlap

    files = None if from_index else sorted(p.name for p in folder.glob("*.safetensors"))
    chunks, infos = _scan(folder, files)
    loaders = max(1, ranks // 2)
    me = loaders // 2
    pieces = 0
    for key, parts in chunks.items():
        lo, hi = _my_rows(infos[key].shape[0], loaders, me)
        candidates = parts.overlapping((lo, 0), (hi - lo, COLS)) if isinstance(parts, chunk_index.ChunkTable) else parts
        pieces += sum(overlap((lo, 0), (hi - lo, COLS), c.offsets, c.shape) is not None for c in candidates)
    return pieces


def plan_optimizer(folder: Path, ranks: int) -> int:
    """One rank of an N/2-rank job: the chunks it reads of every optimizer tensor (``dcp_direct.plan``'s selection),
    from the folder's chunk index when it has one, else from its ``.metadata``."""
    from ckptio.formats.dcp.direct import layout
    from ckptio.storage.confined import Folder

    where = layout(Folder(folder))  # a new Folder object: nothing cached from the previous round
    loaders = max(1, ranks // 2)
    me = loaders // 2
    count = 0
    for key, info in where.tensors.items():
        lo, hi = _my_rows(info.shape[0], loaders, me)
        count += len(where.pieces(key, (lo, 0), (hi - lo, COLS)))
    return count


def _timed(fn, *args) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="128,256,512,1024")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    print(f"{args.tensors} model tensors and {2 * args.tensors} optimizer moments, each split over N ranks; "
          f"one rank of an N/2-rank job plans its load (median of {args.repeats}, seconds)")
    print(f"{'':>15} {'model (safetensors)':>17} {'optimizer (DCP)':>18} {'planning a restore':>17}")
    print(f"{'N':>6} {'chunks':>8} {'headers':>8} {'index':>8} {'.metadata':>9} {'index':>8} {'before':>8} {'now':>8} "
          f"{'x prev':>7}")
    previous = None
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="ckptio-plan-") as tmp:
            model, optim, pickled = Path(tmp) / "model", Path(tmp) / "optim", Path(tmp) / "optim-metadata-only"
            write_model(model, n, args.tensors)
            write_optimizer(optim, n, args.tensors, with_index=True)
            write_optimizer(pickled, n, args.tensors, with_index=False)
            rows = []
            for _ in range(args.repeats):  # interleaved, so that drift hits every phase alike
                h, ph = _timed(plan_model, model, n, False)
                i, pi = _timed(plan_model, model, n, True)
                m, pm = _timed(plan_optimizer, pickled, n)
                d, pd = _timed(plan_optimizer, optim, n)
                assert ph == pi > 0 and pm == pd > 0, (ph, pi, pm, pd)
                rows.append((h, i, m, d))
        h, i, m, d = (statistics.median(r[j] for r in rows) for j in range(4))
        total = i + d
        chunks = n * args.tensors * 3
        ratio = f"{total / previous:.2f}" if previous else "-"
        print(f"{n:>6} {chunks:>8} {h:>8.3f} {i:>8.3f} {m:>9.3f} {d:>8.3f} {h + m:>8.3f} {total:>8.3f} {ratio:>7}",
              flush=True)
        previous = total
    return 0


if __name__ == "__main__":
    sys.exit(main())
