"""Where a DeepSpeed checkpoint is, from names alone: a tag folder, a run folder, an HF Trainer output.

``engine.save_checkpoint(dir)`` writes ``dir/<tag>/`` (``global_stepN`` by default) and a text file ``dir/latest``
naming the tag; ``ds_to_universal`` writes ``<tag>_universal/`` and ``latest_universal``. The HF Trainer puts each
DeepSpeed checkpoint inside its own ``checkpoint-N/``. A tag folder holds ``mp_rank_00_model_states.pt`` (stages
0-2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (stage 3), with ``*_optim_states.pt`` per data-parallel rank,
or a ``zero/`` folder of per-parameter files (universal).

The newest checkpoint of a folder is the one ``latest`` names; without it, the highest ``global_stepN``. A
``latest`` that names no tag folder of its own folder is an error naming it, never a silent fall back. Like every
reader's, what lies below the folder named is read through real folders only: a ``global_stepN`` or
``checkpoint-N`` that is a symbolic link (to a folder outside, say) is refused by name (logged) and the next one
taken; a folder holding only such links is an error naming them.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable

from ...errors import CheckpointCorruptError, CheckpointNotFoundError, NoUsableCheckpointError
from ...storage.confined import Folder

__all__ = ["is_tag_dir", "is_run", "is_universal", "find_tag_dir", "MODEL_FILES", "step_of"]

MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""The model-states file of rank 0: stages 0-2 (and universal folders), stage 3."""
POINTERS = ("latest", "latest_universal")
_STEP = re.compile(r"global_step(\d+)(_universal)?")
_HF = re.compile(r"checkpoint-(\d+)")
_MAX_POINTER = 4096
_log = logging.getLogger("ckptio")


def is_tag_dir(path: Path) -> bool:
    """Whether ``path`` is one DeepSpeed checkpoint (a tag folder), by the names of its files (regular files, not
    links: what its reader opens)."""
    try:
        folder = Folder(path)
        return path.is_dir() and any(folder.kind(name) == "file" for name in MODEL_FILES)
    except (OSError, CheckpointCorruptError, CheckpointNotFoundError):
        return False


def _numbered(path: Path, pattern: "re.Pattern[str]", keep: "Callable[[Path], bool]",
              links: list[Path] | None = None) -> list[tuple[int, Path]]:
    """The folders in ``path`` whose names match ``pattern`` (its first group a number) and that ``keep`` accepts,
    by number; at the same step, an original tag ranks above its universal copy. A link of a matching name is never
    one of them: it is added to ``links``."""
    try:
        entries = Folder(path).listdir()
    except (OSError, CheckpointCorruptError, CheckpointNotFoundError):
        return []
    out = []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and entry.kind == "link":
            if links is not None:
                links.append(path / entry.name)
        elif m and entry.kind == "dir" and keep(path / entry.name):
            universal = m.groups()[1:] and m.group(2)
            out.append((int(m.group(1)) * 2 + (0 if universal else 1), path / entry.name))
    return sorted(out)


def _steps(path: Path, links: list[Path] | None = None) -> list[tuple[int, Path]]:
    return _numbered(path, _STEP, is_tag_dir, links)


def _hf_checkpoints(path: Path, links: list[Path] | None = None) -> list[tuple[int, Path]]:
    return _numbered(path, _HF, lambda e: any(Folder(e).kind(p) == "file" for p in POINTERS) or bool(_steps(e)),
                     links)


def is_run(path: Path) -> bool:
    """Whether ``path`` is, or holds, DeepSpeed checkpoints (names only: nothing is read)."""
    if is_tag_dir(path):
        return True
    if not path.is_dir():
        return False
    if any((path / p).is_file() for p in POINTERS) and any(e.is_dir() for e in path.iterdir()):
        return True
    links: list[Path] = []  # a run whose checkpoints are links is one: its reader refuses them by name
    return bool(_steps(path, links) or _hf_checkpoints(path, links) or links)


def is_universal(path: Path) -> bool:
    """Whether ``path`` is a universal folder or a run folder whose newest checkpoint is one (names only)."""
    if is_tag_dir(path):
        return (path / "zero").is_dir() and not any(path.glob("*optim_states.pt"))
    return path.is_dir() and (path / "latest_universal").is_file() and not (path / "latest").is_file()


def _pointer(path: Path, name: str) -> Path:
    """The tag folder the pointer file ``name`` names, inside ``path``."""
    folder = Folder(path)
    tag = folder.read_text(name, max_size=_MAX_POINTER).strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\0" in tag:
        raise CheckpointCorruptError(f"{path / name}: names {tag[:80]!r}, not a checkpoint folder beside it")
    if folder.kind(tag) != "dir" or not is_tag_dir(path / tag):
        raise CheckpointCorruptError(f"{path / name}: names {tag!r}, but {path / tag} is not a DeepSpeed checkpoint "
                                     f"(no {' or '.join(MODEL_FILES)})")
    return path / tag


def find_tag_dir(path: Path) -> Path:
    """The DeepSpeed checkpoint ``path`` is or holds: itself, the tag ``latest`` names, else the highest
    ``global_stepN``; in an HF Trainer output folder, that of the highest ``checkpoint-N``."""
    if is_tag_dir(path):
        return path
    folder = Folder(path)
    for name in POINTERS:
        if folder.kind(name) in ("file", "link"):  # a link is refused by the read
            return _pointer(path, name)
    links: list[Path] = []
    steps = _steps(path, links)
    hf = _hf_checkpoints(path, links) if not steps else []
    for link in links:
        _log.warning("%s: a symbolic link, refused (a checkpoint is read only through real folders below the one "
                     "named)%s", link, "; taking the newest real one" if steps or hf else "")
    if steps:
        return steps[-1][1]
    if hf:
        return find_tag_dir(hf[-1][1])
    if links:
        raise NoUsableCheckpointError(f"{path}: its DeepSpeed checkpoints {[p.name for p in links][:3]} are symbolic "
                                      "links, refused: a checkpoint is read only through real folders below the one "
                                      "named", [(str(p), "a symbolic link") for p in links])
    raise CheckpointNotFoundError(f"{path}: no DeepSpeed checkpoint (no {' or '.join(POINTERS)} file, global_stepN "
                                  "folder or checkpoint-N folder holding one)")


def step_of(tag_dir: Path) -> int | None:
    """The step a tag folder's name says (``global_step3`` → 3), else ``None``."""
    m = _STEP.fullmatch(tag_dir.name)
    return int(m.group(1)) if m else None
