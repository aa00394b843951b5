"""A restore on several ranks reads of another rank's DCP file only what it needs (formats/dcp/writer.py's
``HEAD_ITEM``): AdamW's ``step`` beside FSDP2's sharded moments is a tensor every rank holds whole, written by one
rank for all. Spread through that rank's file in the plan's order, the ranges another rank read of it made an
object store's read window span most of the file (103 MB of a 171 MB file for 51 KB, 4 ranks, a 1 GB state); at
the head of the file they are one small read. On 2 real gloo ranks against a real GCS server (fake-gcs-server)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from test_s3 import _counted

pytestmark = pytest.mark.parametrize("store", ["gs"], indirect=True)


def _model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _restore_rank(url: str) -> dict:
    """Save a trained FSDP2 model and AdamW, restore them into fresh ones: the bytes this rank read of each object,
    and whether the restore is exact."""
    import torch.distributed as dist

    from ckptio import CheckpointConfig, CheckpointManager

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
    again = _model()
    fresh = torch.optim.AdamW(again.parameters(), lr=1e-2)
    read: dict[str, int] = {}
    with CheckpointManager(CheckpointConfig(checkpoint_dir=url), model=again, optimizer=fresh, rng=False) as mgr:
        kind = type(mgr.storage.store)
        real = kind.read_into

        def counted(self, key, offset, view):
            read[key] = read.get(key, 0) + view.nbytes
            return real(self, key, offset, view)

        kind.read_into = counted
        dist.barrier()
        mgr.restore()
        kind.read_into = real
    exact = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), again.parameters()))
    saved, restored = opt.state_dict()["state"], fresh.state_dict()["state"]
    exact = exact and all(torch.equal(torch.as_tensor(saved[p][k].to_local() if hasattr(saved[p][k], "to_local")
                                                      else saved[p][k]),
                                      torch.as_tensor(restored[p][k].to_local() if hasattr(restored[p][k], "to_local")
                                                      else restored[p][k]))
                          for p in saved for k in saved[p])
    return {"read": read, "exact": exact}


def test_a_rank_reads_of_another_ranks_dcp_file_only_its_small_items(store):
    results = run_ranks(2, _restore_rank, url=store.url("cross"))
    for rank, got in enumerate(results):
        assert got["exact"], f"rank {rank}: the restore is not exact"
        own = f"__{rank}_0.distcp"
        files = {key: n for key, n in got["read"].items() if key.endswith(".distcp")}
        assert any(key.endswith(own) for key in files), files
        other = {key: n for key, n in files.items() if not key.endswith(own)}
        # the other file's head: its small items as torch.save archives (~250 KB here, of an 8.7 MB file; 4.5 MB
        # was read of it with the items in the plan's order)
        assert sum(other.values()) <= 512 << 10, f"rank {rank} read of the other rank's file: {other}"
