"""What the framework integrations (``ckptio.lightning``, ``ckptio.hf_trainer``, ``ckptio.accelerate``) share about
the folders they write in a framework's own layout: checking one before it is read, finding the newest usable one,
committing one with its manifest, and deleting the oldest ones.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import CheckpointCorruptError, CheckpointError, NoUsableCheckpointError
from ..storage.parse import as_float, as_int

__all__ = ["check_manifest", "usable", "newest", "commit", "remove_oldest", "beyond_limit", "read_files", "CheckedOnce", "check_python_rng",
           "check_numpy_rng", "check_torch_rng"]

log = logging.getLogger("ckptio")


def check_manifest(folder: Any, verify: str, *, required: bool) -> bool:
    """Check ``folder``'s files against its manifest (sizes; with ``verify="full"`` every byte's checksum) and raise
    a :class:`CheckpointCorruptError` naming the damage; ``False`` when there is no manifest and none is
    ``required`` (a folder the framework wrote itself).

    A link or a special file anywhere in the folder is refused first, manifest or not: the frameworks' own
    readers, which load some of these files, open paths without ckptio's confinement and would follow it; so is a
    ``torch.save`` archive whose members would inflate past its file, which their ``torch.load`` would inflate."""
    from ..formats.pt import check_archive
    from ..engine.manifest import MANIFEST_NAME, check_files, read_manifest

    files = list(folder.walk_files())
    odd = [rel for rel, entry in files if entry.kind != "file"]
    if odd:
        raise CheckpointCorruptError(f"{folder.display(odd[0])}: a link or special file inside a checkpoint "
                                     f"({len(odd)} in all); a checkpoint holds regular files only")
    for rel, _ in files:
        if rel.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")):
            check_archive(folder, rel)
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
        except OSError as exc:  # a folder that cannot be read is not usable either; the reason is kept
            skipped.append((path.name, f"{path}: cannot be read ({exc})"))
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
           metrics: dict[str, float] | None = None, counters: dict[str, Any] | None = None,
           name: str | None = None, sums: dict[str, str] | None = None) -> None:
    """Describe every file ``writer`` holds (size, CRC-32C read back) in a manifest and commit the folder.
    ``name``: the folder's (default: the local writer's final one); ``sums``: checksums the other ranks computed of
    the files they wrote (in a bucket, where this rank cannot read them back)."""
    from ..engine.manifest import MANIFEST_NAME, Manifest, software_versions

    files = writer.files()
    known = sums or {}
    sums = {rel: known[rel] if rel in known else writer.checksum_of(rel) for rel in files}
    manifest = Manifest(name=name or writer.final.name, step=step, epoch=epoch, world_size=world_size,
                        model_save_format="safetensors", states=states, files=files, metrics=metrics or {},
                        checksums=sums, versions=software_versions(), counters=counters or {})
    writer.commit((MANIFEST_NAME, manifest.to_json().encode()))


def remove_oldest(root: Path, name: re.Pattern[str], limit: int | None, *, keep: frozenset[str] = frozenset(),
                  check: Callable[[Path], None] | None = None, saved: str | None = None,
                  setting: str = "the limit") -> list[Path]:
    """At most ``limit`` complete numbered folders in ``root``, the oldest others deleted first (each hidden before it
    is removed); returns what was deleted.

    Only the folders ``check`` accepts (it raises a :class:`CheckpointError` for the others: the check a resume
    makes) are ranked and counted; a torn or damaged folder is neither counted as kept nor deleted. ``saved`` (the
    folder just written, already checked as it was committed), the newest complete folder and those in ``keep``
    are never deleted."""
    from ..storage.posix import remove_tree

    if not limit or limit <= 0:
        return []
    complete = []
    for _, path in reversed(_numbered(root, name)):
        if path.is_symlink() or not path.is_dir():
            continue
        if path.name != saved and check is not None:
            try:
                check(path)
            except (CheckpointError, OSError) as exc:  # not provably complete: left alone
                log.info("ckptio: %s is not a complete checkpoint, neither counted nor deleted (%s)", path.name, exc)
                continue
        complete.append(path)  # newest first
    names = beyond_limit([p.name for p in complete], limit, keep=keep, saved=saved)
    doomed = [p for p in reversed(complete) if p.name in names]
    for p in doomed:
        log.info("ckptio: deleting %s (%s=%d)", p.name, setting, limit)
        remove_tree(p)
    return doomed


def beyond_limit(complete: list[str], limit: int, *, keep: frozenset[str] = frozenset(),
                 saved: str | None = None) -> list[str]:
    """Which of the ``complete`` folders (newest first) go to keep at most ``limit``, oldest first: never ``saved``,
    the newest one or those in ``keep``."""
    if not limit or limit <= 0 or len(complete) <= limit:
        return []
    protected = {complete[0], saved, *keep} & set(complete)
    return [n for n in reversed(complete) if n not in protected][: len(complete) - max(limit, len(protected))]


def read_files(folder: Any, is_state: Callable[[str], bool]) -> None:
    """Read the files of ``folder`` (one without a manifest) as a load will, raising an error naming the first that
    is torn or unsafe: each ``.safetensors`` file's header against its size, each pickled state ``is_state`` names
    through ``torch.load(weights_only=True)`` (mapped, so every record of its archive must be present)."""
    from ..formats import pt as pt_format
    from ..formats.safetensors._reader import SafetensorsFile

    for name in sorted(e.name for e in folder.listdir() if e.kind == "file"):
        if name.endswith(".safetensors"):
            SafetensorsFile(folder, name).close()
        elif is_state(name):
            pt_format.load(folder.display(name), mmap=True)


class CheckedOnce:
    """``check`` remembered per folder for one run: a folder that passed is not read again until its entries change
    (its inode or modification time), so retention does not re-read every kept checkpoint at each save."""

    def __init__(self, check: Callable[[Path], None]) -> None:
        self.check = check
        self.passed: set[tuple[str, int, int]] = set()

    def __call__(self, path: Path) -> None:
        """Raise what ``check`` raises for ``path``, unless it passed before as it is now."""
        st = path.lstat()
        key = (str(path), st.st_ino, st.st_mtime_ns)
        if key not in self.passed:
            self.check(path)
            self.passed.add(key)


_MT_WORDS = 624


def _words(value: Any, where: object, what: str, count: int) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != count:
        raise CheckpointCorruptError(f"{where}: {what} must hold {count} words")
    for i, word in enumerate(value):
        as_int(word, where, f"{what}[{i}]", hi=(1 << 32) - 1)


def check_python_rng(value: Any, where: object, what: str) -> Any:
    """``value`` when it is a state ``random.setstate`` takes as it is (version 3, 624 32-bit words and an index in
    [0, 624], then ``None`` or a float); else an error naming ``where`` and ``what``."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise CheckpointCorruptError(f"{where}: {what} is not a (version, words, gauss) state")
    version, words, gauss = value
    as_int(version, where, f"{what} version", lo=3, hi=3)
    _words(words[:_MT_WORDS] if isinstance(words, (tuple, list)) else words, where, f"{what} words", _MT_WORDS)
    if len(words) != _MT_WORDS + 1:
        raise CheckpointCorruptError(f"{where}: {what} must hold {_MT_WORDS + 1} numbers, found {len(words)}")
    as_int(words[-1], where, f"{what} index", hi=_MT_WORDS)
    if gauss is not None:
        as_float(gauss, where, f"{what} gauss")
    return value


def check_numpy_rng(value: Any, where: object, what: str) -> Any:
    """``value`` when it is the legacy state ``numpy.random.set_state`` takes (``"MT19937"``, 624 ``uint32`` words, a
    position in [0, 624], a gauss flag and a float); else an error naming ``where`` and ``what``."""
    import numpy as np

    if not isinstance(value, (tuple, list)) or len(value) != 5 or not isinstance(value[0], str) or value[0] != "MT19937":
        raise CheckpointCorruptError(f"{where}: {what} is not a numpy MT19937 state")
    _, words, pos, has_gauss, gauss = value
    if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.shape != (_MT_WORDS,):
        raise CheckpointCorruptError(f"{where}: {what} must hold {_MT_WORDS} uint32 words")
    as_int(int(pos) if isinstance(pos, np.integer) else pos, where, f"{what} position", hi=_MT_WORDS)
    as_int(int(has_gauss) if isinstance(has_gauss, np.integer) else has_gauss, where, f"{what} gauss flag", hi=1)
    as_float(float(gauss) if isinstance(gauss, np.floating) else gauss, where, f"{what} gauss")
    return value


def check_torch_rng(value: Any, where: object, what: str, *, many: bool = False) -> Any:
    """``value`` when it is a generator state torch restores (a 1-d ``uint8`` tensor; with ``many``, a list of them,
    one per device, also accepted); the CPU generator's must have the size of this torch's."""
    import torch

    states = list(value) if many and isinstance(value, (list, tuple)) else [value]
    for state in states:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
            raise CheckpointCorruptError(f"{where}: {what} is not a byte tensor")
    if not many and value.numel() != torch.get_rng_state().numel():
        raise CheckpointCorruptError(f"{where}: {what} holds {value.numel()} bytes, this torch's CPU generator "
                                     f"{torch.get_rng_state().numel()}")
    return value
