"""The data position when the number of data-parallel ranks changes between save and resume.

Ranks are simulated in one process (``ResumableDataLoader(rank=, world_size=)``: the loader is local
arithmetic on a seeded global order, no collective), stepping in lock-step as a data-parallel job does.
After a resume on another number of ranks, every rank must take the same number of batches, and over
the epoch no sample may be seen twice nor skipped (the dropped tail aside, which is shorter than one
global batch).
"""

from __future__ import annotations

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader
from ckptio.errors import ConfigError


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loaders(n: int, batch: int, world: int) -> list[ResumableDataLoader]:
    return [ResumableDataLoader(Indices(n), batch, seed=7, rank=r, world_size=world) for r in range(world)]


def _take(loaders: list[ResumableDataLoader], iters: list, steps: int | None) -> list[list[int]]:
    """``steps`` lock-step batches on every rank (``None``: to the end of the epoch); samples seen per rank."""
    seen: list[list[int]] = [[] for _ in loaders]
    done = 0
    while steps is None or done < steps:
        batches = [next(it, None) for it in iters]
        ended = [b is None for b in batches]
        if any(ended):
            assert all(ended), f"ranks ran out at different batches: {ended} after {done} lock-step batches"
            break
        for r, b in enumerate(batches):
            seen[r].extend(int(x) for x in b)
        done += 1
    return seen


@pytest.mark.parametrize("n,batch,before,after,steps", [
    (96, 4, 2, 3, 3),
    (96, 4, 4, 2, 2),
    (100, 2, 4, 3, 1),  # 88 samples left: 30/29/29 by rank, before the fix 15/14/14 batches
    (101, 3, 2, 3, 5),
    (64, 1, 3, 4, 7),
])
def test_resume_on_another_number_of_ranks_repeats_and_skips_nothing(n, batch, before, after, steps):
    old = _loaders(n, batch, before)
    first = _take(old, [iter(dl) for dl in old], steps)
    states = [dl.state_dict() for dl in old]
    assert all(s == states[0] for s in states), "the loader state must be the same on every rank"

    new = _loaders(n, batch, after)
    for dl in new:
        dl.load_state_dict(states[0])
    rest = _take(new, [iter(dl) for dl in new], None)
    counts = {len(part) for part in rest}
    assert len(counts) == 1, f"ranks took different numbers of samples after the resume: {[len(p) for p in rest]}"

    seen = [x for part in first + rest for x in part]
    assert len(seen) == len(set(seen)), "a sample was seen twice in the epoch"
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    assert sorted(seen) == sorted(order[:len(seen)]), "the samples seen must be a prefix of the epoch's order"
    assert n - len(seen) < batch * after, f"{n - len(seen)} samples skipped: more than the dropped tail"
    # the next epoch starts from the top on every rank
    again = _take(new, [iter(dl) for dl in new], 1)
    assert sorted(x for part in again for x in part) == sorted(
        torch.randperm(n, generator=torch.Generator().manual_seed(8)).tolist()[:batch * after])


def test_iterable_datasets_and_plain_loaders_get_a_clear_message(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match="map-style.*extra_states.*StatefulDataLoader"):
        ResumableDataLoader(Stream(), 2)
    with pytest.raises(ConfigError, match="plain DataLoader.*ResumableDataLoader"):
        CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)),
                          dataloader=torch.utils.data.DataLoader(Indices(8)))


def _rng_save(root: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root)) as mgr:
        mgr.save(step=1)
    return {"next": torch.rand(3)}  # what each rank's stream gives right after the save


def _rng_load(root: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(100 + rank)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root)) as mgr:
        mgr.restore()
    return {"next": torch.rand(3)}


@pytest.mark.slow
def test_rng_streams_when_the_number_of_ranks_changes(tmp_path):
    """Each rank gets back the stream saved by the same rank number; a rank beyond those saved keeps its own."""
    from distributed import run_ranks

    saved = run_ranks(2, _rng_save, root=str(tmp_path))
    on_three = run_ranks(3, _rng_load, root=str(tmp_path))
    assert torch.equal(on_three[0]["next"], saved[0]["next"]) and torch.equal(on_three[1]["next"], saved[1]["next"])
    torch.manual_seed(102)
    assert torch.equal(on_three[2]["next"], torch.rand(3)), "rank 2 has no saved stream: it keeps its own"
    on_one = run_ranks(1, _rng_load, root=str(tmp_path))
    assert torch.equal(on_one[0]["next"], saved[0]["next"])


@pytest.mark.parametrize("n,batch,before,after,steps", [(96, 4, 2, 3, 3), (100, 2, 4, 3, 1), (64, 3, 3, 2, 4)])
def test_torchdatas_stateful_dataloader_with_a_resumable_sampler_resizes_too(n, batch, before, after, steps):
    """torchdata's StatefulDataLoader checkpoints its sampler; with ckptio's ResumableSampler its state is the
    same on every rank (saved once) and resumes on another number of ranks with nothing repeated or skipped."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptio import ResumableSampler

    def loaders(world: int) -> list:
        return [StatefulDataLoader(Indices(n), batch_size=batch, generator=torch.Generator().manual_seed(0),
                                   sampler=ResumableSampler(Indices(n), batch, seed=7, rank=r, world_size=world))
                for r in range(world)]

    old = loaders(before)
    iters = [iter(dl) for dl in old]
    first = _take(old, iters, steps)  # type: ignore[arg-type]
    states = [dl.state_dict() for dl in old]
    assert all(s == states[0] for s in states), "the loader state must be the same on every rank"
    new = loaders(after)
    for dl in new:
        dl.load_state_dict(states[0])
    rest = _take(new, [iter(dl) for dl in new], None)  # type: ignore[arg-type]
    assert len({len(part) for part in rest}) == 1, [len(p) for p in rest]
    seen = [x for part in first + rest for x in part]
    assert len(seen) == len(set(seen)), "a sample was seen twice in the epoch"
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7)).tolist()
    assert sorted(seen) == sorted(order[:len(seen)]) and n - len(seen) < batch * after


def test_a_stateful_dataloader_is_a_state_the_manager_saves_and_restores(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptio import ResumableSampler

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(Indices(40), batch_size=4, generator=torch.Generator().manual_seed(0),
                                  sampler=ResumableSampler(Indices(40), 4, seed=3, rank=0, world_size=1))

    dl = loader()
    it = iter(dl)
    seen = [int(x) for _ in range(3) for x in next(it)]
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), dataloader=dl, rng=False) as mgr:
        mgr.save(step=3)
    rest_uninterrupted = [int(x) for b in it for x in b]
    again = loader()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), dataloader=again, rng=False) as mgr:
        assert mgr.restore() is not None
    assert [int(x) for b in again for x in b] == rest_uninterrupted and len(seen) == 12
