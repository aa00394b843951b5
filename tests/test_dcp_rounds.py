"""A DCP save on several ranks coordinates with ckptio's rounds (issue 70): four collectives where
``torch.distributed.checkpoint.save`` made eight (its four object collectives each send the sizes, then the bytes)
and ckptio one more after it. What it writes is plain DCP, and a failure on any rank, while planning, writing (on
the calling thread or one of the writer threads) or in rank 0's finish, raises on every rank, naming the folder.

Run on real gloo ranks; the collectives are counted where they reach ``torch.distributed`` (every one still runs).
"""

from __future__ import annotations

import pytest
import torch
from distributed import counting_collectives, real_collectives, run_ranks

pytestmark = pytest.mark.slow

def _state(seed: int) -> dict:
    """A rank's part of a sharded state: a DTensor shard (FSDP2's kind), a replicated tensor, plain values."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    # shards over 64 KB: written apart from the small items, in regions of their own with thread_count=2
    full, other = torch.randn(4096, 16, generator=g), torch.randn(4096, 16, generator=g)
    return {"w": DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)]),
            "v": DTensor.from_local(other.chunk(world)[rank].clone(), mesh, [Shard(0)]),
            "bias": torch.randn(16, generator=g), "lr": 1e-3 * (seed + 1), "betas": (0.9, 0.999), "name": "adamw"}


def _empty_like(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements)
                if isinstance(v, DTensor) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
            for k, v in state.items()}


def _saves(root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from ckptio.formats.dcp.save import save

    counts = []
    for i in range(3):
        with counting_collectives() as c:
            save(_state(i), f"{root}/s{i}")
        counts.append(dict(c))
    wrong = []
    for i in range(3):  # each folder with torch's own load, into new tensors
        want, got = _state(i), _empty_like(_state(i))
        dcp.load(got, checkpoint_id=f"{root}/s{i}")
        for k, v in want.items():
            a = v.to_local() if isinstance(v, DTensor) else v
            b = got[k].to_local() if isinstance(got[k], DTensor) else got[k]
            if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b):
                wrong.append(f"s{i}/{k}")
    return {"counts": counts, "wrong": wrong}


def test_a_two_rank_dcp_save_is_four_collectives_and_plain_dcp_loads_it(tmp_path):
    """From the second save of a folder name on, a gather and a broadcast for the plans, a gather and a broadcast for
    the write results and rank 0's outcome: four collectives (nine before: torch's four object collectives and
    ckptio's flag round after them). The first save sends its plans and results in larger frames, as DCP does."""
    results = run_ranks(2, _saves, root=str(tmp_path))
    for rank, got in enumerate(results):
        assert got["wrong"] == [], f"rank {rank}: {got['wrong']}"
        first, *later = got["counts"]
        assert real_collectives(first) <= 9, f"rank {rank}: the first save made {first}"
        for counts in later:
            assert counts == {"gather": 2, "broadcast": 2}, f"rank {rank}: {counts}"
    assert results[0]["counts"] == results[1]["counts"]


class _FailingState:
    """A registered object whose ``state_dict`` fails: on one rank, while DCP plans."""

    def state_dict(self) -> dict:
        raise ValueError("no state here")

    def load_state_dict(self, state: dict) -> None:
        pass


def _failing(root: str, where: str) -> dict:
    import os
    import threading

    import torch.distributed as dist

    from ckptio import _faults
    from ckptio.errors import CheckpointError
    from ckptio.formats.dcp.save import save
    from ckptio.storage import LocalFolderWriter

    class RefusingMetadata(LocalFolderWriter):
        def open(self, rel: str):  # noqa: ANN202 - a full disk when the metadata is written
            if rel.endswith(".metadata.tmp"):
                raise OSError(f"no space left writing {rel}")
            return super().open(rel)

    rank = dist.get_rank()
    save(_state(0), f"{root}/warm")  # the frames and the plan cache of a warm folder name
    state = _state(1)
    writer: "str | LocalFolderWriter" = f"{root}/failed"
    if where == "planning" and rank == 1:
        state["extra"] = _FailingState()
    if where == "finish" and rank == 0:
        os.makedirs(f"{root}/failed", exist_ok=True)
        writer = RefusingMetadata(f"{root}/failed", f"{root}/failed")

    def hook(point: str) -> None:
        main = threading.current_thread() is threading.main_thread()
        if point == "dcp.item_written" and rank == 1 and main == (where == "writing"):
            raise OSError("disk full")

    if where in ("writing", "writer thread"):
        _faults.set_hook(hook)
    try:
        save(state, writer, thread_count=2)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        _faults.set_hook(None)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("ckptio-dcp")]
    save(_state(2), f"{root}/after")  # the ranks are still in step: the next save works
    return {"error": error, "threads": threads, "metadata": os.path.exists(f"{root}/failed/.metadata")}


@pytest.mark.parametrize("where, failing, message", [
    ("planning", 1, "ValueError: no state here"),
    ("writing", 1, "disk full"),
    ("writer thread", 1, "disk full"),
    ("finish", 0, "no space left writing .metadata.tmp"),
])
def test_a_failure_on_one_rank_raises_on_every_rank_naming_the_folder(tmp_path, where, failing, message):
    results = run_ranks(2, _failing, timeout=180, root=str(tmp_path), where=where)
    for rank, got in enumerate(results):
        assert got["error"] is not None, f"rank {rank} saved"
        assert f"saving DCP folder {tmp_path / 'failed'} failed on rank(s) [{failing}]" in got["error"], got["error"]
        assert message in got["error"], got["error"]
        assert got["threads"] == [], f"rank {rank}: writer threads left: {got['threads']}"
        assert not got["metadata"], "a folder whose save failed has DCP's metadata"


def _group_keys() -> list[str]:
    from ckptio import _dist

    keys = []
    for _ in range(4):  # each group freed before the next is made: the next may reuse its memory
        group = _dist.new_gloo_group()
        with _dist.using_group(group):
            keys.append(_dist.group_key())
        _dist.destroy_group(group)
    keys.append(_dist.group_key())  # the default group
    return keys


def test_the_caches_key_of_a_group_is_the_same_on_every_rank_and_never_reused():
    """A DCP plan and a round's frame size are cached per group, and every rank must find the same entry, or the
    ranks gather frames of different sizes. The key was the group's ``id()``, which differs between processes and
    may be given to a group made after another was freed."""
    first, second = run_ranks(2, _group_keys)
    assert first == second
    assert len(set(first)) == len(first)
