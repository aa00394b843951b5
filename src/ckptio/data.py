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
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def __len__(self) -> int:
        """Batches per epoch on each rank."""
        return len(self.dataset) // (self.batch_size * self.world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        order = self._order()
        step = self.batch_size * self.world_size
        # What is left of the epoch, cut to whole global batches. Counted from the position, not from the
        # epoch's start: after a resume on another number of ranks the position need not be a multiple of
        # the new global batch, and a remainder cut from the start would give some ranks one batch more
        # than others (a data-parallel job would hang in that batch's collectives).
        remainder = order[self.consumed:]
        remainder = remainder[:len(remainder) // step * step]
        mine = remainder[self.rank::self.world_size]
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


