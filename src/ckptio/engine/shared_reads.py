"""Each stored byte read once: a part of a tensor that several ranks need is read by one of them and sent to the rest.

Under DDP every rank holds the whole model and optimizer; under TP, norms and biases are replicated over the TP
ranks; under HSDP every replica group holds the same shards. Read naively, N ranks read the replicated bytes N
times from storage (a cold disk, a bucket, a shared filesystem all pay it). Instead:

1. **Describe** (:func:`describe_load`, no collective): every rank lists the parts it will fill — key, offsets
   inside the whole tensor, local shape, dtype, bytes, device — in two lists: whole tensors (DDP's state, norms and
   biases replicated over TP ranks, an optimizer's step counters) and parts of tensors (shards). Only a digest of
   each list travels, in the restore's existing "opening the checkpoint" round: a few bytes per rank, so a restore
   on 1,024 ranks does not gather a million entries.
2. **Assign** (:func:`plans`): the ranks whose list has the same digest hold the same parts (DDP's ranks, a TP
   group's norms, HSDP's replicas of one shard, every rank's step counters under FSDP), so each computes, from its
   own list alone, the same plan for its group: the list cut in key order into one contiguous run per member, of
   about equal bytes; each run is read by its member and sent to the others.
3. **Read**: the formats skip the parts this rank was not given (``ShardContext.extra["skip"]``: the identities of
   the state dict's values), inside the load round where errors are gathered as before.
4. **Send** (:meth:`SharedReads.exchange`, a context around the reads): every receive is posted before the reads;
   a reader sends a message, point to point over the job's process group with a tag of its own, as soon as the
   format says the message's last part is filled, so a rank's reads overlap its sends and the other ranks'
   receives. On leaving, every send not yet made is made and every message waited for, also when the reads
   failed (the load round then fails every rank): nothing is left pending to catch a later restore's message.
   Large contiguous parts go straight from and into the tensors' memory; small ones are packed, 64 MiB at most
   per message. On NCCL, which runs a pair's operations in the order posted, all are posted after the reads as
   one batch.

The result is bitwise what a rank's own read gives: the bytes sent are the filled destination, not re-encoded.
The checksum guarantee is unchanged: every byte that reached any rank came from a read that was hashed, and each
file's finisher joins every rank's hashed runs (:mod:`ckptio.storage.verify`), so a damaged byte read by rank 1
alone fails the restore on every rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .. import _dist

__all__ = ["Need", "Described", "describe", "describe_load", "may_share", "plans", "SharedReads", "PIECE", "PACK"]

PIECE = 64 << 20
"""Largest message: a large part is sent in pieces of this size."""
PACK = 1 << 20
"""Parts smaller than this are packed together into messages of at most :data:`PIECE` bytes."""

Need = tuple[str, tuple[int, ...], tuple[int, ...], str, int, str]
"""A part one rank fills: (key, offsets in the whole tensor, local shape, dtype, bytes, device type)."""


def describe(flat: dict[str, Any]) -> tuple[list[Need], list[Need]]:
    """The parts of the tensors of ``flat`` (a flattened state dict) this rank will fill, in its order (no
    collective): whole tensors, then parts of tensors.

    A DTensor with a ``Partial`` placement (reduced before it can be read into) and a DTensor whose mesh this rank
    is not on are left out: they are read as before."""
    from torch.distributed.tensor import DTensor, Partial

    from .plan import local_view

    whole: list[Need] = []
    parts: list[Need] = []
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
        need = (key, view.offsets, tuple(local.shape), str(local.dtype), local.numel() * local.element_size(),
                local.device.type)
        (whole if tuple(local.shape) == view.shape else parts).append(need)
    return whole, parts


@dataclass
class Described:
    """This rank's parts of the model and of the optimizer (``None``: not shared), and what the other ranks are told."""

    lists: list[list[Need] | None]
    """Model whole, model parts, optimizer whole, optimizer parts."""
    host: str

    def summary(self) -> tuple[tuple[str | None, ...], str, bool]:
        """What travels in the opening round: a digest of each list (``None``: empty or not shared), the host, and
        whether any part is in host memory (a gloo group may be needed beside NCCL)."""
        digests = tuple(hashlib.sha256(repr(n).encode()).hexdigest()[:32] if n else None for n in self.lists)
        return digests, self.host, any(need[5] == "cpu" for n in self.lists if n for need in n)


def describe_load(model: dict[str, Any] | None, model_format: str | None, optim_template: dict[str, Any] | None,
                  optim_format: Any) -> Described:
    """What a restore may share (no collective): the model's parts this rank fills (not when the model is not loaded
    whole, or its format cannot skip reads), the optimizer's on its fast path (flattened as the restore flattens
    it), and this rank's host."""
    import socket

    from ..formats import registry
    from ..formats.common import flatten

    def shares(fmt: Any) -> bool:
        try:
            return bool((registry.get(fmt) if isinstance(fmt, str) else fmt).shares_reads)
        except Exception:  # noqa: BLE001 - an unknown format fails in the load itself, with its own message
            return False

    lists: list[list[Need] | None] = [None] * 4
    if model is not None and model_format and shares(model_format):
        lists[0], lists[1] = describe(model)
    if optim_template is not None and shares(optim_format):
        lists[2], lists[3] = describe(flatten({"optim": optim_template}))
    return Described(lists, socket.gethostname())


def may_share(setting: bool | None, *, remote: bool) -> bool:
    """Whether describing this rank's parts can pay (no collective; every rank of one job decides alike, and a rank
    that does not describe turns sharing off for all in :func:`plans`): not alone, not ``share_reads: false``, and,
    left automatic on a filesystem, not when torchrun says every rank is on this node (describing the medium
    state's 1,400 parts costs ~70 ms a rank, for nothing there)."""
    import os

    world = _dist.world_size()
    if world == 1 or setting is False:
        return False
    if setting or remote:
        return True
    return os.environ.get("LOCAL_WORLD_SIZE") != str(world)


def plans(summaries: list[Any], mine: "Described | None", rank: int, setting: bool | None, *,
          remote: bool) -> tuple["SharedReads", "SharedReads"]:
    """Collective only where a gloo group must be made beside NCCL (every rank calls it at the same point): the
    model's and the optimizer's plans, from every rank's :meth:`Described.summary` (``None``: that rank does not
    share) and this rank's lists. ``setting`` is ``CheckpointConfig.share_reads``: ``None`` shares when the ranks
    span several hosts or the checkpoint is remote (one host's page cache serves its ranks from one read of a local
    or network disk)."""
    out = SharedReads(rank), SharedReads(rank)
    on = setting if setting is not None else remote or len({s[1] for s in summaries if s}) > 1
    if not on or mine is None or not all(summaries):
        return out
    if any(s[2] for s in summaries) and _dist.is_dist():
        _group_for("cpu")  # made now, on every rank, if it is needed at all
    for i, needs in enumerate(mine.lists):
        digest = summaries[rank][0][i]
        group = [r for r, s in enumerate(summaries) if s[0][i] == digest]
        if needs and len(group) > 1:
            _assign(out[i // 2], needs, group, kind=i)
    return out


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
    tag: int = 0
    """The first piece's tag (each list's messages have tags of their own: groups differ from list to list)."""


@dataclass
class SharedReads:
    """This rank's part of its groups' plans (:func:`plans`): what it skips, and the messages it sends or receives."""

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

    def exchange(self, flat: dict[str, Any], progress: Callable[[int], None] | None = None) -> "_Exchange":
        """A context around this rank's reads of ``flat`` (a flattened state dict; each rank of its groups enters
        one), giving the ``extra`` a format's load takes: receives are posted on entry, each message this rank
        reads is sent as soon as its last part is filled (``extra["filled"]``), and on exit every send not yet made
        is made and every message waited for. Also when the reads failed (the restore then fails on every rank):
        no receive is left pending to catch a later restore's messages."""
        return _Exchange(self, flat, progress)

    def _post(self, m: _Message, flat: dict[str, Any], group: Any, works: list[Any],
              unpack: list[tuple[torch.Tensor, list[torch.Tensor]]], batched: dict[Any, list[Any]]) -> torch.Tensor:
        """Post message ``m``'s sends (this rank read it) or receives; returns the buffer, which must outlive them.
        A receive that cannot land in its tensor's memory directly is listed in ``unpack``. On an NCCL group the
        operations are collected in ``batched`` instead: NCCL ignores tags and runs a pair's sends and receives on
        one stream in the order posted, so two ranks that each send to the other first would wait on each other;
        posted as one batch (``batch_isend_irecv``) they cannot."""
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
        nccl = str(dist.get_backend(group)) == "nccl"
        for j, at in enumerate(range(0, m.nbytes, PIECE)):
            piece, tag = buf[at:at + PIECE], m.tag | j
            if nccl:
                batched.setdefault(group, []).extend(
                    [dist.P2POp(dist.isend, piece, d, group=group, tag=tag) for d in m.dsts] if mine else
                    [dist.P2POp(dist.irecv, piece, m.src, group=group, tag=tag)])
            elif mine:
                works += [dist.isend(piece, d, group=group, tag=tag) for d in m.dsts]
            else:
                works.append(dist.irecv(piece, m.src, group=group, tag=tag))
        return buf


class _Exchange:
    """One restore's messages (:meth:`SharedReads.exchange`). On gloo, receives are posted before the reads and sends
    as their parts are filled, so reading overlaps sending. On NCCL, which ignores tags and runs a pair's operations
    in the order posted, every send and receive is posted at the end as one batch (``batch_isend_irecv``)."""

    def __init__(self, plan: SharedReads, flat: dict[str, Any], progress: Callable[[int], None] | None) -> None:
        self.plan, self.flat, self.progress = plan, flat, progress
        self.groups = {device: _group_for(device) for device in {m.device for m in plan.messages}}  # made in plans()
        self.works: list[Any] = []
        self.unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.keep: list[torch.Tensor] = []  # buffers alive until their work is done
        self.batched: dict[Any, list[Any]] = {}
        self.waiting: dict[int, list[list[Any]]] = {}  # a value's identity -> [message, its parts not yet filled]
        self.unsent: list[_Message] = []
        self.received = sum(m.nbytes for m in plan.messages if m.src != plan.rank)
        self.skip = plan.skip(flat)

    def __enter__(self) -> dict[str, Any]:
        import torch.distributed as dist

        rank = self.plan.rank
        for m in self.plan.messages:
            nccl = str(dist.get_backend(self.groups[m.device])) == "nccl"
            if rank == m.src and not nccl:
                entry = [m, {id(self.flat[k]) for k in m.keys}]
                for k in m.keys:
                    self.waiting.setdefault(id(self.flat[k]), []).append(entry)
            elif rank == m.src or nccl:
                self.unsent.append(m)
            else:
                self._post(m)
        return {"skip": self.skip, "filled": self.filled} if self.plan else {"skip": self.skip}

    def filled(self, value: int) -> None:
        """Called by a format when the value of identity ``value`` is wholly filled: send what is now complete."""
        for entry in self.waiting.pop(value, ()):
            entry[1].discard(value)
            if not entry[1]:
                self._post(entry[0])

    def _post(self, m: _Message) -> None:
        """Post message ``m``'s sends or receives; its buffer is kept until every work is waited for."""
        self.keep.append(self.plan._post(m, self.flat, self.groups[m.device], self.works, self.unpack, self.batched))

    def __exit__(self, kind: Any, *_: Any) -> None:
        try:
            self._finish(ok=kind is None)
        except Exception:
            if kind is None:
                raise  # else the reads' own error is the one to tell

    def _finish(self, ok: bool) -> None:
        import torch.distributed as dist

        pending = {id(e[0]): e[0] for entries in self.waiting.values() for e in entries if e[1]}
        self.waiting.clear()
        for m in [*self.unsent, *pending.values()]:  # a failed read still sends: its receivers are waiting
            self._post(m)
        for ops in self.batched.values():
            self.works += dist.batch_isend_irecv(ops)
        for work in self.works:
            work.wait()
        if not ok:
            return
        with torch.no_grad():
            for buf, targets in self.unpack:
                at = 0
                for t in targets:  # byte copies: a packed part need not sit at an offset aligned for its dtype
                    n = t.numel() * t.element_size()
                    into = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                    _bytes_of(into).copy_(buf[at:at + n])
                    if into is not t:
                        t.copy_(into)
                    at += n
        if self.progress is not None and self.received:
            self.progress(self.received)
        if any(t.device.type != "cpu" for t in self.keep) and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` tensor sharing its memory (sent raw: no dtype a backend lacks)."""
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _assign(plan: "SharedReads", needs: list[Need], group: list[int], *, kind: int) -> None:
    """Add to ``plan`` the reads and messages of ``needs``, a list every rank of ``group`` holds identically: cut in
    key order into one run per member of about equal bytes, each read by its member and sent to the others."""
    total = sum(n[4] for n in needs)
    share = total / len(group)
    runs: list[list[Need]] = [[] for _ in group]
    done = 0
    for need in needs:
        runs[min(len(group) - 1, int((done + need[4] / 2) // share)) if share else 0].append(need)
        done += need[4]
    plan.shared_bytes += total
    messages: list[_Message] = []
    for reader, part in zip(group, runs):
        others = tuple(r for r in group if r != reader)
        if plan.rank != reader:
            plan.skip_keys |= {n[0] for n in part}
        messages += _messages(reader, others, part)
    for i, m in enumerate(messages):
        if plan.rank == m.src or plan.rank in m.dsts:
            plan.messages.append(replace(m, tag=(kind << 27) | (i << 10)))


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
    the first time on every rank (:func:`plans` asks on every rank when any rank has a part in host memory)."""
    import torch.distributed as dist

    group = _dist.current_group()
    if device != "cpu" or str(dist.get_backend(group)) != "nccl":
        return group
    key = _dist.group_key()  # the same on every rank: each makes its side group, or none does
    if key not in _side_groups:
        _side_groups[key] = _dist.new_gloo_group()  # destroyed at exit at the latest
    return _side_groups[key]
