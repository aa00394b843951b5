"""Whole files sent from one rank's node folder to another's, over the job's process group.

The memory tier moves files in two situations, with the same call: a snapshot's files go to the rank that keeps
their replica (save), and the files a rank needs to restore go to its node from a node that holds them
(restore). Both sides know the whole list of :class:`Move` s beforehand (every rank computes it from the same
gathered facts), so each rank posts all its sends and receives at once, each with its own tag, and waits: no
ordering can deadlock.

The bytes go without a copy: the sender maps its file and sends from the mapping; the receiver maps a new file
of the right size and receives into it, then checks the bytes against the manifest's checksum before the file
gets its real name. A file that arrives damaged is an error naming it, and nothing is left under its name.

Collective on the current group (:func:`ckptio._dist.current_group`, gloo: the bytes are host memory). A rank
that cannot open a file it must send still sends zeros, so its peer is not left waiting: the checksum then
fails on the receiving side, and the round that follows raises on every rank.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _dist, _faults
from ..errors import CheckpointCorruptError
from ..storage.checksum import RunningChecksum
from ..storage.confined import Folder, check_relative

__all__ = ["Move", "send_and_receive", "PIECE"]

PIECE = 64 << 20
"""Largest message: files are sent in pieces of this size."""


@dataclass(frozen=True)
class Move:
    """One file from ``src``'s node folder to ``dst``'s."""
    src: int
    dst: int
    rel: str
    size: int
    checksum: str


def send_and_receive(moves: list[Move], source: Path, target: Path, point: str | None = None,
                     failed: list[tuple[Move, str]] | None = None) -> tuple[int, float]:
    """Collective: run every move this rank takes part in; files are read under ``source`` and written under
    ``target`` (this rank's node folders, the same relative path). Returns the bytes this rank received and the
    seconds it took. Raises :class:`CheckpointCorruptError` on every rank when a file could not be sent or
    arrived damaged (nothing is then left under its name); with ``failed``, appends to it instead, on every
    rank, each move that failed (of any rank) with why, and raises nothing."""
    import torch.distributed as dist

    rank = _dist.rank()
    group = _dist.current_group()
    start = time.perf_counter()
    problems: list[str] = []
    broken: list[tuple[int, str]] = []  # (move number, why): the moves this rank saw fail
    maps: list[Any] = []  # closed once no tensor refers to them
    arriving: list[tuple[int, Move, Path | None, Any]] = []
    received = 0
    try:
        works: list[Any] = []
        for i, m in enumerate(moves):
            if m.src == m.dst or rank not in (m.src, m.dst):
                continue
            if m.src == rank:
                buf, mapped = _source(source, m, problems)
                if len(problems) > len(broken):
                    broken.append((i, problems[-1]))
                works += [dist.isend(piece, m.dst, group=group, tag=_tag(i, j)) for j, piece in _pieces(buf)]
            else:
                part, buf, mapped = _target(target, m, problems)
                if len(problems) > len(broken):
                    broken.append((i, problems[-1]))
                arriving.append((i, m, part, mapped))
                works += [dist.irecv(piece, m.src, group=group, tag=_tag(i, j)) for j, piece in _pieces(buf)]
            maps.append(mapped)
            del buf
        if point is not None:
            _faults.point(point)  # every send and receive posted, none waited for
        for work in works:
            work.wait()
        del works  # the last references to the mapped tensors
        for i, m, part, mapped in arriving:
            problem = _finish(m, part, mapped)
            if problem:
                problems.append(problem)
                broken.append((i, problem))
            received += m.size
    finally:
        for mapped in maps:
            _close(mapped)
        for _i, _m, part, _mapped in arriving:
            if part is not None:
                part.unlink(missing_ok=True)  # left only when this rank failed before checking it
    if failed is not None:
        failed.extend(_gather_failures(moves, broken))
        return received, time.perf_counter() - start
    error = CheckpointCorruptError("; ".join(problems[:3])) if problems else None
    _dist.run_collectively("moving memory snapshot files", lambda: _raise(error))
    return received, time.perf_counter() - start


def _gather_failures(moves: list[Move], broken: list[tuple[int, str]]) -> list[tuple[Move, str]]:
    """Collective: every rank's failed moves (each once, with the first reason given), in move order."""
    seen: dict[int, str] = {}
    for i, why in sorted(x for part in _dist.all_gather_object(broken) for x in part):
        seen.setdefault(i, why)
    return [(moves[i], why) for i, why in sorted(seen.items())]


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _tag(i: int, j: int) -> int:
    return (i << 12) | j  # up to 4,096 pieces (256 GiB) per file


def _pieces(buf: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(j, buf[at:at + PIECE]) for j, at in enumerate(range(0, buf.numel(), PIECE))]


def _source(source: Path, m: Move, problems: list[str]) -> tuple[torch.Tensor, Any]:
    """The bytes to send: a private mapping of the file (no copy), or zeros when it cannot be read."""
    try:
        with Folder(source).open(m.rel, size=m.size) as handle:
            if m.size == 0:
                return torch.empty(0, dtype=torch.uint8), None
            mapped = mmap.mmap(handle.fd, m.size, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mapped, dtype=torch.uint8), mapped
    except Exception as exc:  # noqa: BLE001 - zeros go instead, so the receiver is not left waiting; raised after
        problems.append(f"{source / m.rel}: cannot be sent ({type(exc).__name__}: {exc})")
        return torch.zeros(m.size, dtype=torch.uint8), None


def _target(target: Path, m: Move, problems: list[str]) -> tuple[Path | None, torch.Tensor, Any]:
    """Where the bytes arrive: a mapping of a new hidden file of the right size (memory, when it cannot be made)."""
    try:
        check_relative(m.rel, target)
        path = target / m.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.ftruncate(fd, m.size)
            mapped = mmap.mmap(fd, m.size) if m.size else None
        finally:
            os.close(fd)
        return part, torch.frombuffer(mapped, dtype=torch.uint8) if mapped is not None else torch.empty(0, dtype=torch.uint8), mapped
    except Exception as exc:  # noqa: BLE001 - received into memory and dropped, so the sender is not left waiting
        problems.append(f"{target / str(m.rel)}: cannot be received ({type(exc).__name__}: {exc})")
        return None, torch.empty(m.size, dtype=torch.uint8), None


def _finish(m: Move, part: Path | None, mapped: Any) -> str | None:
    """Check what arrived against the manifest's checksum; give it its name, or remove it."""
    if part is None:
        return None  # already reported
    crc = RunningChecksum()
    if mapped is not None:
        crc.update(mapped)
        mapped.flush()
    final = part.parent / part.name[1:].rsplit(".", 2)[0]
    if crc.digest != m.checksum:
        return f"{final}: arrived from rank {m.src} with checksum {crc.digest}, the manifest records {m.checksum}"
    os.rename(part, final)
    return None


def _close(mapped: Any) -> None:
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:  # a tensor still refers to it: the mapping goes when that tensor does
            pass
