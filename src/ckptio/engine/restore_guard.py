"""A restore that fails changes nothing it can keep unchanged, and says what it did change.

The order of :meth:`~ckptio.engine.restoring.Restorer._restore_step` does most of it: every state the step must
provide is found and planned, the small states read and decoded, the optimizer's state read into new tensors
(the live optimizer untouched) and, with ``verify: full``, all of that checked against the manifest's checksums,
before anything is written into a live object. The model comes next: it is read into the live parameters (a copy
would double the model's memory), so from there a failure leaves it changed, and the error says so
(:func:`told`). What is applied last, after the model's own checksums, is what :class:`Kept` can put back:

* the optimizer: its ``state`` and ``param_groups`` are kept by reference (``load_state_dict`` replaces them with
  new objects, so keeping them costs nothing but holding the old tensors until the end, as the load already does);
* the small states (scheduler, data position, counters, RNG, user objects): a deep copy of each one's
  ``state_dict()``, loaded back on failure.

The small states themselves are found in the manifest, read and decoded before anything is applied
(:func:`read_objects`), and applied last (:func:`apply_state`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _dist
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..formats import pt as pt_format
from ..formats import registry
from ..state import hyper
from ..storage.confined import Folder
from ..storage.verify import Verifier, finishers
from .manifest import Manifest, StateEntry

__all__ = ["Apply", "Kept", "apply_checked", "apply_state", "check_model_first", "entry_of", "failed", "groups_apply", "read_objects", "told",
           "verify_read"]


class Kept:
    """What a restore replaces, kept so that a failed apply puts it back (see the module docstring): the optimizer's
    ``state`` and ``param_groups`` from the start (by reference: torch's ``load_state_dict`` replaces them, and
    torch's own load path may fill an empty state first), each small state just before it is applied."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.plain = isinstance(optimizer, torch.optim.Optimizer)
        if self.plain:
            self.state, self.items = optimizer.state, dict(optimizer.state)
            self.groups = [(g, dict(g)) for g in optimizer.param_groups]
            self.group_list = optimizer.param_groups
        self.objects: dict[str, tuple[Any, Any]] = {}
        self.lost: list[str] = []
        """What was applied and cannot be put back (an optimizer of another kind, a state that cannot be copied)."""

    def applying_optimizer(self) -> None:
        """The optimizer is about to take the restored state."""
        if not self.plain:
            self.lost.append("the optimizer")

    def keep(self, name: str, obj: Any) -> None:
        """Small state ``name`` (``obj``) is about to be applied: keep a copy of what it holds now."""
        try:
            self.objects[name] = (obj, copy.deepcopy(obj.state_dict()))
        except Exception:  # noqa: BLE001 - a state that cannot be copied: said in the error if the restore fails
            self.lost.append(repr(name))

    def undo(self) -> list[str]:
        """Put back what was kept; returns what is changed and could not be put back."""
        lost = list(self.lost)
        if self.plain:
            self.state.clear()  # the very objects, with what they held
            self.state.update(self.items)
            self.optimizer.state = self.state
            for group, saved in self.groups:
                group.clear()
                group.update(saved)
            self.group_list[:] = [g for g, _ in self.groups]
            self.optimizer.param_groups = self.group_list
        for name, (obj, saved) in self.objects.items():
            try:
                obj.load_state_dict(saved)
            except Exception:  # noqa: BLE001 - it stays as the failed apply left it, and the error says so
                lost.append(repr(name))
        return lost


def told(exc: CheckpointError, changed: list[str]) -> CheckpointError:
    """``exc`` (its class, so that a fallback still sees damage) with what the failed restore changed appended."""
    if not changed or getattr(exc, "changed", None) == changed:
        return exc
    message = f"{exc}. By this failed restore, {'; '.join(changed)}; every other live object is as it was"
    try:
        new = type(exc)(message)
    except TypeError:  # an error class with other arguments: the plain one
        new = CheckpointError(message)
    new.changed = list(changed)  # type: ignore[attr-defined]
    new.__cause__ = exc
    return new


def verify_read(verifier: Verifier, done: set[str], keep: Callable[[str], bool],
                also: Callable[[], Any] | None = None) -> None:
    """Collective, two rounds: complete and compare the checksums of the files read so far that ``keep`` selects
    and are not ``done`` (each file by the rank that hashed most of it: its rest is read once), then add them to
    ``done``. ``also`` runs on every rank in the second round once its own files matched (what is applied when
    they all did; a failure anywhere raises on every rank, and the caller puts back what ``also`` replaced)."""
    _, hashed = _dist.agree("sharing what was checksummed", lambda: None,
                            share=lambda _: {rel: runs for rel, runs in verifier.runs().items()
                                             if rel not in done and keep(rel)})
    mine = {rel: [run for runs in hashed for run in runs.get(rel, ())] for rel in finishers(hashed)[_dist.rank()]}

    def finish() -> None:
        found = verifier.finish(mine)
        if found:
            raise CheckpointCorruptError(f"{len(found)} file(s) do not match their checksums: " + "; ".join(found[:3]))
        if also is not None:
            also()

    try:
        _dist.run_collectively("verifying checksums", finish)
    finally:
        done.update(rel for runs in hashed for rel in runs)


def check_model_first(storage: Any, name: str, asked: bool) -> None:
    """Collective, one round when ``asked`` (an automatic resume with ``start_fresh_if_damaged``): the checksums of
    the model's files of step ``name``, before anything is read into the live objects (the files split between
    the ranks; the model is read in place, so a failure later would leave it changed). A damaged step then
    leaves the model as it was, so that when no step is left the run starts fresh from the model it built, not from
    one half read. Damage raises :class:`CheckpointCorruptError` on every rank (the restore falls back)."""
    from .layout import step_manifest

    if not asked:
        return

    def check() -> None:
        folder = storage.folder(name)
        manifest = step_manifest(folder)
        entry = manifest.states.get("model")
        if entry is None or manifest.foreign is not None:
            return  # nothing read in place, or no checksums to check (an adopted step)
        prefix = entry.path.rstrip("/") + "/"
        files = sorted(rel for rel in manifest.files if rel.startswith(prefix) and rel in manifest.checksums)
        found = Verifier(folder, manifest.checksums).finish(files[_dist.rank()::_dist.world_size()])
        if found:
            raise CheckpointCorruptError(f"{len(found)} file(s) do not match their checksums: " + "; ".join(found[:3])
                                         + " (checked before the model is read, as start_fresh_if_damaged asks)")

    _dist.run_collectively("checking the model's files before reading them into it", check)


def failed(exc: BaseException, kept: Kept, changes: dict[str, str], step_dir: Path) -> BaseException:
    """After a failed restore of ``step_dir``: put back what ``kept`` holds; returns ``exc``, or the same error saying
    what the restore's attempts changed (``changes``, which gets what could not be put back)."""
    changes.pop("objects", None)
    lost = kept.undo()  # the model stays as the failed read left it: ``changes`` says so
    if lost:
        changes["objects"] = f"{', '.join(lost)} took the state of {step_dir} and could not be put back"
    if not isinstance(exc, CheckpointError) or not changes:
        return exc
    return told(exc, list(changes.values()))


def apply_checked(objects: dict[str, Any], step: Folder, opened: Any, apply_optimizer: Any, done: set[str],
                  kept: Kept) -> None:
    """Collective: the checksums of the files not checked yet (``opened.verifier``: :func:`verify_read`), then,
    once every rank's matched, hand the optimizer and every registered object (``objects``) what was read for them.
    A failure on any rank raises on every rank, each putting back what it applied (``kept``, by the caller)."""

    def apply() -> None:
        if apply_optimizer is not None:
            kept.applying_optimizer()
            apply_optimizer()
        for name, (rel, value) in opened.objects.items():
            kept.keep(name, objects[name])
            apply_state(objects[name], value, step.display(rel))

    if opened.verifier is not None:
        verify_read(opened.verifier, done, lambda rel: True, also=apply)
    elif apply_optimizer is not None or objects:
        _dist.run_collectively("applying the loaded state", apply)


def groups_apply(optim_state: Any, groups: list[dict[str, Any]] | None, step_dir: Path, log: Any) -> Any:
    """What restores the hyper-parameters of a step whose optimizer moments were pruned (``None``: no such step)."""
    if groups is None or optim_state is None:
        return None
    if _dist.rank() == 0:
        log.info("%s: its optimizer's moments were pruned (keep_optimizer_latest): each parameter group's "
                 "hyper-parameters (lr, ...) are restored and the moments start from zero", step_dir)
    return lambda: optim_state.apply_groups(groups)


def entry_of(step_dir: Path, manifest: Manifest, key: str) -> StateEntry:
    """The manifest's entry of state ``key``; an error saying why when the step has none (or it was pruned)."""
    entry = manifest.states.get(key)
    if entry is None and key in manifest.pruned:
        from .prune_optim import pruned_message

        raise CheckpointMismatchError(pruned_message(step_dir, manifest, key))
    if entry is None:
        raise CheckpointMismatchError(f"{step_dir} holds no {key!r} state (it has {sorted(manifest.states)}); "
                                      f"it was saved without one, so it cannot restore this run's {key}")
    return entry


def read_objects(restorer: Any, step: Folder, manifest: Manifest) -> dict[str, tuple[str, Any]]:
    """The saved state of every registered object on this rank, read and decoded but not yet applied."""
    rank, world = _dist.rank(), _dist.world_size()
    out: dict[str, tuple[str, Any]] = {}
    for name in restorer.tracked.objects:
        if not restorer.options.wants(name):
            continue
        entry = manifest.states.get(name)
        if entry is None and name in manifest.pruned:
            entry_of(step.path, manifest, name)  # raises: pruned from the checkpoint
        if entry is None:
            if rank == 0:
                restorer.log.warning("%s has no %r state; %s keeps its current state", step.path, name, name)
            continue
        rel: str | None = entry.path
        if entry.per_rank and entry.identical:  # the same state on every rank: any copy will do
            rel = entry.file_of(min(rank, manifest.world_size - 1))
        elif entry.per_rank:
            rel = entry.file_of(rank)
            if manifest.world_size != world:
                if rank == 0:
                    lo, hi = sorted((world, manifest.world_size))
                    who, own = (f"rank {lo}", "keeps its") if hi - lo == 1 else (f"ranks {lo}-{hi - 1}", "keep their")
                    rest = f"{who} {own} own" if world > lo else f"the states of {who} are not used"
                    restorer.log.warning("%s: %r was saved per rank on %d rank(s) and is restored on %d; each rank "
                                     "takes the state saved by the same rank number, %s",
                                     step.path, name, manifest.world_size, world, rest)
                if rank >= manifest.world_size:
                    rel = None
        if rel is not None:
            out[name] = (rel, read_small(step, rel, entry))
    return out


def read_small(step: Folder, rel: str, entry: StateEntry) -> Any:
    """A small state: its own ``.pt`` file, or a value kept inside another state's folder (``entry.key``)."""
    if entry.key is not None:
        return registry.get(entry.format).read_value(step.sub(rel), entry.key)
    return pt_format.load_from(step, rel)


class Apply:
    """``load_state_dict`` for a template filled on the fast path (see :class:`~ckptio.state.OptimizerState`)."""

    def __init__(self, optim_state: Any) -> None:
        self.optim_state = optim_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim_state.apply(state["optim"])


def apply_state(obj: Any, state: Any, source: Path) -> None:
    """``obj.load_state_dict(state)``; a state that does not fit (a damaged or foreign file) is an error naming it."""
    hyper.check(obj, state, source)  # a scheduler's or the optimizer's hyper-parameters, before they are applied
    try:
        obj.load_state_dict(state)
    except CheckpointError:
        raise
    except Exception as exc:  # the file decoded but holds something this object cannot take
        raise CheckpointCorruptError(f"{source}: the saved state does not fit {type(obj).__name__}.load_state_dict "
                                     f"({type(exc).__name__}: {exc})") from exc
