"""What a restore makes of the checkpoints of other tools in a checkpoint folder: what ``ckptio list`` and
``inspect`` say of them.

The same detection as the restore's, so that the commands and a resume never disagree: a folder (or a file of a
format with :attr:`~ckptio.formats.registry.Format.step_files`, a Lightning ``.ckpt``) is another tool's checkpoint
when ``restore_from=`` it would be read as one (:func:`ckptio.adopt.foreign.is_foreign`), and it is the one the
automatic resume takes when the folder is a run of another tool that a resume continues
(:func:`ckptio.adopt.foreign.foreign_run`: a DeepSpeed run, the checkpoint its ``latest`` names) and no ckptio
checkpoint is there. NeMo AutoModel's step directories are adopted as step directories (:mod:`.automodel`) and
listed as such.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..formats import registry
from ..storage.confined import Folder
from .foreign import foreign_run, is_foreign

__all__ = ["ForeignCheckpoint", "foreign_checkpoints"]


@dataclass
class ForeignCheckpoint:
    """One checkpoint another tool wrote in a checkpoint folder, as a restore sees it."""

    name: str
    """Its name in the folder."""
    format: str
    """The registered format that reads it."""
    label: str
    """What it is (``DeepSpeed ZeRO-2``)."""
    step: int | None
    carries: str
    """What a restore from it loads (``fp32 master weights, Adam state, LR scheduler``; ``weights only``)."""
    resumed: bool = False
    """The automatic resume takes it (when the folder holds no usable ckptio checkpoint)."""
    problem: str | None = None
    """Why it cannot be read (``None``: it can)."""

    @property
    def status(self) -> str:
        """One line: what it is and what a restore does with it."""
        if self.problem is not None:
            return f"{self.label}, unreadable: {self.problem}"
        step = f", step {self.step}" if self.step is not None else ""
        how = "resumable" if self.resumed or self.format_resumes else "restore_from= it loads"
        return f"{self.label}{step}, {how} ({self.carries})"

    @property
    def format_resumes(self) -> bool:
        return registry.get(self.format).resumes_runs

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def foreign_checkpoints(root: Path, skip: set[str] = frozenset()) -> list[ForeignCheckpoint]:  # type: ignore[assignment]
    """Every checkpoint of another tool directly in the local folder ``root`` (names in ``skip`` aside: ckptio's
    own step directories), by name; ``[]`` for a bucket or a folder that cannot be listed."""
    if not isinstance(root, Path) or not root.is_dir():
        return []
    try:
        entries = Folder(root).listdir()  # links are listed as links: never a checkpoint
    except (OSError, CheckpointError):
        return []
    resumed = _resumed(root)
    found = []
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name in skip or entry.kind not in ("dir", "file"):
            continue
        path = root / entry.name
        if not is_foreign(str(path)):
            continue
        fmt = registry.detect(path)
        if entry.kind == "file" and not fmt.step_files:
            continue
        found.append(_summary(fmt, path, entry.name == resumed))
    return found


def _resumed(root: Path) -> str | None:
    """The name in ``root`` of the checkpoint the automatic resume takes when there is no ckptio one."""
    run, _ = foreign_run(root)
    if run is None:
        return None
    try:
        where = Path(registry.detect(run).checkpoint_summary(run).get("checkpoint", ""))
    except CheckpointError:
        return None
    try:
        return where.relative_to(root).parts[0]
    except (ValueError, IndexError):
        return None


def _summary(fmt: Any, path: Path, resumed: bool) -> ForeignCheckpoint:
    try:
        info = fmt.checkpoint_summary(path)
    except (CheckpointError, OSError) as exc:
        return ForeignCheckpoint(path.name, fmt.name, fmt.summary.split(" (")[0], None, "", resumed, str(exc))
    return ForeignCheckpoint(path.name, fmt.name, info["label"], info.get("step"), info["carries"], resumed)
