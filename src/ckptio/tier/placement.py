"""Where the copies of each node's part of a memory snapshot go: a pure function of the nodes and their domains.

Each node's part (the files its ranks write) is held on ``replicas`` distinct nodes: its own and ``replicas - 1``
others, its *holders*. Nodes are numbered in the order of their lowest rank; each has a failure domain (a rack, a
switch, a power feed: what one fault takes down together). :func:`place` chooses the holders so that

1. the copies of a part span as many domains as they can: ``min(replicas, domains)``, the node's own among them;
2. within that, no node holds more copies of other nodes' parts than it must: copies are dealt out one round at a
   time to the least-loaded allowed node, then moved (directly, or along a chain of moves) from any node holding
   two or more copies more than another while a move keeps the first rule;
3. everything else equal, a copy goes to the nearest node after the part's own in ring order (with every node its
   own domain and two copies, each node's part goes to the next node, as before failure domains existed).

The answer depends only on the list of domains and ``replicas``: every rank computes the same placement, and a
snapshot records it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "place"]


@dataclass(frozen=True)
class Placement:
    """The holders of each node's part, and what falls short of the request (for the log)."""
    holders: tuple[tuple[int, ...], ...]
    """By node: the nodes that hold its part, the node itself first, then the others in the order chosen."""
    copies: int
    """Copies of each part: ``replicas``, or the number of nodes when there are fewer."""
    spread: int
    """Domains each part's copies span: ``min(copies, number of domains)``."""
    shortfall: str | None = None
    """Why the copies of a part span fewer nodes or domains than ``replicas`` asked for; ``None``: they do not."""

    def load(self) -> list[int]:
        """Copies of other nodes' parts each node holds."""
        out = [0] * len(self.holders)
        for own in self.holders:
            for h in own[1:]:
                out[h] += 1
        return out


def place(domains: list[str], replicas: int) -> Placement:
    """The holders of every node's part (see the module's docstring); ``domains[i]`` is node ``i``'s domain."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    n = len(domains)
    copies = min(replicas, n)
    spread = min(copies, len(set(domains)))
    chosen: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for _round in range(copies - 1):  # one more copy of every part per round: the counts grow evenly
        floor = min(load)  # no count is lower during the round: a node at it is the best there is
        for i in range(n):
            j = _next_holder(domains, i, chosen[i], spread, load, floor)
            chosen[i].append(j)
            load[j] += 1
    _even_out(domains, chosen, load, spread)
    shortfall = None
    if replicas > n > 1:  # one node: nothing is replicated, and the log says so without a warning
        shortfall = (f"memory_replicas={replicas} but the job has {n} node(s): each part is held on {copies} "
                     f"node(s)")
    elif spread < copies:
        shortfall = (f"memory_replicas={replicas} but the {n} nodes span {len(set(domains))} failure domain(s) "
                     f"(CKPTIO_FAILURE_DOMAIN): the copies of a part share a domain, and losing it may lose them all")
    return Placement(tuple((i, *chosen[i]) for i in range(n)), copies, spread, shortfall)


def _domains_of(domains: list[str], nodes: list[int]) -> set[str]:
    return {domains[j] for j in nodes}


def _next_holder(domains: list[str], i: int, mine: list[int], spread: int, load: list[int], floor: int) -> int:
    """The least-loaded node that may take node ``i``'s next copy, the nearest after ``i`` in ring order among
    equals: not already a holder; of a new domain while the copies span fewer than ``spread`` domains."""
    n = len(domains)
    covered = {domains[h] for h in (i, *mine)}
    new_domain = len(covered) < spread
    best = -1
    for step in range(1, n):
        j = (i + step) % n
        if j in mine or (new_domain and domains[j] in covered):
            continue
        if best < 0 or load[j] < load[best]:
            best = j
            if load[j] <= floor:
                break
    return best


def _keeps_spread(domains: list[str], i: int, mine: list[int], old: int, new: int, spread: int) -> bool:
    return len(_domains_of(domains, [i, *(new if h == old else h for h in mine)])) >= spread


def _even_out(domains: list[str], chosen: list[list[int]], load: list[int], spread: int) -> None:
    """Move copies from a fuller node to one holding at least two fewer, the spread kept, directly or along a chain
    (a copy into a node whose copy of another part moves on), fullest nodes first, until no such move is left:
    each one lowers the sum of the squared counts, so this ends."""
    while True:
        stuck: set[int] = set()  # reached by a search that found no way out: as stuck as its start, at that count
        low = min(load)
        for start in sorted((j for j in range(len(load)) if load[j] >= low + 2), key=lambda j: (-load[j], j)):
            if start in stuck:
                continue
            path, reached = _relief(domains, chosen, load, spread, start)
            if path is not None:
                break
            stuck.update(j for j in reached if load[j] == load[start])
        else:
            return
        for i, old, new in path:
            chosen[i][chosen[i].index(old)] = new
            load[old] -= 1
            load[new] += 1


def _relief(domains: list[str], chosen: list[list[int]], load: list[int], spread: int,
            start: int) -> tuple[list[tuple[int, int, int]] | None, set[int]]:
    """A chain of copy moves ``(part, from, to)`` that takes one copy off ``start`` and lands one, through nodes
    whose counts do not change, on a node holding at least two fewer; each part moves at most once, so the moves
    are independent. Breadth-first, so the chain is short and the same on every rank; ``None``: there is none.
    Also returns the nodes the search reached."""
    n = len(domains)
    held_by: list[list[int]] = [[] for _ in range(n)]
    for i, mine in enumerate(chosen):
        for h in mine:
            held_by[h].append(i)
    order = sorted(range(n), key=lambda j: (load[j], j))
    came: dict[int, list[tuple[int, int, int]]] = {start: []}
    frontier = [start]
    while frontier:
        nxt: list[int] = []
        for h in frontier:
            moved = {i for i, _, _ in came[h]}
            for i in held_by[h]:
                if i in moved:
                    continue
                for j in order:
                    if j in came or j == i or j in chosen[i] or not _keeps_spread(domains, i, chosen[i], h, j, spread):
                        continue
                    came[j] = [*came[h], (i, h, j)]
                    if load[j] <= load[start] - 2:
                        return came[j], set(came)
                    nxt.append(j)
        frontier = nxt
    return None, set(came)
