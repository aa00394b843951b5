"""What the framework integrations (``ckptio.lightning``, ``ckptio.hf_trainer``, ``ckptio.accelerate``) share about
the folders they write in a framework's own layout: checking one before it is read, finding the newest usable one,
committing one with its manifest, and deleting the oldest ones.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

from .errors import CheckpointCorruptError, CheckpointError, NoUsableCheckpointError

__all__ = ["check_manifest", "usable", "newest", "commit", "remove_oldest"]

log = logging.getLogger("ckptio")


def check_manifest(folder: Any, verify: str, *, required: bool) -> bool:
    """Check ``folder``'s files against its manifest (sizes; with ``verify="full"`` every byte's checksum) and raise
    a :class:`CheckpointCorruptError` naming the damage; ``False`` when there is no manifest and none is
    ``required`` (a folder the framework wrote itself).

    A link or a special file anywhere in the folder is refused first, manifest or not: the frameworks' own
    readers, which load some of these files, open paths without ckptio's confinement and would follow it."""
    from .manifest import MANIFEST_NAME, check_files, read_manifest

    odd = [rel for rel, entry in folder.walk_files() if entry.kind != "file"]
    if odd:
        raise CheckpointCorruptError(f"{folder.display(odd[0])}: a link or special file inside a checkpoint "
                                     f"({len(odd)} in all); a checkpoint holds regular files only")
    if not required and folder.kind(MANIFEST_NAME) is None:
        return False
    problems = check_files(folder, read_manifest(folder), checksums=verify == "full")
    if problems:
        raise CheckpointCorruptError(f"{folder.display()}: {len(problems)} file(s) damaged: " + "; ".join(problems[:3]))
    return True


def _numbered(root: Path, name: re.Pattern[str]) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := name.match(p.name)))


def usable(root: str | Path, name: re.Pattern[str], check: Callable[[Path], None]) -> tuple[list[Path], list[tuple[str, str]]]:
    """The folders of ``root`` whose name matches ``name`` (one group: the number) and pass ``check``, highest number
    first, and the others with the reason each failed."""
    root = Path(root)
    if not root.is_dir():
        return [], []
    good, skipped = [], []
    for _, path in reversed(_numbered(root, name)):
        try:
            check(path)
        except CheckpointError as exc:
            skipped.append((path.name, str(exc)))
        else:
            good.append(path)
    return good, skipped


def newest(root: str | Path, found: tuple[list[Path], list[tuple[str, str]]]) -> Path | None:
    """The first of :func:`usable`'s folders, each skipped one logged with its reason; ``None`` when ``root`` holds
    none at all; :class:`~ckptio.errors.NoUsableCheckpointError` when it holds some and none is usable."""
    good, skipped = found
    for name, why in skipped:
        log.warning("ckptio: skipping %s: %s", name, why)
    if good:
        return good[0]
    if skipped:
        raise NoUsableCheckpointError(f"{root}: {len(skipped)} checkpoint folder(s), none usable: "
                                      + "; ".join(f"{n}: {w}" for n, w in skipped[:3]), skipped)
    return None


def commit(writer: Any, *, step: int, epoch: int, world_size: int, states: dict[str, Any],
           metrics: dict[str, float] | None = None) -> None:
    """Describe every file ``writer`` holds (size, CRC-32C read back) in a manifest and commit the folder."""
    from .manifest import MANIFEST_NAME, Manifest, software_versions

    files = writer.files()
    sums = {rel: writer.checksum_of(rel) for rel in files}
    manifest = Manifest(name=writer.final.name, step=step, epoch=epoch, world_size=world_size,
                        model_save_format="safetensors", states=states, files=files, metrics=metrics or {},
                        checksums=sums, versions=software_versions())
    writer.commit((MANIFEST_NAME, manifest.to_json().encode()))


def remove_oldest(root: Path, name: re.Pattern[str], limit: int | None, *, keep: frozenset[str] = frozenset(),
                  setting: str = "the limit") -> list[Path]:
    """At most ``limit`` numbered folders in ``root``: the newest and those in ``keep`` stay, the oldest others are
    deleted first, each hidden before it is removed."""
    from .storage.posix import remove_tree

    if not limit or limit <= 0:
        return []
    steps = [(n, p) for n, p in _numbered(root, name) if p.is_dir() and not p.is_symlink()]
    if len(steps) <= limit:
        return []
    protected = {steps[-1][1].name} | set(keep)
    doomed = [p for _, p in steps if p.name not in protected][: len(steps) - max(limit, len(protected))]
    for p in doomed:
        log.info("ckptio: deleting %s (%s=%d)", p.name, setting, limit)
        remove_tree(p)
    return doomed
