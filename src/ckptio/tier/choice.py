"""Which snapshot a restore takes, and who holds and sends what: the memory tier's decisions, from gathered facts.

Every function here is pure (no collective, no file): the ranks gather the facts (which node each rank is on,
what each node holds, what each rank needs), and each computes the same answer from them, or rank 0 does and
broadcasts it. :mod:`.memory` runs the rounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError
from .node import Held
from .placement import place
from .transfer import Move

__all__ = ["Nodes", "copies", "no_room", "plan_moves", "candidates", "pick"]


class Nodes:
    """Which ranks share a node (a memory folder), and which ranks keep the copies of whose part."""

    def __init__(self, ids: list[str], domains: list[str] | None = None, replicas: int = 2) -> None:
        self.ids = ids
        """Each rank's node id, by rank."""
        self._ranks: dict[str, list[int]] = {}
        for r, node in enumerate(ids):
            self._ranks.setdefault(node, []).append(r)
        self.order = list(self._ranks)
        """The nodes by their lowest rank (the node numbers of the placement)."""
        self.domains = [node if domains is None or not domains[self._ranks[node][0]] else domains[self._ranks[node][0]]
                        for node in self.order]
        """Each node's failure domain (its lowest rank's), in :attr:`order`; unset: the node is its own."""
        self.placement = place(self.domains, replicas)
        number = {node: i for i, node in enumerate(self.order)}
        local = {r: i for node in self.order for i, r in enumerate(self._ranks[node])}
        self._holders: list[list[int]] = []
        for r, node in enumerate(ids):
            there = [self._ranks[self.order[h]] for h in self.placement.holders[number[node]][1:]]
            self._holders.append([theirs[local[r] % len(theirs)] for theirs in there])

    def ranks(self, node: str) -> list[int]:
        return self._ranks[node]

    def leader(self, rank: int) -> int:
        """The rank that commits, drops and frees for ``rank``'s node: its lowest."""
        return self._ranks[self.ids[rank]][0]

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s part, one on each other node of its part's placement: the rank of
        the same local index (modulo) there."""
        return self._holders[rank]

    def peer(self, rank: int) -> int:
        """The first of :meth:`holders` (``rank`` itself when its part has no copy elsewhere)."""
        return (self._holders[rank] or [rank])[0]

    def record(self) -> dict[str, Any]:
        """The placement as a snapshot records it: node ids, domains and holders by node number."""
        return {"replicas": self.placement.copies, "nodes": list(self.order), "domains": list(self.domains),
                "holders": [list(h) for h in self.placement.holders]}


def copies(nodes: Nodes, owners: list[dict[str, tuple[int, str]]], everywhere: str) -> list[Move]:
    """The moves that put each rank's files (``owners[r]``: rel -> (size, checksum)) on its holders, and the file
    ``everywhere`` (rank 0's: the snapshot's record) on every node."""
    moves = [Move(r, h, rel, size, digest) for r in range(len(owners)) for h in nodes.holders(r)
             for rel, (size, digest) in sorted(owners[r].items())]
    if everywhere in owners[0]:
        has = {nodes.ids[m.dst] for m in moves if m.rel == everywhere} | {nodes.ids[0]}
        size, digest = owners[0][everywhere]
        moves += [Move(0, nodes.ranks(node)[0], everywhere, size, digest) for node in nodes.order if node not in has]
    return moves


def no_room(nodes: Nodes, facts: list[tuple[int, int]], where: Path) -> str | None:
    """Why some node cannot take a snapshot beside the one it keeps (``None``: all can), from each rank's
    ``(bytes of its part, free bytes of its node's folder)``: a node keeps its ranks' parts and the copies the
    placement gives it."""
    need = dict.fromkeys(nodes.order, 0)
    for r, (n, _) in enumerate(facts):
        for h in [r, *nodes.holders(r)]:
            need[nodes.ids[h]] += n
    for node in nodes.order:
        free = facts[nodes.ranks(node)[0]][1]
        if need[node] > free:
            return (f"the node of rank {nodes.ranks(node)[0]} needs {need[node] / 1e6:.1f} MB for it and has "
                    f"{free / 1e6:.1f} MB free in {where}")
    return None


def plan_moves(nodes: Nodes, needs: list[set[str]], present: dict[str, set[str]], holders: dict[str, list[int]],
               sizes: dict[str, tuple[int, str]]) -> list[Move]:
    """The moves that bring every rank's ``needs`` to its node, each file once per node, from the holders in turn
    (``present`` is updated with what will have arrived). Every rank computes the same list."""
    moves: list[Move] = []
    turn = 0
    for r, wanted in enumerate(needs):
        node = nodes.ids[r]
        for rel in sorted(wanted):
            if rel in present[node]:
                continue
            sources = holders.get(rel)
            if not sources:
                raise CheckpointCorruptError(f"{rel}: no surviving node holds this file of the snapshot")
            held_by = nodes.ranks(nodes.ids[sources[turn % len(sources)]])
            size, digest = sizes[rel]
            moves.append(Move(held_by[turn % len(held_by)], r, rel, size, digest))
            turn += 1
            present[node].add(rel)
    return moves


def candidates(everyone: list[dict[str, Held]], run: str,
               durable_step: int | None) -> tuple[list[tuple[str, str]], str]:
    """Rank 0: the snapshots a restore may take, newest first, as ``(name, manifest digest)``: each whole on the
    surviving nodes, of this run, newer than the durable checkpoint of step ``durable_step`` and following one
    that is still there; and what to say about them (why each newer one is skipped). A restore tries them in turn
    and leaves the rest to the durable tier."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for held in everyone:
        for name, h in held.items():
            c = found.setdefault((name, h.digest), {"step": h.step, "files": set(), "total": h.extra["total"],
                                                   "info": None})
            c["files"].update(h.files)
            c["info"] = c["info"] or h.info
    notes: list[str] = []
    usable: list[tuple[str, str]] = []
    durable_wins = False
    for (name, digest), c in sorted(found.items(), key=lambda kv: (-kv[1]["step"], kv[0])):
        if durable_step is not None and durable_step >= c["step"]:
            if not usable:
                durable_wins = True
                notes.append(f"the newest durable checkpoint (step {durable_step}) is as new as the newest usable "
                             f"memory snapshot ({name}) or newer")
            break
        why = _unusable(name, c, run, durable_step)
        if why is None:
            usable.append((name, digest))
        elif not usable:
            notes.append(why)
    if usable:
        first = f"restoring snapshot {usable[0][0]} (step {found[usable[0]]['step']})"
        return usable, "Memory tier: " + "; ".join([*notes, first])
    if not found:
        return [], ""
    if durable_wins:
        return [], "Memory tier: " + "; ".join(notes)
    return [], "Memory tier: no usable snapshot (" + "; ".join(notes) + "); restoring from the durable tier"


def _unusable(name: str, c: dict[str, Any], run: str, durable_step: int | None) -> str | None:
    """Why the snapshot ``name`` (what the nodes hold of it: ``c``) cannot be restored, or ``None``."""
    if len(c["files"]) < c["total"]:
        return (f"snapshot {name} is incomplete: {c['total'] - len(c['files'])} of its {c['total']} files are on no "
                f"surviving node{_held_on(c['info'])}")
    info = c["info"] or {}
    if info.get("run") != run:
        return f"snapshot {name} belongs to another run"
    base = info.get("durable_step")
    if base is not None and (durable_step is None or durable_step < base):
        return (f"snapshot {name} follows the durable checkpoint of step {base}, which checkpoint_dir no longer has "
                "(a snapshot of an earlier run in the same folder?)")
    return None


def _held_on(info: dict[str, Any] | None) -> str:
    """Where the snapshot's record says its parts were held (said when it is incomplete)."""
    p = (info or {}).get("placement")
    if p is None:
        return ""
    if p["replicas"] == 1:
        return " (memory_replicas=1: each part was on its own node only)"
    return f" (each part was on {p['replicas']} nodes, over {len(set(p['domains']))} failure domain(s) in all)"


def pick(everyone: list[dict[str, Held]], run: str, durable_step: int | None) -> tuple[tuple[str, str] | None, str]:
    """Rank 0: the snapshot to restore first (:func:`candidates`), or ``None``; and what to say about it."""
    usable, message = candidates(everyone, run, durable_step)
    return (usable[0] if usable else None), message
