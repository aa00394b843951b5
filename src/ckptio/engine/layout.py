"""Step directory names, pointers, and discovery of committed checkpoints.

Discovery trusts only manifests: a directory is a checkpoint when its name is not a temporary one and
it holds a valid manifest whose files are all present with the recorded sizes. Order is by the step
recorded in the manifest, never by modification time.
"""

from __future__ import annotations

import logging
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, NoUsableCheckpointError
from ..adopt.automodel import adopt, ckptio_mark
from .manifest import MANIFEST_NAME, PENDING_NAME, Manifest, check_files, read_manifest
from ..storage import POINTER_NAMES, as_storage, open_storage  # noqa: F401  (POINTER_NAMES: re-exported)
from ..storage.base import Storage
from ..storage.local import TMP_PREFIX, TRASH_PREFIX  # noqa: F401  (TRASH_PREFIX: re-exported)

log = logging.getLogger("ckptio")

MODEL_DIR = "model"
OPTIM_DIR = "optim"
CONSOLIDATED_DIR = "consolidated"
LATEST = "LATEST"
BEST = "BEST"


def expand_template(template: str, insert_field_names: bool = True) -> str:
    """Insert ``name=`` before each field whose name the preceding text does not already give.

    ``megatron_gpt--{val_loss:.3f}-{step}`` -> ``megatron_gpt--val_loss={val_loss:.3f}-step={step}``;
    ``epoch_{epoch}_step_{step}`` is left alone.
    """
    if not insert_field_names:
        return template
    out = ""
    for literal, field_name, spec, conv in string.Formatter().parse(template):
        out += literal.replace("{", "{{").replace("}", "}}")
        if field_name is None:
            continue
        head = literal[:-1] if literal[-1:] in "_=-:." else literal
        if not (out.endswith(field_name) or head.endswith(field_name)):
            out += f"{field_name}="
        out += "{" + field_name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
    return out


def format_step_name(template: str, *, step: int, epoch: int, metrics: dict[str, float] | None = None,
                     counters: dict[str, Any] | None = None, insert_field_names: bool = False) -> str:
    """Fill ``template`` with the training position; a field that is not known raises a clear error."""
    template = expand_template(template, insert_field_names)
    values: dict[str, Any] = {**(counters or {}), **(metrics or {}), "step": step, "epoch": epoch}
    try:
        name = template.format(**values)
    except KeyError as exc:
        raise CheckpointError(
            f"name_template {template!r} uses field {exc.args[0]!r}, which this save did not provide; "
            f"known fields: {sorted(values)}"
        ) from exc
    if not name or "/" in name or name.startswith(".") or name in POINTER_NAMES:
        raise CheckpointError(f"name_template {template!r} gave an unusable directory name {name!r}")
    return name


def parse_step_name(template: str, name: str, insert_field_names: bool = False) -> dict[str, Any] | None:
    """Recover the fields of ``template`` from a directory ``name`` (ints and floats where they parse).

    ``None`` when the name does not match. The manifest is the source of truth; this serves names of
    directories without one, and tools that read names only.
    """
    template = expand_template(template, insert_field_names)
    pattern = ""
    seen: set[str] = set()
    for literal, field_name, _spec, _conv in string.Formatter().parse(template):
        pattern += re.escape(literal)
        if field_name is None:
            continue
        if field_name in seen:
            pattern += f"(?P={field_name})"
        else:
            seen.add(field_name)
            pattern += f"(?P<{field_name}>[^/]+?)"
    match = re.fullmatch(pattern, name)
    return {k: _number(v) for k, v in match.groupdict().items()} if match else None


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@dataclass
class CheckpointEntry:
    """A directory found in a checkpoint folder."""

    name: str
    path: Path
    manifest: Manifest | None
    problem: str | None = None
    """Why this directory is not usable (``None`` for a complete checkpoint)."""
    candidate: bool = True
    """Whether the directory looks like a step directory (a manifest, or a ``model/`` or ``optim/`` folder): an
    unusable one is damage to report, not an unrelated folder (logs, a temporary of a save in flight)."""

    held_for: tuple[str, ...] = ()
    """A step retention removed whose files committed steps still use (a bucket's references): those steps' names."""

    @property
    def committed(self) -> bool:
        return self.manifest is not None and self.problem is None

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest else None

    @property
    def adopted(self) -> bool:
        """A step directory another tool wrote (NeMo AutoModel's): loaded as it is, never deleted by retention."""
        return self.manifest is not None and self.manifest.foreign is not None


def step_manifest(folder: Any) -> Manifest:
    """The manifest of the step directory ``folder``: its own, or the one made up for a NeMo AutoModel step
    (:func:`ckptio.adopt.automodel.adopt`); a folder that is neither raises :class:`CheckpointNotFoundError`."""
    if folder.kind(MANIFEST_NAME) is None:
        adopted = adopt(folder, folder.path.name)
        if adopted is not None:
            return adopted
    return read_manifest(folder)


def _inspect_dir(path: Path, verify: str = "size") -> CheckpointEntry:
    """What the directory ``path`` is: a committed checkpoint, or why not (see :func:`inspect_step`)."""
    return inspect_step(open_storage(path.parent), path.name, verify)


def inspect_step(storage: Storage, name: str, verify: str = "size", *, top: Any = None) -> CheckpointEntry:
    """What ``name`` inside ``storage`` is: a committed checkpoint, or why not. ``verify`` says how far its
    files are checked (``none``: the manifest only; ``size``: every file present, regular, of the recorded
    size; ``full``: also every byte against its checksum). ``top``: the storage's root folder, when the caller
    has it open already (its listing is reused: one listing of an object store for a whole scan)."""
    path = storage.root / name
    if name.startswith(TMP_PREFIX):
        return CheckpointEntry(name, path, None, "uncommitted temporary (an interrupted or running save)",
                               candidate=False)
    try:
        top = storage.folder() if top is None else top
        kind = top.kind(name)
        if kind != "dir":
            return CheckpointEntry(name, path, None, "not a directory (a link or a file is never a checkpoint)"
                                   if kind is not None else "no such directory", candidate=kind == "link")
        folder = top.sub(name)
        present = folder.kind(MANIFEST_NAME) is not None
        pending = not present and folder.kind(PENDING_NAME) == "file"
    except CheckpointError as exc:
        return CheckpointEntry(name, path, None, str(exc))
    if pending:  # an object store's step being written in place (or whose save died before its manifest)
        return CheckpointEntry(name, path, None, f"{MANIFEST_NAME} is missing: uncommitted (an interrupted or "
                               "running save)", candidate=False)
    if not present:
        try:
            adopted = adopt(folder, name)
        except CheckpointError as exc:
            return CheckpointEntry(name, path, None, str(exc))
        if adopted is not None:  # a NeMo AutoModel step: resumable as it is, nothing to check it against
            return CheckpointEntry(name, path, adopted)
        try:
            shaped = any(folder.kind(sub) is not None for sub in (MODEL_DIR, OPTIM_DIR))
            mark = ckptio_mark(folder) if shaped else None
        except CheckpointError as exc:
            return CheckpointEntry(name, path, None, f"{MANIFEST_NAME} is missing, and {exc}")
        if mark is not None:
            return CheckpointEntry(name, path, None, f"{MANIFEST_NAME} is missing from a folder ckptio wrote (it holds "
                                   f"{mark}): damaged, not loaded and never taken for another tool's checkpoint")
        return CheckpointEntry(
            name, path, None,
            f"{MANIFEST_NAME} is missing: not a committed ckptio checkpoint (an interrupted save, or a folder "
            "written by another tool)", candidate=shaped,
        )
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return CheckpointEntry(name, path, None, str(exc))
    problems = [] if verify == "none" else check_files(folder, manifest, checksums=verify == "full")
    if problems:
        return CheckpointEntry(name, path, manifest, f"{len(problems)} damaged file(s): " + "; ".join(problems[:3]))
    return CheckpointEntry(name, path, manifest)


def scan(checkpoint_dir: "str | Path | Storage", verify: str = "size") -> list[CheckpointEntry]:
    """Every directory in ``checkpoint_dir`` (committed or not), committed ones first by step.

    Hidden directories other than ckptio's own temporaries (``.tmp-*``) are not checkpoints and are
    skipped, and so are links (a link is never a checkpoint: it could lead anywhere).
    """
    storage = as_storage(checkpoint_dir)
    top = storage.folder()
    try:
        listing = top.listdir()  # links are listed as links, never followed
    except CheckpointNotFoundError:
        return []
    _warn_pointer_folders(storage, listing)
    entries = [
        inspect_step(storage, e.name, verify, top=top)
        for e in listing
        if e.kind == "dir" and (e.name.startswith(TMP_PREFIX) or not e.name.startswith("."))
        and e.name not in POINTER_NAMES
    ]
    users: dict[str, list[str]] = {}  # a step's name -> the committed steps that use files under it
    for e in entries:
        for target in (e.manifest.shared.values() if e.committed and e.manifest is not None else ()):
            users.setdefault(target.split("/", 1)[0], []).append(e.name)
    for e in entries:
        if not e.committed and e.name in users:  # not damage: what a bucket keeps until nothing refers to it
            e.held_for, e.candidate = tuple(sorted(set(users[e.name]))), False
            e.problem = f"removed by retention; its files that {', '.join(e.held_for)} use stay until none does"
    return sorted(entries, key=lambda e: (not e.committed, e.step if e.step is not None else -1, e.name))


_warned: set[str] = set()


def _warn_pointer_folders(storage: Any, listing: Any) -> None:
    """A ``LATEST`` or ``BEST`` that is a folder is a copy made by a tool that follows links: never a step directory
    of its own (it would be a second copy of one). Said once per folder, at the first look; the next save puts the
    link back (:func:`ckptio.storage.posix.write_pointer`)."""
    for e in listing:
        if e.kind == "dir" and e.name in POINTER_NAMES and f"{storage.root}/{e.name}" not in _warned:
            _warned.add(f"{storage.root}/{e.name}")
            log.warning("%s/%s is a folder, not a link (the checkpoint directory was copied by a tool that follows "
                        "links, such as shutil.copytree or aws s3 sync); it is not read as a checkpoint, and the next "
                        "save moves it aside and makes %s a link again", storage.root, e.name, e.name)


def committed_checkpoints(checkpoint_dir: "str | Path | Storage", verify: str = "size") -> list[CheckpointEntry]:
    """Complete checkpoints, oldest step first."""
    return [e for e in scan(checkpoint_dir, verify) if e.committed]


def newest_checkpoint(checkpoint_dir: "str | Path | Storage", *, verify: str = "size") -> CheckpointEntry | None:
    """The newest complete checkpoint; damaged or uncommitted ones are skipped with a warning."""
    candidates = restore_candidates(checkpoint_dir, None, verify=verify)
    return _inspect_dir(candidates[0], verify) if candidates else None


def pointer_target(checkpoint_dir: "str | Path | Storage", name: str) -> Path | None:
    """The step directory the pointer ``name`` (``LATEST``/``BEST``) leads to; ``None`` without a pointer.

    The pointer must name a real directory directly inside ``checkpoint_dir``: a target that is itself
    a link, or leads anywhere else, is a :class:`~ckptio.CheckpointCorruptError` naming the pointer.
    """
    storage = as_storage(checkpoint_dir)
    target = storage.read_pointer(name)
    if target is None:
        return None
    path = storage.root / target
    if storage.folder().kind(target) == "link":
        raise CheckpointCorruptError(f"{storage.root / name}: leads to {path}, which is a link; a pointer must name a "
                                     f"checkpoint directory directly inside {storage.root}")
    return path


def _exists(storage: Storage, name: str) -> bool:
    try:
        return storage.folder().kind(name) is not None
    except CheckpointError:
        return False


def restore_candidates(checkpoint_dir: "str | Path | Storage", restore_from: str | None, *,
                       verify: str = "size") -> list[Path]:
    """The step directories a run should try to load, best first, following :attr:`CheckpointConfig.restore_from`.

    ``None`` (auto-resume): every usable checkpoint, newest first (each unusable step directory is named
    with its reason in a warning; when there are such directories and no usable one,
    :class:`~ckptio.errors.NoUsableCheckpointError`); the caller falls back to the next one when a load
    finds damage the discovery could not see. ``"LATEST"``: the pointer's target, or, when the pointer is missing or damaged, the same list
    as auto-resume (with a warning). ``"BEST"``, a name or a path: exactly that checkpoint.
    Raises :class:`CheckpointNotFoundError` when an explicitly requested checkpoint does not exist or is
    not usable; returns ``[]`` when auto-resume finds nothing.
    """
    storage = as_storage(checkpoint_dir)
    if restore_from is None:
        return _auto_resume_candidates(storage, verify)
    if restore_from in POINTER_NAMES:
        return _pointer_candidates(storage, restore_from, verify)
    where, name = _named_step(storage, restore_from)
    entry = inspect_step(where, name, verify)
    if not entry.committed:
        raise CheckpointNotFoundError(f"restore_from={restore_from!r}: {entry.path} is not usable ({entry.problem})")
    return [entry.path]


def _auto_resume_candidates(storage: Storage, verify: str) -> list[Path]:
    """Every usable checkpoint, newest first; damaged step directories are warned about, and refused when they
    are all there is."""
    entries = scan(storage, verify)
    good = [e for e in entries if e.committed]
    skipped = [e for e in entries if not e.committed and e.candidate]
    for bad in skipped:
        log.warning("Skipping %s: %s", bad.path, bad.problem)
    if skipped and not good:
        raise NoUsableCheckpointError(
            f"{storage.root} holds {len(skipped)} step director{'y' if len(skipped) == 1 else 'ies'} and none is "
            "usable: " + "; ".join(f"{e.name}: {e.problem}" for e in skipped[:5]) + ("; ..." if len(skipped) > 5 else "")
            + ". Nothing was loaded and the run does not start from scratch over them: repair or remove them, "
            "name a checkpoint to restore, or set start_fresh_if_damaged: true",
            [(e.name, e.problem or "") for e in skipped])
    return [e.path for e in reversed(good)]


def _pointer_candidates(storage: Storage, restore_from: str, verify: str) -> list[Path]:
    """The target of the pointer ``restore_from``; for ``LATEST``, auto-resume's list when it is missing, damaged
    or leads to an unusable step (with a warning)."""
    try:
        path = pointer_target(storage, restore_from)
    except CheckpointError as exc:
        if restore_from != LATEST:
            raise CheckpointNotFoundError(f"restore_from={restore_from!r}: {exc}") from exc
        log.warning("Ignoring the LATEST pointer (%s); resuming from the newest usable checkpoint instead", exc)
        path = None
    if path is None:
        if restore_from == LATEST:
            found = restore_candidates(storage, None, verify=verify)
            if found:
                return found
        raise CheckpointNotFoundError(f"restore_from={restore_from!r}: there is no {restore_from} pointer in "
                                      f"{storage.root}")
    entry = inspect_step(storage, path.name, verify)
    if not entry.committed:
        if restore_from == LATEST:
            log.warning("LATEST leads to %s, which is not usable (%s); resuming from the newest usable "
                        "checkpoint instead", path, entry.problem)
            found = restore_candidates(storage, None, verify=verify)
            if found:
                return found
        raise CheckpointNotFoundError(
            f"restore_from={restore_from!r}: the pointer leads to {path}, which is not usable ({entry.problem})"
        )
    return [path]


def _named_step(storage: Storage, restore_from: str) -> tuple[Storage, str]:
    """Where the step ``restore_from`` (a name inside the checkpoint folder, a path or a URL anywhere, or the
    ``LATEST``/``BEST`` pointer of a folder anywhere) is."""
    plain = not Path(restore_from).is_absolute() and "/" not in restore_from  # a name inside the folder, first
    if plain and _exists(storage, restore_from):
        return storage, restore_from
    from ..storage import url_scheme

    if url_scheme(restore_from) is not None:  # a step directory anywhere in a bucket
        parent, _, leaf = restore_from.rstrip("/").rpartition("/")
        where, name = open_storage(parent), leaf
        candidate: Any = where.root / name
    else:
        candidate = Path(restore_from)
        where, name = open_storage(candidate.parent), candidate.name
    # run1/LATEST, s3://bucket/run1/BEST: the step its pointer names (a link, or LATEST.txt where links fail), read
    # as inspect reads it: a direct child of that folder, never a link
    target = pointer_target(where, name) if name in POINTER_NAMES else None
    if target is not None:
        return where, target.name
    if not name or not _exists(where, name):
        where_ = (f" (looked for {storage.root / restore_from}, and for {restore_from} in the working folder)" if plain
                  else "" if url_scheme(restore_from) or Path(restore_from).is_absolute() else
                  f" (a relative path: from the working folder {Path.cwd()})")
        raise CheckpointNotFoundError(f"restore_from={restore_from!r}: no such checkpoint{where_}")
    return where, name


def resolve_restore_path(checkpoint_dir: str | Path, restore_from: str | None, *, verify: str = "size") -> Path | None:
    """The step directory a run should load first (see :func:`restore_candidates`); ``None`` when there is none."""
    found = restore_candidates(checkpoint_dir, restore_from, verify=verify)
    return found[0] if found else None


def clean_temporaries(checkpoint_dir: "str | Path | Storage", older_than_s: float = 0.0) -> list[Path]:
    """Remove leftovers of interrupted saves and deletions (``.tmp-*``, ``.trash-*``)."""
    return as_storage(checkpoint_dir).sweep(older_than_s)


def find_candidates(storage: Storage, restore_from: str | None, verify: str, start_fresh_if_damaged: bool,
                    log: Any) -> tuple[Path | None, list[Path]]:
    """Collective, one broadcast: the checkpoint of another kind to restore from (``restore_from`` naming one, or an
    automatic resume in a folder holding another tool's run: see :mod:`ckptio.adopt.foreign`), else ``None`` and the
    step directories to try, best first, chosen on rank 0 (:func:`restore_candidates`); ``[]`` (said in the log) for
    a fresh start. A folder whose step directories are all unusable, or that holds only checkpoints ckptio cannot
    resume from, raises :class:`NoUsableCheckpointError` on every rank, unless an automatic resume may start fresh
    over damaged step directories (``start_fresh_if_damaged``, :attr:`CheckpointConfig.start_fresh_if_damaged`)."""
    from .. import _dist
    from ..adopt.foreign import foreign_run, is_foreign, unreadable_error

    rank = _dist.rank()

    def choose() -> tuple[Path | None, list[Path], list[str]]:
        if is_foreign(restore_from):
            return Path(restore_from), [], []  # type: ignore[arg-type]
        found = restore_candidates(storage, restore_from, verify="none" if verify == "none" else "size")
        if not found and restore_from in (None, LATEST):
            run, kinds = foreign_run(storage.root)
            return run, [], kinds
        return None, found, []

    try:
        foreign, candidates, unreadable = _dist.decide_on_rank0("finding the checkpoint to restore", choose)
    except NoUsableCheckpointError:
        if not (restore_from in (None, LATEST) and start_fresh_if_damaged):
            raise
        if rank == 0:
            log.warning("No usable checkpoint in %s (every step directory found is damaged); starting from "
                        "scratch as start_fresh_if_damaged asks", storage.root)
        return None, []
    if unreadable:  # never a fresh start beside them, start_fresh_if_damaged or not: they are not damaged
        raise unreadable_error(storage.root, unreadable)
    if foreign is not None and restore_from is None and rank == 0:
        log.info("%s holds no ckptio checkpoint but a run of another tool: resuming from it", storage.root)
    if foreign is None and not candidates and rank == 0:
        log.info("No checkpoint found in %s; starting from scratch", storage.root)
    return foreign, candidates
