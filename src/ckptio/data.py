"""A resumable data loader: deterministic shuffling per epoch and an exact position in it.

Plain ``torch.utils.data.DataLoader`` cannot say where it is. :class:`ResumableDataLoader` wraps one
and records ``(epoch, samples consumed across all ranks)``: the order of an epoch is a permutation
derived from ``seed + epoch``, and each rank takes every ``world_size``-th sample of it. That state is
the same on every rank, so it is saved once and also resumes on a different number of ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import _dist


class _RemainderSampler(Sampler[int]):
    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def _rest_of_epoch(order: list[int], consumed: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """This rank's samples of what is left of the epoch, cut to whole global batches from the position (not
    from the epoch's start: after a resume on another number of ranks the position need not be a multiple
    of the new global batch, and a cut from the start would give some ranks one batch more than others —
    a data-parallel job hangs in that batch's collectives)."""
    step = batch_size * world_size
    remainder = order[consumed:]
    return remainder[: len(remainder) // step * step][rank::world_size]


class ResumableSampler(Sampler[int]):
    """This rank's indices of a seeded global order, with a position that survives a change of world size.

    The sampler for loaders that checkpoint their sampler, such as torchdata's ``StatefulDataLoader``::

        sampler = ResumableSampler(dataset, batch_size=8, seed=0)
        loader = StatefulDataLoader(dataset, batch_size=8, sampler=sampler)
        CheckpointManager(config, model=model, dataloader=loader)

    Its state (epoch, samples consumed across all ranks, seed) is the same on every rank, so the loader's
    state is too (give the loader no per-rank randomness), and it is saved once; resumed on another
    number of ranks it continues the same order with no sample repeated or skipped, every rank taking the
    same number of batches. ``batch_size`` must be the loader's. Each ``iter()`` is one epoch; the next
    one starts the next epoch.
    """

    def __init__(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.n = len(dataset)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size
        self.epoch = 0
        self.consumed = 0

    def __iter__(self) -> Iterator[int]:
        mine = _rest_of_epoch(_epoch_order(self.n, self.shuffle, self.seed, self.epoch), self.consumed,
                              self.batch_size, self.rank, self.world_size)
        for i, index in enumerate(mine):
            if (i + 1) % self.batch_size == 0:  # counted before the batch's last sample leaves: a state taken
                self.consumed += self.batch_size * self.world_size  # right after the batch includes it
            yield index
        self.epoch += 1
        self.consumed = 0

    def __len__(self) -> int:
        return len(_rest_of_epoch(range(self.n), self.consumed, self.batch_size, self.rank, self.world_size))  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.consumed, self.seed = int(sd["epoch"]), int(sd["consumed"]), int(sd.get("seed", self.seed))


class ResumableDataLoader:
    """Iterates ``dataset`` in batches, one epoch per ``for`` loop, and can resume mid-epoch.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch on each rank.
        shuffle: shuffle each epoch (deterministically from ``seed`` and the epoch number).
        seed: base seed of the shuffling.
        rank, world_size: this process's data-parallel position (default: from ``torch.distributed``).
        collate_fn, num_workers, pin_memory: passed to the underlying ``DataLoader``.

    The tail of an epoch that does not fill a batch on every rank is dropped, so all ranks take the
    same number of steps. Resuming on another number of ranks continues the same global order from the
    same position: across all ranks no sample of the epoch is repeated and none is skipped (but for the
    dropped tail, now cut by the new global batch size). Map-style datasets only: an ``IterableDataset``
    has no order to split; give it ``state_dict``/``load_state_dict`` and register it as a state.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"ResumableDataLoader needs a map-style dataset (with __len__ and __getitem__); "
                f"{type(dataset).__name__} is iterable. Give it state_dict()/load_state_dict() and pass it to "
                "CheckpointManager(extra_states=...), or use torchdata's StatefulDataLoader")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.epoch = 0
        self.consumed = 0  # samples of the current epoch consumed across all ranks

    def _order(self) -> list[int]:
        return _epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Batches per epoch on each rank."""
        return len(self.dataset) // (self.batch_size * self.world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        step = self.batch_size * self.world_size
        mine = _rest_of_epoch(self._order(), self.consumed, self.batch_size, self.rank, self.world_size)
        # A DataLoader draws its workers' base seed from the generator it is given, or else from the
        # global torch RNG. A private generator keeps the global stream untouched, so creating the
        # iterator afresh after a resume does not shift the RNG that dropout and the like depend on.
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + self.consumed)
        loader = DataLoader(
            self.dataset,
            generator=g,
            batch_size=self.batch_size,
            sampler=_RemainderSampler(mine),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            drop_last=True,
        )
        for batch in loader:
            self.consumed += step
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch = int(sd["epoch"])
        self.consumed = int(sd["consumed"])
        self.seed = int(sd.get("seed", self.seed))


