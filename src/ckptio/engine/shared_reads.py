"""Each stored byte read once: a part of a tensor that several ranks need is read by one of them and sent to the rest.

Under DDP every rank holds the whole model and optimizer; under TP, norms and biases are replicated over the TP
ranks; under HSDP every replica group holds the same shards. Read naively, N ranks read the replicated bytes N
times from storage (a cold disk, a bucket, a shared filesystem all pay it). Instead:

1. **Describe** (:func:`describe`, no collective): every rank lists the parts it will fill — key, offsets inside
   the whole tensor, local shape, dtype, bytes, device — and the list travels in the restore's existing
   "opening the checkpoint" round.
2. **Assign** (:func:`assign`, a pure function of the gathered lists, so every rank computes the same plan): a
   part needed by one rank is read by it; a part needed by a set S of ranks goes to one of them. The parts of one
   set are cut, in key order (the order they lie in the files), into one contiguous run per rank of S, of about
   equal bytes, so each rank's reads stay sequential and the load is shared evenly.
3. **Read**: the formats skip the parts this rank was not given (``ShardContext.extra["skip"]``: the identities of
   the state dict's values), inside the load round where errors are gathered as before.
4. **Send** (:meth:`SharedReads.transfer`, collective): once every rank's reads succeeded, each reader sends what
   it filled to the other ranks of its set, point to point over the job's process group: every send and receive
   posted at once, each with its own tag, then waited for (no order can deadlock). Large contiguous parts go
   straight from and into the tensors' memory; small ones are packed, 64 MiB at most per message.

The result is bitwise what a rank's own read gives: the bytes sent are the filled destination, not re-encoded.
The checksum guarantee is unchanged: every byte that reached any rank came from a read that was hashed, and each
file's finisher joins every rank's hashed runs (:mod:`ckptio.storage.verify`), so a damaged byte read by rank 1
alone fails the restore on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import _dist

__all__ = ["Need", "describe", "describe_load", "plans", "assign", "SharedReads", "PIECE", "PACK"]

PIECE = 64 << 20
"""Largest message: a large part is sent in pieces of this size."""
PACK = 1 << 20
"""Parts smaller than this are packed together into messages of at most :data:`PIECE` bytes."""

Need = tuple[str, tuple[int, ...], tuple[int, ...], str, int, str]
"""A part one rank fills: (key, offsets in the whole tensor, local shape, dtype, bytes, device type)."""


def describe(flat: dict[str, Any]) -> list[Need]:
    """The parts of the tensors of ``flat`` (a flattened state dict) this rank will fill, in its order (no collective).

    A DTensor with a ``Partial`` placement (reduced before it can be read into) and a DTensor whose mesh this rank
    is not on are left out: they are read as before."""
    from torch.distributed.tensor import DTensor, Partial

    from .plan import local_view

    out: list[Need] = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor) and (value.device_mesh.get_coordinate() is None
                                           or any(isinstance(p, Partial) for p in value.placements)):
            continue
        view = local_view(value)
        local = view.local
        if local.numel() == 0:
            continue
        out.append((key, view.offsets, tuple(local.shape), str(local.dtype), local.numel() * local.element_size(),
                    local.device.type))
    return out


def describe_load(model: dict[str, Any] | None, model_format: str | None, optim_template: dict[str, Any] | None,
                  optim_format: Any) -> tuple[list[Need] | None, list[Need] | None, str]:
    """What a restore shares in its opening round (no collective): the model's parts this rank fills (``None``: the
    model is not loaded whole, or its format cannot skip reads), the optimizer's on its fast path (flattened as the
    restore flattens it), and this rank's host."""
    import socket

    from ..formats import registry
    from ..formats.common import flatten

    def shares(fmt: Any) -> bool:
        try:
            return bool((registry.get(fmt) if isinstance(fmt, str) else fmt).shares_reads)
        except Exception:  # noqa: BLE001 - an unknown format fails in the load itself, with its own message
            return False

    return (describe(model) if model is not None and model_format and shares(model_format) else None,
            describe(flatten({"optim": optim_template})) if optim_template is not None and shares(optim_format)
            else None, socket.gethostname())


def plans(shares: list[Any], rank: int, setting: bool | None, *, remote: bool) -> tuple["SharedReads", "SharedReads"]:
    """The model's and the optimizer's plans from every rank's :func:`describe_load` (``None``: that rank does not
    share). ``setting`` is ``CheckpointConfig.share_reads``: ``None`` shares when the ranks span several hosts or
    the checkpoint is remote (one host's page cache serves its ranks from one read of a local or network disk)."""
    on = setting if setting is not None else remote or len({s[2] for s in shares if s}) > 1
    if not on or not all(shares):
        return SharedReads(rank), SharedReads(rank)
    return assign([s[0] for s in shares], rank), assign([s[1] for s in shares], rank)


@dataclass(frozen=True)
class _Message:
    """One point-to-point message: the parts ``keys`` (in order), from ``src`` to each rank of ``dsts``; ``packed``:
    several small parts in one buffer, else one large part sent from its own memory in pieces."""

    src: int
    dsts: tuple[int, ...]
    keys: tuple[str, ...]
    nbytes: int
    device: str
    packed: bool


@dataclass
class SharedReads:
    """Every rank's identical plan (:func:`assign`): what this rank skips, and the messages of every rank."""

    rank: int
    skip_keys: frozenset[str] = frozenset()
    messages: list[_Message] = field(default_factory=list)
    shared_bytes: int = 0
    """Bytes of parts needed by more than one rank (each read once in all)."""

    def skip(self, flat: dict[str, Any]) -> frozenset[int]:
        """The identities of the values of ``flat`` this rank does not read (what formats take as ``skip``)."""
        return frozenset(id(flat[k]) for k in self.skip_keys if k in flat)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def transfer(self, flat: dict[str, Any], progress: Callable[[int], None] | None = None) -> int:
        """Collective (every rank, after every rank's reads succeeded): send what this rank read to the ranks that
        share it and receive what it skipped. Returns the bytes this rank received."""
        # every rank asks for the same groups in the same order (a side group is made collectively)
        groups = {device: _group_for(device) for device in sorted({m.device for m in self.messages})}
        received = 0
        works: list[Any] = []
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        keep: list[torch.Tensor] = []  # buffers alive until their work is done
        for i, m in enumerate(self.messages):
            if self.rank == m.src or self.rank in m.dsts:
                buf = self._post(i, m, flat, groups[m.device], works, unpack)
                keep.append(buf)
                received += m.nbytes if self.rank != m.src else 0
        for work in works:
            work.wait()
        with torch.no_grad():
            for buf, targets in unpack:
                at = 0
                for t in targets:  # byte copies: a packed part need not sit at an offset aligned for its dtype
                    n = t.numel() * t.element_size()
                    into = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                    _bytes_of(into).copy_(buf[at:at + n])
                    if into is not t:
                        t.copy_(into)
                    at += n
        if progress is not None and received:
            progress(received)
        if any(t.device.type != "cpu" for t in keep) and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize()
        return received

    def _post(self, i: int, m: _Message, flat: dict[str, Any], group: Any, works: list[Any],
              unpack: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> torch.Tensor:
        """Post message ``i``'s sends (this rank reads it) or receives; returns the buffer, which must outlive them.
        A receive that cannot land in its tensor's memory directly is listed in ``unpack``."""
        import torch.distributed as dist

        from .plan import local_view

        locals_ = [local_view(flat[k]).local.detach() for k in m.keys]  # the same memory, outside autograd
        mine = self.rank == m.src
        if mine:
            buf = torch.cat([_bytes_of(t.contiguous()) for t in locals_]) if m.packed else _bytes_of(locals_[0].contiguous())
        elif not m.packed and locals_[0].is_contiguous():
            buf = _bytes_of(locals_[0])  # straight into the tensor's memory
        else:
            buf = torch.empty(m.nbytes, dtype=torch.uint8, device=locals_[0].device)
            unpack.append((buf, locals_))
        for j, at in enumerate(range(0, m.nbytes, PIECE)):
            piece, tag = buf[at:at + PIECE], (i << 10) | j
            if mine:
                works += [dist.isend(piece, d, group=group, tag=tag) for d in m.dsts]
            else:
                works.append(dist.irecv(piece, m.src, group=group, tag=tag))
        return buf


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` tensor sharing its memory (sent raw: no dtype a backend lacks)."""
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def assign(everyone: list[list[Need] | None], rank: int) -> SharedReads:
    """Who reads which shared part, and the messages that hand it to the others (every rank computes the same).

    ``everyone[r]``: rank ``r``'s :func:`describe` (``None``: it shares nothing, and reads all its parts itself).
    A part is shared by the ranks that list it identically (key, offsets, shape, dtype, device type); the parts of
    one set of ranks are cut in key order into one run per rank of about equal bytes, the ranks that have read
    least so far taking the first runs."""
    holders: dict[Need, list[int]] = {}
    for r, needs in enumerate(everyone):
        for need in needs or ():
            holders.setdefault(need, []).append(r)
    groups: dict[tuple[int, ...], list[Need]] = {}
    for need, ranks in holders.items():
        if len(ranks) > 1:
            groups.setdefault(tuple(ranks), []).append(need)
    load = [0] * len(everyone)
    plan = SharedReads(rank)
    skip: set[str] = set()
    for ranks, needs in sorted(groups.items(), key=lambda g: (-sum(n[4] for n in g[1]), g[0])):
        total = sum(n[4] for n in needs)
        plan.shared_bytes += total
        order = sorted(ranks, key=lambda r: (load[r], r))
        share = total / len(order)
        done = 0
        runs: list[tuple[int, list[Need]]] = [(r, []) for r in order]
        for need in needs:
            which = min(len(order) - 1, int((done + need[4] / 2) // share)) if share else 0
            runs[which][1].append(need)
            done += need[4]
        for reader, part in runs:
            load[reader] += sum(n[4] for n in part)
            others = tuple(r for r in ranks if r != reader)
            if rank in others:
                skip.update(n[0] for n in part)
            plan.messages += _messages(reader, others, part)
    plan.skip_keys = frozenset(skip)
    return plan


def _messages(src: int, dsts: tuple[int, ...], needs: list[Need]) -> list[_Message]:
    """The messages for one reader's run: large parts alone, small ones packed by device, in order."""
    out: list[_Message] = []
    packs: dict[str, tuple[list[str], int]] = {}

    def flush(device: str) -> None:
        keys, n = packs.pop(device, ([], 0))
        if keys:
            out.append(_Message(src, dsts, tuple(keys), n, device, True))

    for key, _offsets, _shape, _dtype, nbytes, device in needs:
        if nbytes >= PACK:
            out.append(_Message(src, dsts, (key,), nbytes, device, False))
            continue
        keys, n = packs.get(device, ([], 0))
        if n + nbytes > PIECE:
            flush(device)
            keys, n = [], 0
        packs[device] = (keys + [key], n + nbytes)
    for device in sorted(packs):
        flush(device)
    return out


_side_groups: dict[Any, Any] = {}


def _group_for(device: str) -> Any:
    """The process group a message in ``device`` memory goes on: the current one, unless it is NCCL alone and the
    memory is the host's (an optimizer's ``step`` counters, an offloaded state): then a gloo group beside it, made
    the first time on every rank (:meth:`SharedReads.transfer` asks on every rank, in the same order)."""
    import torch.distributed as dist

    group = _dist.current_group()
    if device != "cpu" or str(dist.get_backend(group)) != "nccl":
        return group
    key = (id(group), dist.get_world_size(group))
    if key not in _side_groups:
        _side_groups[key] = dist.new_group(backend="gloo")
    return _side_groups[key]
