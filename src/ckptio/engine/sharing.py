"""Unchanged tensors stored once: a save shares the files whose bytes did not change with the newest checkpoint.

What can be shared is decided per file, at the granularity storage has. The model's frozen tensors (every saved
key that is not a parameter with ``requires_grad``: frozen weights and buffers) go into safetensors files of their
own (:func:`ckptio.formats.safetensors.chunk_index.files_of`). Before such a file is written, the SHA-256 of the
exact bytes it would hold is computed (:func:`ckptio.formats.safetensors._writer.content_digest`, no disk
involved) and compared with the digest the newest committed checkpoint (``LATEST``) recorded for the file of
the same name (its manifest's ``contents``). Equal digests mean equal bytes: the file is then

* **locally**, a hard link to the newest checkpoint's file (:meth:`LocalFolderWriter.link`), so every step
  directory stays a whole folder that ``transformers``, NeMo AutoModel, plain DCP and ``tar`` read as before,
  and deleting a step frees only what no other step links;
* **in a bucket**, a reference: the manifest's ``shared`` maps the file to the object of the earlier step that
  holds its bytes, and retention, ``prune`` and the sweep delete an object only when no committed manifest refers
  to it (:mod:`ckptio.storage.objstore.refs`).

``requires_grad`` only groups tensors; the digest decides. A frozen tensor edited in place changes its file's
digest, and the file is written anew. A file whose bytes repeat by chance under another name is never shared
(names must match too), which costs bytes, never correctness. The digest's cost falls on frozen files only, so
a model without frozen tensors pays nothing; with them, hashing (about 1 GB/s per core with SHA-NI, hashlib
releasing the GIL, one thread per file) is cheaper than the write it replaces.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from .layout import LATEST
from .manifest import Manifest, read_manifest

__all__ = ["Previous", "Sharer", "frozen_keys", "max_holders", "previous_of"]


@dataclass
class Previous:
    """What the newest committed checkpoint offers to share: its shareable files' digests, checksums and sizes."""

    name: str
    contents: dict[str, str]
    checksums: dict[str, str]
    sizes: dict[str, int]
    owners: dict[str, str] = field(default_factory=dict)
    """Files the checkpoint itself refers to elsewhere (a bucket's ``shared``): a new reference goes to the owner."""
    committed: int = 1
    """How many committed steps the folder holds before this save (a copy may be held by fewer: :class:`Sharer`)."""
    held: dict[str, int] = field(default_factory=dict)
    """In a bucket: each object a committed step uses for a shareable file (``step/path``) -> how many committed
    steps use it (its owner, if committed, and those that refer to it). Locally the file's link count says it."""

    @classmethod
    def of(cls, manifest: Manifest) -> "Previous":
        """The shareable files of ``manifest`` (those with a digest, a size and a checksum)."""
        usable = [rel for rel in manifest.contents if rel in manifest.files and rel in manifest.checksums]
        return cls(manifest.name, {rel: manifest.contents[rel] for rel in usable},
                   {rel: manifest.checksums[rel] for rel in usable}, {rel: manifest.files[rel] for rel in usable},
                   {rel: manifest.shared[rel] for rel in usable if rel in manifest.shared})


def previous_of(storage: Any, log: Any = None) -> Previous | None:
    """Rank 0, under the folder's lock: what the checkpoint ``LATEST`` names offers, or ``None`` (no checkpoint,
    or one that cannot be read: then everything is written, which is always right)."""
    try:
        name = storage.read_pointer(LATEST)
        if name is None:
            return None
        manifest = read_manifest(storage.folder(name))
    except (CheckpointError, OSError) as exc:
        if log is not None:
            log.info("Nothing is shared with the newest checkpoint (%s); every file is written", exc)
        return None
    if not manifest.contents:
        return None
    previous = Previous.of(manifest)
    previous.committed, previous.held = _holders(storage)
    return previous


def _holders(storage: Any) -> tuple[int, dict[str, int]]:
    """The folder's committed steps, and in a bucket how many of them use each object holding a shareable file."""
    from .layout import scan

    committed = [e for e in scan(storage, verify="none") if e.committed]
    held: dict[str, int] = {}
    if getattr(storage, "refers", False):
        for e in committed:
            for rel in e.manifest.contents:  # type: ignore[union-attr]
                source = e.manifest.shared.get(rel, f"{e.name}/{rel}")  # type: ignore[union-attr]
                held[source] = held.get(source, 0) + 1
    return max(len(committed), 1), held


def frozen_keys(model_state: Any, state_dict: dict[str, Any]) -> frozenset[str]:
    """The keys of a model's ``state_dict`` grouped apart (see :meth:`ckptio.state.model.ModelState.frozen_keys`);
    none for a state without that notion. Only grouping depends on this, never what is written."""
    frozen = getattr(model_state, "frozen_keys", None)
    return frozen(state_dict) if frozen is not None else frozenset()


def max_holders(config: Any) -> int | None:
    """How many steps may hold one copy of a shared file (``None``: no bound). While retention keeps ``n >= 2``
    steps, a copy is held by at most ``n - 1`` steps, and by fewer than the steps the folder holds once the new one
    is committed (:class:`Sharer`: the first saves, before ``n`` exist), so the kept steps always span two copies or
    more and one damaged file never holds the only copy of a state: the steps that hold another copy restore.
    Keeping everything bounds a copy at 4 steps; keeping one lets a link save the write (there is no second step)."""
    kept = [k for k in (config.keep_latest, config.max_recent_checkpoints, config.save_top_k)
            if isinstance(k, int) and k > 0]
    if not kept:
        return 4
    n = max(kept)
    return None if n <= 1 else n - 1


class Sharer:
    """One rank's side of a save's sharing: called with each frozen file's relative path and digest before it is
    written; returns the checksum of the shared file (nothing to write) or ``None`` (write it). Thread-safe.

    A file is shared only after its bytes were read back and hashed to the live tensors' digest (a save never refers
    to bytes it has not checked: a file that rotted, or was replaced under a re-recorded manifest, is written anew
    from memory, which also leaves the new step healthy), and only while that copy is held by fewer than ``holders``
    steps (:func:`max_holders`) and fewer than the committed steps (so that with the new step, some step holds
    another copy: two steps kept never share their only one). Locally the holders are the file's hard-link count,
    in a bucket the committed steps that use the object (:attr:`Previous.held`); either may count more (a link
    from outside, a step retention is about to remove), which writes a copy more, never one less."""

    def __init__(self, writer: Any, previous: Previous | None, storage: Any = None, holders: int | None = None,
                 log: Any = None) -> None:
        self.writer, self.previous, self.storage, self.holders, self.log = writer, previous, storage, holders, log
        self.contents: dict[str, str] = {}
        """Every shareable file of this save -> its digest (the manifest's ``contents``)."""
        self.linked: dict[str, tuple[str, int]] = {}
        """Files shared rather than written -> (``step/rel`` holding their bytes, size)."""
        self._lock = threading.Lock()

    def __call__(self, rel: str, digest: str) -> str | None:
        with self._lock:
            self.contents[rel] = digest
        p = self.previous
        if p is None or p.contents.get(rel) != digest:
            return None
        source = p.owners.get(rel, f"{p.name}/{rel}")
        if not self._may_share(source, digest, p.sizes[rel]) or not self.writer.link(rel, source, p.sizes[rel]):
            return None
        with self._lock:
            self.linked[rel] = (source, p.sizes[rel])
        return p.checksums[rel]

    def _may_share(self, source: str, digest: str, size: int) -> bool:
        """``source`` holds exactly the bytes of ``digest`` (read back and hashed) and another step may hold it."""
        if self.storage is None:
            return False  # nothing to check the bytes with: write them
        step, _, path = source.partition("/")
        p = self.previous
        try:
            folder = self.storage.folder(step)
            info = folder.lstat(path) if hasattr(folder, "lstat") else None
            if self.holders is not None and p is not None:
                held = info.st_nlink if info is not None else p.held.get(source, self.holders)
                if held >= min(self.holders, p.committed):
                    return False  # enough steps hold this copy: the new step starts another
            handle = folder.open(path, size=size)
            try:
                sha, offset = hashlib.sha256(), 0
                while offset < size:
                    n = min(_CHUNK, size - offset)
                    sha.update(handle.read(offset, n))
                    offset += n
            finally:
                handle.close()
        except (CheckpointError, OSError) as exc:
            self._say("Not sharing %s (%s); writing it anew", source, exc)
            return False
        if f"sha256:{sha.hexdigest()}" != digest:
            self._say("%s does not hold the bytes its manifest records (damaged or replaced): writing the live "
                      "tensors anew instead of sharing it; `ckptio verify` names every step that holds it", source)
            return False
        return True

    def _say(self, *args: Any) -> None:
        if self.log is not None:
            self.log.warning(*args)


_CHUNK = 8 << 20
