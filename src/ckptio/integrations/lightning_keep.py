"""What the Lightning plugin keeps, resumes from and lets Lightning count, where Lightning's own bookkeeping cannot tell
a committed ckptio folder from a torn one.

Lightning's ``ModelCheckpoint`` decides which checkpoints to delete from the paths it remembers, and
``fit(ckpt_path="last")`` picks the ``last*.ckpt`` entry of its folder modified last; neither looks inside. A folder
under a checkpoint's name without its manifest (a copy cut short, a folder whose manifest was lost) or with
damaged files is *torn*. Here:

* :func:`keep_reason`: a removal Lightning asks for is refused when it would delete the checkpoint just written or
  the newest complete one in the folder (committed, sizes as the manifest says);
* :func:`resume_instead`: when the ``last`` checkpoint Lightning picked cannot be read, the newest other ``last``
  one that can is read instead, each skipped one logged with its reason; none: ``NoUsableCheckpointError``;
* :func:`forget_torn`: a ``ModelCheckpoint`` state handed back to Lightning no longer lists, among the top-k it
  counts as kept, a path that is not a complete checkpoint on disk (so a torn one never takes a kept place).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointError, NoUsableCheckpointError

__all__ = ["keep_reason", "newest_complete", "is_complete", "resume_instead", "forget_torn", "last_checkpoint",
           "s3_location", "NOTE", "NOTE_TEXT", "monitored"]

log = logging.getLogger("ckptio")

_MANIFEST = "manifest.json"


def _committed_at(path: Path) -> int | None:
    """When the folder ``path`` was committed (its manifest's mtime in ns); ``None`` when it is no committed folder."""
    if path.name.startswith(".") or path.is_symlink() or not path.is_dir():
        return None
    try:
        st = os.lstat(path / _MANIFEST)
    except OSError:
        return None
    return st.st_mtime_ns if stat.S_ISREG(st.st_mode) else None


def is_complete(path: Path) -> bool:
    """``path`` is a committed ckptio folder whose files have the sizes its manifest records."""
    from .framework_dirs import check_manifest
    from ..storage.confined import Folder

    if _committed_at(path) is None:
        return False
    try:
        check_manifest(Folder(path), "size", required=True)
    except CheckpointError:
        return False
    return True


def newest_complete(parent: Path, *, written: Path | None = None) -> Path | None:
    """The complete ckptio folder in ``parent`` committed last (``None`` when there is none); of folders committed
    at the same recorded time (a file system keeping whole seconds), the one ``written`` last by this process."""
    found = []
    for p in parent.iterdir() if parent.is_dir() else []:
        when = _committed_at(p)
        if when is not None:
            found.append((when, p == written, p.name, p))
    for *_, p in sorted(found, reverse=True):
        if is_complete(p):
            return p
    return None


def keep_reason(path: Path, written: Path | None) -> str | None:
    """Why the local checkpoint ``path`` must not be deleted, or ``None`` when it may go."""
    path = Path(os.path.abspath(path))
    if written is not None and path == written:
        return "it is the checkpoint just written"
    if path.is_dir() and not path.is_symlink() and newest_complete(path.parent, written=written) == path:
        return "it is the newest complete checkpoint in its folder"
    return None


def _is_last(path: Path, last_name: str, suffix: str) -> bool:
    """Lightning's own test of a ``ckpt_path="last"`` candidate (``ModelCheckpoint._find_last_checkpoints``)."""
    return path.suffix == suffix and bool(re.match(rf"^{re.escape(last_name)}(-(\d+))?", path.stem))


def _modified(path: Path) -> float:
    """The time Lightning ranks ``last`` candidates by, taken from the manifest for a ckptio folder."""
    return ((path / _MANIFEST) if path.is_dir() else path).stat().st_mtime


def resume_instead(path: Path, failure: CheckpointError, read: Callable[[Path], dict[str, Any]], *,
                   last_name: str = "last", suffix: str = ".ckpt") -> dict[str, Any]:
    """The checkpoint to resume from when ``path``, a ``last`` checkpoint Lightning picked, failed with ``failure``:
    the newest other ``last`` checkpoint beside it that ``read`` accepts; ``failure`` itself when ``path`` is not a
    ``last`` one (the user named it) or nothing is there; :class:`NoUsableCheckpointError` when none is usable."""
    if not _is_last(path, last_name, suffix) or not (path.exists() or path.is_symlink()):
        raise failure  # a path the user named, or nothing at all: nothing else to take
    skipped = [(path.name, str(failure))]
    others = [p for p in path.parent.iterdir() if p != path and _is_last(p, last_name, suffix)
              and not p.is_symlink() and (p.is_file() or _committed_at(p) is not None)]
    for other in sorted(others, key=_modified, reverse=True):
        try:
            checkpoint = read(other)
        except CheckpointError as exc:
            skipped.append((other.name, str(exc)))
            continue
        for name, why in skipped:
            log.warning("ckptio: skipping %s: %s", name, why)
        log.warning("ckptio: resuming from %s instead of %s, which cannot be read", other, path)
        return checkpoint
    raise NoUsableCheckpointError(f"{path.parent}: no usable '{last_name}' checkpoint to resume from: "
                                  + "; ".join(f"{n}: {w}" for n, w in skipped[:3]), skipped) from failure


def forget_torn(checkpoint: dict[str, Any]) -> list[str]:
    """Drop from every ``ModelCheckpoint`` state in ``checkpoint`` the top-k entries whose local path is not a
    complete checkpoint (a torn folder, nothing at all); returns the paths dropped.

    Lightning counts ``best_k_models`` as kept: an entry left for a torn folder would make it delete a complete
    checkpoint to stay within ``save_top_k``. With fewer entries than ``save_top_k`` Lightning recomputes the
    worst kept one on its next save, so a dropped ``kth_best_model_path`` is cleared."""
    dropped: list[str] = []
    callbacks = checkpoint.get("callbacks")
    for state in callbacks.values() if isinstance(callbacks, dict) else []:
        best = state.get("best_k_models") if isinstance(state, dict) else None
        if not isinstance(best, dict):
            continue
        gone = [p for p in best if isinstance(p, str) and "://" not in p and not _kept(Path(p))]
        for p in gone:
            del best[p]
            log.warning("ckptio: %s is not a complete checkpoint; ModelCheckpoint no longer counts it as kept", p)
        if state.get("kth_best_model_path") in gone:
            state["kth_best_model_path"] = ""
        dropped += gone
    return dropped


def _kept(path: Path) -> bool:
    """A checkpoint that proves itself kept: a complete ckptio folder, or a Lightning ``.ckpt`` file."""
    return is_complete(path) or path.is_file() and not path.is_symlink()


def s3_location(path: Any) -> tuple[Any, str] | None:
    """(the storage of the parent folder, the name) for a path in object storage (``s3://``, ``gs://``, ``az://`` or
    ``abfs://``); ``None`` for a local one. Another URL is a :class:`ConfigError`, never read as a local folder."""
    from ..errors import ConfigError
    from ..storage import OBJECT_SCHEMES, open_storage, url_scheme

    text = str(path)
    scheme = url_scheme(text)
    if scheme is None:
        return None
    if scheme not in OBJECT_SCHEMES:
        raise ConfigError(f"{text}: the Lightning plugin keeps checkpoints in a local or mounted folder or in object "
                          f"storage ({', '.join(s + '://' for s in OBJECT_SCHEMES)}); {scheme}:// is not supported")
    parent, _, name = text.rstrip("/").rpartition("/")
    return open_storage(parent), name


def last_checkpoint(dirpath: str | Path, name: str = "last") -> str | None:
    """The newest complete ``last`` checkpoint (``last.ckpt``, ``last-v1.ckpt``...: the names Lightning's
    ``ckpt_path="last"`` considers; ``name`` is ``ModelCheckpoint.CHECKPOINT_NAME_LAST``) in ``dirpath``, a local
    folder or ``s3://bucket/prefix`` (``gs://``, ``az://`` alike), for ``trainer.fit(..., ckpt_path=...)``; ``None``
    when there is none. Lightning's own ``ckpt_path="last"`` finds nothing in an object store (it normalises the
    listed paths, which drops the ``s3://``), so a run checkpointed to a bucket resumes with this."""
    s3 = s3_location(str(dirpath).rstrip("/") + "/x")
    found: list[tuple[float, str]] = []
    if s3 is not None:
        storage, root = s3[0], str(s3[0].root)
        for entry in storage.folder().listdir():
            if _is_last(Path(entry.name), name, ".ckpt") and _s3_complete(storage, entry.name):
                found.append((_object_modified(storage, entry.name), f"{root}/{entry.name}"))
    else:
        root_path = Path(dirpath)
        for p in root_path.iterdir() if root_path.is_dir() else []:
            if _is_last(p, name, ".ckpt") and not p.is_symlink() and (p.is_file() or _committed_at(p) is not None):
                found.append((_modified(p), str(p)))
    return max(found)[1] if found else None


def _object_modified(storage: Any, name: str) -> float:
    """When ``name`` in a bucket was written: an object's time; a folder's, its manifest's (when it was committed),
    else its newest object's."""
    from ..storage.objstore._store import MANIFEST

    bucket, key = storage.store, storage._key(name)
    for candidate in (key, f"{key}/{MANIFEST}"):
        obj = bucket.head(candidate)
        if obj is not None:
            return float(obj.mtime)
    return max(o.mtime for o in bucket.listing(f"{key}/", delimiter=False)[0])


def _s3_complete(storage: Any, name: str) -> bool:
    """A Lightning ``.ckpt`` object, a committed folder, or one whose replacement was cut short beside a complete
    copy (read from that copy)."""
    from ..storage.objstore.replace import committed, complete_copy

    kind = storage.folder().kind(name)
    return kind == "file" or (kind == "dir" and (committed(storage, name) or complete_copy(storage, name) is not None))


NOTE = "HOW-TO-LOAD.txt"
NOTE_TEXT = """This folder is one Lightning checkpoint, written by ckptio's CkptioCheckpointIO plugin (a folder, not
one .ckpt file; its manifest.json checks every byte).

A Trainer with the plugin reads it as usual: fit/test/validate/predict(ckpt_path=...).

In a script without the plugin (an inference script), install ckptio's loader first, then load as usual:

    from ckptio.lightning import install_loader
    install_loader()
    model = MyLightningModule.load_from_checkpoint("path/to/this/folder")

Without that line Lightning opens the folder as one file and fails (IsADirectoryError). `ckptio inspect` of this
folder describes it; `ckptio convert` turns it into a single Lightning .ckpt file or a Hugging Face folder.
"""
"""The note in each checkpoint folder the plugin writes: what a user who finds the folder with ``ls`` needs."""


def monitored(checkpoint: dict[str, Any]) -> dict[str, float]:
    """The metric each ``ModelCheckpoint`` monitors, at its value for this save (its ``current_score``), for the
    manifest: ``ckptio inspect`` and ``list`` show it, as for a manager's saves."""
    import math

    import torch

    out: dict[str, float] = {}
    callbacks = checkpoint.get("callbacks")
    for key, state in (callbacks.items() if isinstance(callbacks, dict) else ()):
        if not (isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict)):
            continue
        monitor, score = state.get("monitor"), state.get("current_score")
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            score = score.item()
        if isinstance(monitor, str) and isinstance(score, (int, float)) and not isinstance(score, bool) \
                and math.isfinite(score):
            out[monitor] = float(score)
    return out
