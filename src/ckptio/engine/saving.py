"""The save path, top to bottom: what a :meth:`CheckpointManager.save` does, in order.

1. **Snapshot** (training thread, collective): name the step directory from the training position; take
   the state dicts of the model, the optimizer and every registered object; with a background save,
   copy every tensor into reused staging buffers (:class:`~ckptio.engine.staging.Stager`) so training may go on.
2. **Begin** (rank 0): take the folder's lock, sweep leftovers of interrupted saves once per run, and
   begin the step directory through the storage (a hidden temporary folder locally); every other rank
   attaches to it.
3. **Write** (every rank, its own bytes): the model through its format in the registry (per-rank
   safetensors shards, DCP, or a PEFT adapter), its config and tokenizer, the consolidated Hugging Face
   bundle when asked, the optimizer (DCP), then each small state (once when every rank's is the same,
   else one file per rank). Every file is checksummed as it is written.
4. **Commit** (rank 0, after every rank's checksums are gathered): the manifest, written last, makes the
   step visible at once (rename locally); then ``LATEST``, ``BEST`` and retention.

Any ordinary error removes the partial step and is raised on every rank (per-rank failures are gathered,
so no rank hangs in a collective). Steps 2–4 are the same code for a synchronous save (on the training
thread) and a background save (on the writer thread, over its own process group).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _dist, _faults
from ..errors import CheckpointError
from . import policies
from ..config import CheckpointConfig
from ..formats import pt as pt_format
from ..formats import registry
from ..formats.safetensors.hf_bundle import consolidate, save_hf_extras
from ..formats.registry import ShardContext
from .layout import CONSOLIDATED_DIR, LATEST, MODEL_DIR, OPTIM_DIR, format_step_name
from .manifest import MANIFEST_NAME, Manifest, StateEntry, merge_shapes, model_signature, software_versions
from .sharing import Previous, Sharer, frozen_keys, max_holders, previous_of
from .staging import Stager, changed_by_step, finishing
from ..state.kept import KeptStateDicts
from ..state.optimizer import model_and_optimizer_state
from ..storage.base import FolderWriter, Storage

__all__ = ["SaveJob", "Saver", "Tracked"]


@dataclass
class Tracked:
    """What a manager checkpoints: the live objects and their state wrappers."""

    model: Any = None
    model_state: Any = None
    optim_state: Any = None
    objects: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    base_model_path: Any = None
    kept: KeptStateDicts = field(default_factory=KeptStateDicts)
    """torch's state dicts of the last save (any saver's), used again while the model and optimizer are unchanged;
    cleared by a restore, which replaces the optimizer's state."""


@dataclass
class SaveJob:
    """One save between its snapshot (training thread) and its commit (possibly a background thread)."""

    step: int
    epoch: int
    name: str
    metrics: dict[str, float]
    counters: dict[str, Any]
    root: Path
    start: float
    consolidate: bool
    extras: bool = True
    """Write the model's config and tokenizer beside a full model (a memory snapshot does not need them)."""
    signature: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] | None = None
    optim: dict[str, Any] | None = None
    objects: dict[str, bytes] = field(default_factory=dict)
    sums: dict[str, str] = field(default_factory=dict)
    called: float | None = None
    """When ``save()`` was called (``perf_counter``; before it waited for the previous save)."""
    apart: frozenset[str] = frozenset()
    """Model keys grouped into files of their own, shared with the newest checkpoint when unchanged (see
    :mod:`ckptio.engine.sharing`)."""
    apart_anywhere: bool = False
    """Whether some rank groups keys apart (set by :meth:`Saver.settle`): only then is what the newest checkpoint offers
    to share read."""
    contents: dict[str, str] = field(default_factory=dict)
    """Every rank's shareable files -> their digests (gathered before the commit)."""
    linked: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Every rank's shared files -> (where their bytes are, size) (gathered before the commit)."""
    error: Exception | None = None
    """What went wrong in the snapshot on this rank (raised on every rank by :meth:`Saver.settle`)."""
    identical: dict[str, bool] = field(default_factory=dict)
    """Each small state: whether every rank's bytes are the same (learnt in :meth:`Saver.settle`'s round)."""
    later: Exception | None = None
    """What went wrong in a write whose failure waits for the round of the checksums (rank 0's config files, the
    small states): raised there on every rank, before anything is committed."""
    staged_later: bool = False
    """Copies the snapshot left to the writer's thread (or to the optimizer's next step, whichever comes first)."""
    blocked_s: float | None = None
    """How long ``save()`` held the training loop (set before a background write starts; ``None``: the whole save)."""

    @property
    def final_dir(self) -> Path:
        return self.root / self.name


_REGISTRY_NAMES = {"safetensors": "safetensors", "torch_save": "dcp"}


def model_format(config: CheckpointConfig) -> str:
    """The registry name of the format the model is saved in."""
    if config.is_peft:
        return "peft"
    return _REGISTRY_NAMES[config.model_save_format]


def optimizer_format(config: CheckpointConfig) -> str:
    """The registry name of the format the optimizer state is saved in (DCP unless safetensors is asked for)."""
    return _REGISTRY_NAMES[config.optimizer_save_format or "torch_save"]


PER_RANK_FILES = {"rng": "rng_global_rank_{rank}.pt", "dataloader": "dataloader_dp_rank_{rank}.pt"}
"""Small states always saved per rank, under the names NeMo AutoModel gives them (its recipe loads its RNG from
``rng/rng_global_rank_R.pt`` and its dataloader from ``dataloader/dataloader_dp_rank_R.pt``)."""


def small_state_entry(name: str, identical: bool) -> StateEntry:
    """Where the small state ``name`` goes: ``<name>.pt`` once when every rank's bytes are the same, else one file
    per rank, ``<name>/<name>_global_rank_R.pt`` (AutoModel's layout); ``rng`` and ``dataloader`` always per rank."""
    if name in PER_RANK_FILES:
        return StateEntry("object", "pt", name, per_rank=True, rank_file=PER_RANK_FILES[name], identical=identical)
    if identical:
        return StateEntry("object", "pt", f"{name}.pt")
    return StateEntry("object", "pt", name, per_rank=True, rank_file=f"{name}_global_rank_{{rank}}.pt")


def write_small_states(job: SaveJob, writer: FolderWriter, rank: int) -> dict[str, StateEntry]:
    """Write this rank's files of the small states (no round: a failure is left in :attr:`SaveJob.later`)."""
    entries = {name: small_state_entry(name, job.identical[name]) for name in job.objects}

    def write() -> None:
        for name, data in job.objects.items():
            entry = entries[name]
            if entry.per_rank or rank == 0:
                rel = entry.file_of(rank) if entry.per_rank else entry.path
                job.sums[rel] = writer.write_bytes(rel, data)

    if job.objects:
        job.later = job.later or _dist.attempt(write)
    return entries


class Saver:
    """Runs saves for one manager. Not thread-safe: one save at a time (the manager waits first)."""

    def __init__(self, config: CheckpointConfig, tracked: Tracked, storage: Storage, lock: Any,
                 log: Any) -> None:
        self.config, self.tracked, self.storage, self.lock, self.log = config, tracked, storage, lock, log
        self.stager = Stager()
        self.format = registry.get(model_format(config))
        self.protected: set[str] = set()
        """Step names retention must keep whatever the rules say (the one this run resumed from)."""
        self._swept = False
        self.what = "checkpoint"
        """What the log calls a save of this saver's."""
        self.share = config.share_unchanged
        """Share the model's unchanged frozen files with the newest checkpoint (:mod:`ckptio.engine.sharing`)."""
        self.whole_apart = False
        """Sharded safetensors: whole tensors in files of their own (the memory tier: a rank's restore then needs
        its own shard files and those small ones, not another rank's shards)."""
        self.last_saved: Path | None = None
        self.last_step: int | None = None
        """The step of :attr:`last_saved` (set once it is committed, possibly by the background writer)."""
        self.defer_staging = config.async_save and not config.wait_for_staging
        """A background save leaves the parameters' and optimizer state's copies to the writer's thread (the
        optimizer's step waits for them)."""
        self._step_hook: Any = None
        self.on_commit: Any = None
        """Rank 0, called with the job and its files (relative path -> bytes) once it is committed (the run's
        record)."""

    # ---------------------------------------------------------------------------------------------- 1
    def snapshot(self, step: int, epoch: int, metrics: dict[str, float], counters: dict[str, Any], final: bool,
                 *, stage: bool) -> SaveJob:
        """Training thread, collective: name the checkpoint and capture the state (nothing touches the disk).

        With ``stage`` the tensors are copied into the staging buffers; otherwise the job references the
        live tensors and must be persisted before training goes on.
        """
        name = format_step_name(self.config.name_template, step=step, epoch=epoch, metrics=metrics, counters=counters,
                                insert_field_names=self.config.auto_insert_field_names)
        start = time.perf_counter()
        job = SaveJob(step=step, epoch=epoch, name=name, metrics=metrics, counters=counters,
                      root=self.storage.root, start=start,
                      consolidate=self.config.save_consolidated is True or (self.config.save_consolidated == "final"
                                                                           and final))
        t = self.tracked
        live: dict[str, Any] = {}
        optim_sd = None
        if t.model_state is not None:
            if t.optim_state is not None:
                model_sd, optim_sd = model_and_optimizer_state(t.model_state, t.optim_state, t.kept)
            else:
                model_sd = t.model_state.state_dict()
            job.signature = model_signature(t.model, model_sd)  # this rank's: joined in the write's first round
            if self.share and self.format.groups_apart:
                job.apart = frozen_keys(t.model_state, model_sd)
            live["model"] = self.format.snapshot(model_sd, t.model)  # collective for formats that gather
            del model_sd
        if t.optim_state is not None:
            live["optim"] = optim_sd if optim_sd is not None else t.optim_state.state_dict()
            del optim_sd
            scheduler = t.objects.get("lr_scheduler")
            if scheduler is not None and registry.get(optimizer_format(self.config)).any_values:
                # AutoModel keeps the scheduler beside the optimizer ("sched" in optim/); so does ckptio, so that
                # AutoModel's load_optimizer(optimizer, model, path, scheduler) finds it
                live["optim"]["sched"] = scheduler.state_dict()
        if stage:
            # only what the tracked optimizer's step changes waits for it: without one (or for parameters another
            # optimizer trains) nothing would make that step wait, so those are copied here
            optimizer = getattr(t.optim_state, "optimizer", None) if self.defer_staging else None
            if optimizer is not None and self._step_hook is None:
                self._step_hook = optimizer.register_step_pre_hook(finishing(self.stager))
            live = self.stager.stage(live, *changed_by_step(optimizer))
            job.staged_later = self.stager.pending
        job.model, job.optim = live.get("model"), live.get("optim")
        del live
        try:  # an error is told to every rank in the write's first round (settle): no round in the pause
            job.objects = {key: pt_format.to_bytes(obj.state_dict(), key) for key, obj in t.objects.items()}
        except Exception as exc:  # noqa: BLE001 - raised on every rank by settle()
            job.error = exc
        if stage and _dist.rank() == 0:
            self.log.info("Staged %s %s in %.2f s (%.1f MB of staging buffers%s); writing it in the background",
                          self.what, name, time.perf_counter() - start, self.stager.nbytes / 1e6,
                          ", most copied there in the background" if job.staged_later else "")
        return job

    def close(self) -> None:
        """Make any deferred staging copy and remove the hook on the optimizer's step."""
        self.stager.finish()
        hook, self._step_hook = self._step_hook, None
        if hook is not None:
            hook.remove()

    def settle(self, job: SaveJob) -> None:
        """Collective, the first round of a write (so that the snapshot, in the pause, has none): an error the
        snapshot met on any rank is raised on every rank, and the model's signature becomes every rank's union
        (pipeline stages hold different tensors); every rank learns whether any rank has files to share
        (:attr:`SaveJob.apart_anywhere`) and which small states are the same on every rank (:attr:`SaveJob.identical`). The staging copies the snapshot left to this thread are made first."""
        if job.staged_later:
            _faults.point("save.staging_copies")
            self.stager.finish()  # or wait while the optimizer's step makes them
            job.error = job.error or self.stager.failure

        def check() -> None:
            if job.error is not None:
                raise job.error

        signature = job.signature
        mine = (signature.get("shapes"), signature.get("dtypes")) if signature else None
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in job.objects.items()}
        _, parts = _dist.agree("serialising the registered states", check,
                               share=lambda _: (mine, bool(job.apart), digests))
        job.apart_anywhere = any(apart for _, apart, _ in parts)
        job.identical = {name: len({theirs.get(name) for _, _, theirs in parts}) == 1 for name in digests}
        shapes = [part for part, _, _ in parts if part is not None]
        if signature and len(parts) > 1:
            signature["shapes"] = merge_shapes([part[0] for part in shapes])
            signature["dtypes"] = {k: v for part in shapes for k, v in part[1].items()}

    # ---------------------------------------------------------------------------------------------- 2-4
    def persist(self, job: SaveJob) -> None:
        """Collective (on the current group): write the job's files, then commit them on rank 0."""
        rank, world = _dist.rank(), _dist.world_size()
        self.settle(job)
        if rank == 0:
            self.log.info("Saving checkpoint to %s", job.final_dir)
        # one broadcast: rank 0 began the step, or every rank raises its error
        begun = _dist.decide_on_rank0("preparing the checkpoint", lambda: self._begin(job))
        assert begun is not None  # rank 0 always names the folder
        token, previous = begun
        writer = self.storage.attach_step(token, job.name)
        try:
            # a bundle consolidated in a bucket during the save reads the model as uploaded: no references then
            own = job.consolidate and getattr(self.storage, "refers", False)
            sharer = (Sharer(writer, None if own else previous, self.storage, max_holders(self.config), self.log)
                      if job.apart else None)
            states = self.write_states(job, writer, rank, world, sharer, later=True)
            _faults.point("save.states_written")
            sums: dict[str, str] = {}
            made = getattr(writer, "written", None)  # what this rank's writer made, where it can say (a bucket's)
            share = lambda _: (job.sums, *((sharer.contents, sharer.linked) if sharer else ({}, {})),  # noqa: E731
                               made() if made is not None else None)
            _, parts = _dist.agree(f"writing {job.final_dir}", lambda: _dist.raise_if(job.later), share=share)
            for part, contents, linked, _ in parts:
                sums.update(part)
                job.contents.update(contents)
                job.linked.update(linked)
            reports = [report for *_, report in parts]
            commit = lambda: self._commit(job, writer, states, sums, world, reports) if rank == 0 else None  # noqa: E731
            _dist.run_collectively(f"committing {job.final_dir}", commit)  # rank 0's error; the others' name it
        except Exception:
            # An ordinary error removes the partial save; a BaseException (KeyboardInterrupt) leaves it to the sweep
            if rank == 0:
                writer.abort()
            raise
        self.last_saved, self.last_step = job.final_dir, job.step
        if rank == 0:
            self.log.info("Saved checkpoint %s in %.2f s", job.final_dir, time.perf_counter() - job.start)

    def _begin(self, job: SaveJob) -> tuple[str, Previous | None] | None:
        if _dist.rank() != 0:
            return None
        self.lock.acquire()
        # nothing to share without frozen tensors on some rank (another may hold them: a pipeline's stages)
        wanted = self.share and job.model is not None and job.apart_anywhere
        token, previous = _swept_then_begun(self.storage, self.log, not self._swept, wanted, job.name)
        self._swept = True
        return token, previous

    def write_states(self, job: SaveJob, writer: FolderWriter, rank: int, world: int,
                     sharer: Sharer | None = None, *, later: bool = False) -> dict[str, StateEntry]:
        """Collective: write this rank's files of every state into ``writer``; returns the manifest's states.
        With ``later``, a failure writing rank 0's config files or a small state is left in :attr:`SaveJob.later` for
        the caller's next round to raise on every rank (each is a round less); else this raises it on every rank."""
        t = self.tracked
        states: dict[str, StateEntry] = {}
        if job.model is not None:
            ctx = ShardContext(rank=rank, world_size=world, threads=self.config.io_thread_count(),
                               extra={"model": t.model, "tokenizer": t.tokenizer, "base_model_path": t.base_model_path,
                                      "log": self.log.warning, "whole_apart": self.whole_apart,
                                      "apart": job.apart, "share": sharer})
            job.sums.update(self.format.save_shards(job.model, writer, MODEL_DIR, ctx))
            states["model"] = StateEntry("model", self.format.name, MODEL_DIR)
            if self.format.full_model and job.extras:
                extras = lambda: save_hf_extras(t.model, writer.local_path(MODEL_DIR), t.tokenizer) if rank == 0 else None
                if job.consolidate or not later:  # the consolidation reads them: their failure is known first
                    _dist.run_collectively("writing the model config and tokenizer", extras)
                    if job.consolidate:
                        self._consolidate(job, writer, rank, world)
                else:
                    job.later = _dist.attempt(extras)
        job.model = None
        if job.optim is not None:
            fmt = registry.get(optimizer_format(self.config))
            ctx = ShardContext(rank, world, self.config.io_thread_count(), {"stem": "optim", "whole_apart": self.whole_apart})
            job.sums.update(fmt.save_state(job.optim, writer, OPTIM_DIR, ctx))
            states["optim"] = StateEntry("optimizer", fmt.name, OPTIM_DIR)
            job.optim = None
        states.update(write_small_states(job, writer, rank))
        if job.objects and not later:  # (the same states are registered on every rank)
            _dist.run_collectively("writing the registered states", lambda: _dist.raise_if(job.later))
        return states

    def _consolidate(self, job: SaveJob, writer: FolderWriter, rank: int, world: int) -> None:
        rel = f"{MODEL_DIR}/{CONSOLIDATED_DIR}"
        start = time.perf_counter()
        # every rank reads the model as written so far (on S3: rank 0 publishes the config and tokenizer first)
        source = _dist.run_collectively("publishing the model's side files", lambda: writer.reader(MODEL_DIR))
        plan, written = _dist.run_collectively(
            f"consolidating {job.final_dir / rel}",
            lambda: consolidate(source, writer, rel,
                                max_shard_size=self.config.consolidated_max_shard_size, rank=rank, world_size=world),
        )
        job.sums.update(written)
        if rank == 0:
            self.log.info("Consolidated %d tensors (%.1f MB) into %d file(s) under %s in %.2f s",
                          len(plan.infos), plan.total_size / 1e6, len(plan.files), job.final_dir / rel,
                          time.perf_counter() - start)

    def _commit(self, job: SaveJob, writer: FolderWriter, states: dict[str, StateEntry], sums: dict[str, str],
                world: int, reports: list[Any]) -> None:
        """Rank 0: the manifest last (the commit point), then the pointers and retention."""
        files = step_files(writer, reports, sums)
        files.update({rel: size for rel, (_, size) in job.linked.items()})  # a reference is no object of this step
        if job.linked:
            self.log.info("Shared %d unchanged file(s) (%.1f MB) with %s instead of writing them", len(job.linked),
                          sum(size for _, size in job.linked.values()) / 1e6,
                          ", ".join(sorted({src.split("/")[0] for src, _ in job.linked.values()})))
        manifest = self.manifest_of(job, states, files, sums, world)
        writer.commit((MANIFEST_NAME, manifest.to_json().encode()))
        _faults.point("commit.before_pointer")
        self.storage.write_pointer(LATEST, job.name)
        _faults.point("commit.before_retention")
        removed = policies.after_commit(self.storage, self.config.retention_policy(), protected=self.protected,
                                        written=job.name)
        for path in removed:
            self.log.info("Removed checkpoint %s (retention)", path)
        if self.on_commit is not None:
            self.on_commit(job, files, removed)

    def manifest_of(self, job: SaveJob, states: dict[str, StateEntry], files: dict[str, int], sums: dict[str, str],
                    world: int) -> Manifest:
        """The manifest of ``job``: its ``files`` (relative path -> size) with their checksums ``sums``."""
        return Manifest(
            name=job.name, step=job.step, epoch=job.epoch, world_size=world,
            model_save_format=self.config.model_save_format, states=states,
            files=files, metrics=job.metrics, counters=job.counters, checksums=sums,
            model_signature=job.signature, is_peft=self.config.is_peft, versions=software_versions(),
            contents={rel: d for rel, d in job.contents.items() if rel in files},
            shared={rel: src for rel, (src, _) in job.linked.items() if getattr(self.storage, "refers", False)},
        )


def step_files(writer: FolderWriter, reports: list[dict[str, tuple[int, str]] | None],
               sums: dict[str, str]) -> dict[str, int]:
    """Rank 0: every file of the step (relative path -> size), every one's checksum in ``sums``. From the ranks'
    ``reports`` (each rank's writer's :meth:`~ckptio.storage.objstore.writer.ObjectFolderWriter.written`: every
    object it made, as the store confirmed it) where every rank has one: no listing of the step (a bucket's: ~4 ms
    of rank 0's CPU every save). Else (a local disk, whose files libraries also write) the writer lists what is
    there, and the files the ranks' streams did not sum (written by libraries) are summed by rank 0's writer."""
    if any(report is None for report in reports):
        files = writer.files()
        for rel in files:
            if rel not in sums:
                sums[rel] = writer.checksum_of(rel)
        return files
    made: dict[str, tuple[int, str, int]] = {}
    for rank, report in enumerate(reports):
        assert report is not None
        for rel, (size, digest) in report.items():
            other = made.setdefault(rel, (size, digest, rank))
            if other[:2] != (size, digest):
                raise CheckpointError(f"{writer.name}/{rel}: written by ranks {other[2]} and {rank} with different bytes "
                                      f"({other[0]} bytes, {other[1]}; {size} bytes, {digest})")
            if sums.setdefault(rel, digest) != digest:
                raise CheckpointError(f"{writer.name}/{rel}: its writer made it with checksum {digest}, rank {rank} "
                                      f"reported {sums[rel]}")
    return {rel: size for rel, (size, _, _) in made.items()}


def _swept_then_begun(storage: Storage, log: Any, sweep: bool, wanted: bool, name: str) -> tuple[str, Previous | None]:
    """The start of a save on rank 0: the leftovers of interrupted saves removed (``sweep``: the manager's first
    save), what ``LATEST`` offers to share when ``wanted``, then the step ``name`` begun (its token); one listing of the
    folder (a bucket's) serves all three, and the manifests read before are not fetched again while unchanged
    (:mod:`ckptio.storage.objstore.scanning`: what ``LATEST`` offers is read of every committed step)."""
    with getattr(storage, "scanning", storage.session)():
        if sweep:
            for leftover in storage.sweep():
                log.info("Removed leftover of an interrupted save: %s", leftover)
        previous = previous_of(storage, log) if wanted else None
        return storage.begin_step(name).token, previous
