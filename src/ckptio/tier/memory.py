"""The memory tier: snapshots of the whole state in node-local memory, each rank's part held on several nodes.

A durable save (disk, object storage) is too slow to take every few steps; a snapshot into host memory is not.
Every ``memory_every_steps`` steps the state is copied into staging buffers (the training pause) and, in the
background, written as a step directory into the node's folder of the memory tier (:mod:`.node`) — the same
files, manifest and checksums as a durable checkpoint, each rank writing its own files into its own node's
memory — then each rank sends its files to its holders: the rank of the same local index on each other node
that the placement (:mod:`.placement`, ``memory_replicas`` nodes per part, spread over failure domains) gives
its node (:class:`Nodes`); the snapshot's record (``memory_tier.json``, with the placement) goes to every node.
On one node the folder is already shared by all its ranks, so nothing is sent. A snapshot is committed, on
every node, only once every rank has written its files and every holder has them; the snapshot before it is
dropped only after that commit, so a node holds at most two snapshots and a crash at any instant leaves one
that is complete on the surviving nodes, or falls back to the durable tier.

Restore (automatic resume only): every node lists what it holds (:meth:`.node.NodeFolder.inventory`), rank 0
takes the newest snapshot whose every file is on some surviving node (own copy or replica) if it is newer
than the newest durable checkpoint, and each node then gets the files its ranks will read, from the nodes
that hold them (:mod:`.needs` says which: a replaced node gets its ranks' shards from their replicas; a
restore on another number of ranks gets the pieces the new layout needs). The ordinary restore path then
reads the snapshot, with every byte checked against the manifest; before it, each node checks its own copies
of the files its ranks will read, and a damaged copy (or one that arrives damaged) is taken from the part's
next holder. Every byte of a snapshot is read through the one gate (:mod:`ckptio.storage.confined`,
:mod:`ckptio.storage.parse`); a snapshot that fails a check, for the reason the log states, gives way to the
next older usable one, and the last to the durable tier.

Call sequence (every rank, like the manager's other calls): :meth:`MemoryTier.save` on the training thread
(stages, then returns; the rest runs on a background thread with a gloo group of its own), :meth:`wait`,
:meth:`restore` and :meth:`close`. Not thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

from .. import _dist, _faults
from ..engine.background import BackgroundWriter
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..engine.manifest import MANIFEST_NAME
from ..engine.saving import SaveJob, Saver
from ..storage.confined import Folder
from ..storage.local import TMP_PREFIX, LocalFolderWriter, LocalStorage
from ..storage.posix import remove_tree
from .choice import Nodes, candidates, copies, no_room, pick, plan_moves
from .needs import shard_files, side_files
from .node import (TIER_FILE, Held, NodeFolder, damaged_copies, default_memory_dir, failure_domain, snapshot_manifest,
                   stand_ins)
from .transfer import Move, send_and_receive

__all__ = ["MemoryTier", "Nodes", "pick", "no_room"]


class MemoryTier:
    """The memory tier of one manager (see the module's docstring)."""

    def __init__(self, config: Any, tracked: Any, log: Any) -> None:
        self.config, self.tracked, self.log = config, tracked, log
        self.node = NodeFolder(config.memory_dir or default_memory_dir(), str(config.checkpoint_dir))
        # a snapshot is a step directory of per-rank shard files (what a restore on any layout plans from), and
        # never a consolidated bundle, a tokenizer or a config
        own = dataclasses.replace(config, checkpoint_dir=str(self.node.root), model_save_format="safetensors",
                                  optimizer_save_format="safetensors", save_consolidated=False, async_save=True,
                                  is_async=None, memory_every_steps=None, persist_every_steps=None,
                                  share_unchanged=False)
        self.saver = Saver(own, tracked, LocalStorage(self.node.root), None, log)
        self.saver.what, self.saver.whole_apart = "memory snapshot", True
        self.writer: BackgroundWriter | None = None
        self.nodes: Nodes | None = None
        self.durable_step: int | None = None
        """The newest durable checkpoint's step, as the last restore found it (recorded in each snapshot: a snapshot
        whose durable checkpoint is gone belongs to an earlier run in the same folder)."""
        self.last: dict[str, Any] = {}
        """Figures of the last snapshot: ``pause_s``, ``write_s``, ``replicate_s``, ``replicated_bytes``,
        ``node_bytes`` (this node's memory tier), ``step``."""

    # ---------------------------------------------------------------------------------------------- set-up
    def _ensure(self) -> Nodes:
        """Collective, once: the background writer's gloo group, this node's folder and id, and the node map."""
        if self.writer is None:
            self.writer = BackgroundWriter(self.log, "memory snapshot")
        if self.nodes is None:
            with _dist.using_group(self.writer.group):
                _, ids = _dist.agree(f"opening the memory tier under {self.node.parent}",
                                     lambda: (self.node.open(), failure_domain()), share=lambda opened: opened)
            self.nodes = Nodes([i for i, _ in ids], [d for _, d in ids], self.config.memory_replicas)
            if _dist.rank() == 0:
                _say_placement(self.log, self.node.root, self.nodes)
        return self.nodes

    @property
    def group(self) -> Any:
        assert self.writer is not None
        return self.writer.group

    # ---------------------------------------------------------------------------------------------- save
    def save(self, step: int, epoch: int, counters: dict[str, Any], durable_step: int | None) -> Path:
        """Collective, training thread: stage a snapshot of everything and hand it to the background (which skips it,
        with a warning, when some node has no room for it)."""
        nodes = self._ensure()
        assert self.writer is not None
        self.writer.wait()
        start = time.perf_counter()
        job = self.saver.snapshot(step, epoch, {}, counters, False, stage=True)
        job.extras = False
        self.last = {"step": step, "pause_s": time.perf_counter() - start}
        self.writer.start(self.node.root / job.name, lambda: self._persist(job, durable_step, nodes))
        return self.node.root / job.name

    def _persist(self, job: SaveJob, durable_step: int | None, nodes: Nodes) -> None:
        """Background thread, collective on the writer's group: write, replicate, commit, drop the older."""
        rank, world = _dist.rank(), _dist.world_size()
        leader = nodes.leader(rank) == rank
        start = time.perf_counter()
        self.saver.settle(job)
        facts = _dist.all_gather_object((self.saver.stager.nbytes + sum(len(b) for b in job.objects.values()),
                                         self.node.free_bytes()))
        room = no_room(nodes, facts, self.node.parent)
        if room is not None:
            self.last["skipped"] = room
            if rank == 0:
                self.log.warning("Memory snapshot of step %d skipped: %s", job.step, room)
            return
        token = _dist.broadcast_object(f"{TMP_PREFIX}{job.name}-{uuid.uuid4().hex[:8]}" if rank == 0 else "")
        tmp = self.node.root / token
        writer = LocalFolderWriter(self.node.root / job.name, tmp)
        _dist.run_collectively("starting a memory snapshot", lambda: tmp.mkdir(mode=0o700, exist_ok=True))
        try:
            states = self.saver.write_states(job, writer, rank, world)
            if rank == 0:
                record = {"run": self.node.key, "checkpoint_dir": str(self.config.checkpoint_dir),
                          "durable_step": durable_step, "placement": nodes.record()}
                job.sums[TIER_FILE] = writer.write_bytes(TIER_FILE, json.dumps(record).encode())
            _faults.point("memory.states_written")
            written = time.perf_counter()
            manifest, owners = self._describe(job, writer, states, world)
            moves = copies(nodes, owners, TIER_FILE)
            send_and_receive(moves, tmp, tmp, point="memory.replicating")
            replicated = time.perf_counter()
            _faults.point("memory.replicated")
            _dist.run_collectively(f"committing memory snapshot {job.name}",
                                   lambda: writer.commit((MANIFEST_NAME, manifest)) if leader else None)
            _faults.point("memory.committed")
        except Exception:
            if leader:
                remove_tree(tmp)
            raise
        _, used = _dist.agree("dropping older memory snapshots", lambda: self._drop(job.name) if leader else None,
                              share=lambda u: u)
        node_bytes, sent = used[nodes.leader(rank)], sum(m.size for m in moves)
        self.last.update(write_s=written - start, replicate_s=replicated - written, commit_s=time.perf_counter() - replicated,
                         replicated_bytes=sent, node_bytes=node_bytes)
        if rank == 0:
            self.log.info("Memory snapshot %s committed in %.2f s (written %.2f s, replicated %.1f MB in %.2f s); "
                          "memory tier: %.1f MB on this node, %.1f MB on all %d", job.name,
                          time.perf_counter() - start, written - start, sent / 1e6,
                          replicated - written, node_bytes / 1e6, sum(u for u in used if u) / 1e6, len(nodes.order))

    def _describe(self, job: SaveJob, writer: LocalFolderWriter, states: dict, world: int) -> tuple[bytes, list[dict]]:
        """Collective: the manifest (bytes) and every rank's own files (rel -> (size, checksum)); rank 0 also owns what
        libraries wrote into its node's folder."""
        mine = {rel: ((writer.tmp / rel).stat().st_size, digest) for rel, digest in job.sums.items()}
        owners = _dist.all_gather_object(mine)

        def build() -> tuple[bytes, dict] | None:
            if _dist.rank() != 0:
                return None
            claimed = {rel for part in owners for rel in part}
            extra = {rel: (size, writer.checksum_of(rel)) for rel, size in writer.files().items() if rel not in claimed}
            everything = {rel: v for part in owners for rel, v in part.items()} | extra
            manifest = self.saver.manifest_of(job, states, {rel: s for rel, (s, _) in sorted(everything.items())},
                                              {rel: d for rel, (_, d) in everything.items()}, world)
            return manifest.to_json().encode(), extra

        built = _dist.broadcast_object(_dist.run_collectively("describing the memory snapshot", build))
        assert built is not None
        manifest, extra = built
        owners[0] = {**owners[0], **extra}
        return manifest, owners

    def _drop(self, keep: str) -> int:
        for name in self.node.drop_except({keep}):
            self.log.debug("Memory tier: dropped %s", self.node.root / name)
        return self.node.used_bytes()

    def wait(self) -> Path | None:
        """Block until the snapshot in flight is committed; raise its error here. Returns its folder (``None``: none
        was in flight)."""
        return self.writer.wait() if self.writer is not None else None

    # ---------------------------------------------------------------------------------------------- restore
    def restore(self, restorer: Any, durable: Path | None) -> Any:
        """Collective: restore from the newest usable snapshot if it is newer than the durable checkpoint ``durable``
        (the newest one, or ``None``); one found damaged while restoring gives way to the next older usable one.
        Returns the :class:`~ckptio.RestoreInfo`, or ``None`` to leave the restore to the durable tier (the log
        says why)."""
        nodes = self._ensure()
        self.wait()
        with _dist.using_group(self.group):
            held = self.node.inventory(self.log) if nodes.leader(_dist.rank()) == _dist.rank() else {}
            everyone = _dist.all_gather_object(held)

            def decide() -> tuple[list[tuple[str, str]], str, int | None]:
                newest = _durable_step(restorer.storage, durable)
                return (*candidates(everyone, self.node.key, newest), newest)

            usable, message, self.durable_step = _dist.decide_on_rank0("choosing a memory snapshot", decide)
        if _dist.rank() == 0 and message:
            (self.log.info if usable or "newer" in message else self.log.warning)(message)
        for i, (name, digest) in enumerate(usable):
            then = f"snapshot {usable[i + 1][0]}" if i + 1 < len(usable) else "the durable tier"
            info = self._restore_snapshot(restorer, nodes, name, digest, everyone, then)
            if info is not None:
                return info
        return None

    def _restore_snapshot(self, restorer: Any, nodes: Nodes, name: str, digest: str, everyone: list[dict[str, Held]],
                          then: str) -> Any:
        """Collective: restore snapshot ``name``; ``None`` when every rank found it damaged (said in the log, with
        what is tried ``then``); any other error is raised."""
        token = _dist.broadcast_object(uuid.uuid4().hex[:8])
        try:
            with _dist.using_group(self.group):
                view, moved = self._gather_files(nodes, name, digest, everyone, token)
            info = restorer.load(view, "full")
        except CheckpointError as exc:
            damaged = isinstance(exc, (CheckpointCorruptError, CheckpointNotFoundError))
            with _dist.using_group(self.group):
                if not all(_dist.all_gather_object(damaged)):
                    raise
            if _dist.rank() == 0:
                self.log.warning("Memory snapshot %s could not be restored (%s); falling back to %s", name, exc, then)
            return None
        finally:
            with _dist.using_group(self.group):
                _dist.barrier()
            if nodes.leader(_dist.rank()) == _dist.rank():
                remove_tree(self.node.view(token, name).parent)
        info.path, info.tier = self.node.root / name, "memory"
        if _dist.rank() == 0:
            self.log.info("Restored step %d from the memory tier (%.1f MB moved between nodes)", info.step, moved / 1e6)
        return info

    def _gather_files(self, nodes: Nodes, name: str, digest: str, everyone: list[dict[str, Held]],
                      token: str) -> tuple[Path, int]:
        """Collective: a view of snapshot ``name`` on every node holding the files its ranks will read."""
        rank, world = _dist.rank(), _dist.world_size()
        leader = nodes.leader(rank) == rank
        present: dict[str, set[str]] = {node: set() for node in nodes.order}
        holders: dict[str, list[int]] = {}
        manifest_at: tuple[int, int] | None = None
        for r, held in enumerate(everyone):
            h = held.get(name)
            if h is None or h.digest != digest:
                continue
            present[nodes.ids[r]] = set(h.files) | {MANIFEST_NAME}
            manifest_at = manifest_at or (r, h.extra["manifest_size"])
            for rel in [MANIFEST_NAME, *h.files]:
                holders.setdefault(rel, []).append(r)
        assert manifest_at is not None
        here = sorted(present[nodes.ids[rank]])

        def prepare() -> None:
            if not leader:
                return
            if here:
                self.node.make_view(token, name, here)
            else:
                self.node.view(token, name).mkdir(parents=True, mode=0o700)

        _dist.run_collectively("preparing the restore", prepare)
        view = self.node.view(token, name)
        sizes = {MANIFEST_NAME: (manifest_at[1], digest)}
        source = self.node.root / name
        moved = 0

        def move(needs: list[set[str]]) -> None:
            nonlocal moved
            moved += _bring(self.log, nodes, needs, present, holders, sizes, source, view)

        move([{MANIFEST_NAME}] * world)
        manifest = _dist.run_collectively("reading the snapshot's manifest", lambda: snapshot_manifest(Folder(view)))
        sizes.update({rel: (size, manifest.checksums.get(rel, "")) for rel, size in manifest.files.items()})
        move(_dist.all_gather_object(side_files(manifest, rank, world)))
        need = _dist.run_collectively("planning the restore", lambda: shard_files(Folder(view), manifest, self.tracked))
        move(_dist.all_gather_object(need))
        _dist.run_collectively("completing the restore view", lambda: stand_ins(view, manifest.files) if leader else 0)
        return view, moved

    # ---------------------------------------------------------------------------------------------- end
    def close(self, free: bool) -> None:
        """Wait for the snapshot in flight; with ``free``, remove this run's snapshots from this node (its leader does;
        no collective: a rank whose own write is done has passed every round of its node's ranks' writes). The
        background writer is closed: its group destroyed."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
        self.saver.close()  # the hook on the optimizer's step goes
        if not free or self.nodes is None:
            return
        if self.nodes.leader(_dist.rank()) == _dist.rank():
            self.node.free()
            self.log.info("Memory tier freed on this node (%s)", self.node.root)


def _durable_step(storage: Any, durable: Path | None) -> int | None:
    """The step of the durable checkpoint ``durable`` (one of ``storage``'s step directories)."""
    if durable is None:
        return None
    from ..engine.layout import step_manifest

    return step_manifest(storage.folder(durable.name)).step


def _say_placement(log: Any, root: Path, nodes: Nodes) -> None:
    """Rank 0, once: where the copies go, and (a warning) why they span fewer nodes or domains than asked."""
    p, count = nodes.placement, len(nodes.order)
    if count == 1:
        how = "one node: its folder holds every rank's part, nothing to replicate"
    elif p.copies == 1:
        how = "memory_replicas=1: each rank's part on its own node only, no copy elsewhere"
    else:
        how = (f"each rank's part on {p.copies} nodes of {p.spread} failure domain(s); copies of other nodes' "
               f"parts per node: {min(p.load())} to {max(p.load())}")
    log.info("Memory tier in %s on %d node(s) in %d failure domain(s) (%s)", root, count,
             len(set(nodes.domains)), how)
    if p.shortfall is not None:
        log.warning("Memory tier: %s", p.shortfall)


def _bring(log: Any, nodes: Nodes, needs: list[set[str]], present: dict[str, set[str]], holders: dict[str, list[int]],
           sizes: dict[str, tuple[int, str]], source: Path, view: Path) -> int:
    """Collective: bring every rank's ``needs`` into its node's ``view``, from the holders in turn: a node's own
    copy that fails its checksum, or a copy that arrives damaged, is taken from the part's next holder (when
    none is left, :func:`plan_moves` raises). Returns the bytes moved."""
    rank, moved = _dist.rank(), 0
    mine = {rel: sizes[rel] for rel in needs[rank] if rel in present[nodes.ids[rank]] and rel != MANIFEST_NAME}
    bad = _dist.all_gather_object(damaged_copies(view, mine))  # this node's own copies, checked first
    failed = [(Move(r, r, rel, *sizes[rel]), why) for r, found in enumerate(bad) for rel, why in found]
    while True:
        for m, why in failed:  # that holder's copy is damaged: the next holder is tried
            holders[m.rel] = [h for h in holders.get(m.rel, []) if nodes.ids[h] != nodes.ids[m.src]]
            present[nodes.ids[m.dst]].discard(m.rel)
            if rank == 0:
                log.warning("Memory tier: %s; trying another node that holds it", why)
        plan = plan_moves(nodes, needs, present, holders, sizes)
        if not plan:  # the same list on every rank: none of them sends or waits
            return moved
        moved += sum(m.size for m in plan)
        failed = []
        send_and_receive(plan, source, view, failed=failed)
        if not failed:
            return moved
