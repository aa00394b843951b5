"""Background saves for the framework integrations whose frameworks save synchronously:
``CkptioTrainer(..., async_save=True)`` and ``CkptioAccelerator(..., async_save=True)``.

A save runs in two parts, on every rank at the same point of the training loop:

* on the training thread, :meth:`FolderSaves.wait` for the save in flight (its failure is raised here), then the
  framework's small files that must show this instant (RNG states, its counters) are written into the hidden
  folder and every tensor of the model, optimizer and scheduler states is copied into
  :class:`~ckptio.engine.staging.Stager`'s host buffers (reused from save to save), so training may go on changing them;
* on :class:`~ckptio.engine.background.BackgroundWriter`'s thread, every rank writes its part of the hidden folder from
  those copies; one collective round on the writer's own process group (never the training loop's) tells every
  rank whether all parts are in; only then does rank 0 commit (fsync, manifest, rename) and delete what retention
  no longer keeps, and a second round tells every rank whether that worked.

A kill at any instant of the background part leaves the previous checkpoint the newest complete one (the hidden
folder is swept at the next run's first save); a failure on any rank is raised on every rank's training thread at
its next save, load or wait.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _dist, _faults
from ..engine.background import BackgroundWriter
from ..engine.staging import Stager

__all__ = ["FolderSaves", "WRITING", "reached_writing"]

log = logging.getLogger("ckptio")

WRITING = "framework.background_write"
"""The fault point (:mod:`ckptio._faults`) a background save reaches on every rank while it writes its part: after
the model's files, before the optimizer's."""


class FolderSaves:
    """The background saves of one framework integration: its staging buffers and its writer thread. Every method is
    called from the training thread; :meth:`start` and :meth:`wait` at the same points on every rank."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._stager = Stager()
        self._writer: BackgroundWriter | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._writer is not None and self._writer.in_flight

    def wait(self) -> Path | None:
        """Block until the save in flight is committed (and its retention done) on every rank; raise its failure.
        Returns the folder it wrote (``None``: nothing was in flight)."""
        return self._writer.wait() if self._writer is not None else None

    def stage(self, models: list[dict[str, Any]], modules: list[Any], **others: Any) \
            -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Host copies, taken now, of each of ``models`` (state dicts, each keeping its mapping type; its tensors that
        share storage still share one buffer, as the frameworks' writers drop tied weights by storage) and of each
        of ``others`` (nested states). The frozen parameters of ``modules`` (``requires_grad=False``: no optimizer
        changes them, as a fine-tuned model's base weights under an adapter) are handed on as they are, not copied."""
        frozen = {_storage_key(p) for module in modules for p in module.parameters() if not p.requires_grad}
        aliases: list[dict[str, str]] = []
        unique: list[dict[str, Any]] = []
        for model in models:
            first: dict[tuple[Any, ...], str] = {}
            aliases.append({})
            unique.append({})
            for name, value in model.items():
                key = _storage_key(value)
                if key is not None and key in frozen:
                    aliases[-1][name] = f"\0{name}"
                    continue
                if key is not None and key in first:
                    aliases[-1][name] = first[key]
                    continue
                if key is not None:
                    first[key] = name
                unique[-1][name] = value
        staged = self._stager.stage({"models": unique, "others": others})
        out = []
        for model, alias, copies in zip(models, aliases, staged["models"]):
            out.append(type(model)())
            for name in model:
                kept = alias.get(name, name)
                out[-1][name] = model[name] if kept.startswith("\0") else copies[kept]
        return out, staged["others"]

    def start(self, final: Path, write: Callable[[], Any], commit: Callable[[], None] | None,
              gathered: Callable[[list[Any]], None] | None = None) -> None:
        """Write and commit ``final`` in the background: ``write`` (this rank's part) on every rank, then, once every
        rank's part is in, ``commit`` (given on the rank that commits, ``None`` elsewhere). ``gathered``: handed
        every rank's result of ``write`` (indexed by rank; small and picklable) in the same round, before
        ``commit``. ``write`` runs no collective (a rank that failed before it would not be there). A collective the
        first time (the writer's process group is created)."""
        self.wait()
        if self._writer is None:
            self._writer = BackgroundWriter(log, self.what)

        def work() -> None:
            _, parts = _dist.agree(f"writing {final}", write, share=None if gathered is None else lambda part: part)
            if gathered is not None:
                gathered(parts)
            _dist.run_collectively(f"committing {final}", commit if commit is not None else lambda: None)

        self._writer.start(final, work)


def _storage_key(value: Any) -> tuple[Any, ...] | None:
    """What makes two tensors the same tensor (the same bytes, seen the same way); ``None`` for anything else."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), tuple(value.stride()),
            value.dtype, value.device)


def reached_writing() -> None:
    """Mark :data:`WRITING` (a test may stop the process here)."""
    _faults.point(WRITING)
