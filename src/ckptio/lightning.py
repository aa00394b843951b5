"""Lightning's ``Trainer`` saves and loads through ckptio: ``Trainer(plugins=[CkptioCheckpointIO()])``.

Everything else stays Lightning's: ``ModelCheckpoint`` decides when to save, which ``top_k`` to keep, what
``last.ckpt`` is, and ``Trainer.fit(ckpt_path="last" | path)`` finds and restores the checkpoint; this plugin
changes what a checkpoint *is*. Each path Lightning names (``epoch=1-step=8.ckpt``, ``last.ckpt``) becomes a
ckptio folder instead of one pickle::

    epoch=1-step=8.ckpt/
    ├── model/shard-00001-model-00001-of-00001.safetensors   # the LightningModule's state_dict, by its keys
    ├── state/shard-00001-state-00001-of-00001.safetensors   # every other tensor (optimizer moments, metrics)
    ├── trainer_state.pt        # the rest of Lightning's dict (loops, callbacks, schedulers, hyper-parameters),
    │                           # tensors left out; read back with torch.load(weights_only=True)
    └── manifest.json           # written last: sizes and CRC-32C of every file

A save is written under a hidden name and renamed into place once every file is durable (an existing
``last.ckpt`` is exchanged atomically), so a crash never leaves a torn checkpoint under a name Lightning
would resume from. A load checks the manifest and every byte's checksum before handing the dict to Lightning,
and nothing in it is unpickled beyond ``weights_only``. A path that is a Lightning ``.ckpt`` *file* (a run
checkpointed before the switch) loads too, through the same safe loader. ``async_save=True`` copies the
tensors into reusable host buffers and writes in a background thread; the next save, a load, a removal and
the end of ``fit`` wait for it. Beside a torn folder (no manifest, damaged files) Lightning cannot tell: the plugin
never resumes from one, never lets it count among ``save_top_k``, and never deletes the checkpoint it just wrote nor
the newest complete one (:mod:`ckptio.integrations.lightning_keep`). Constructing the plugin also lets Lightning's loads outside
``fit`` (``LitModel.load_from_checkpoint(best_model_path)``, a ``Trainer`` without the plugin) read these folders
(:mod:`ckptio.integrations.lightning_load`; :func:`install_loader` does it without a plugin).

Single device and DDP (rank 0 writes, as Lightning arranges) are supported; strategies that write their own
sharded checkpoints (FSDP, DeepSpeed) do not go through a ``CheckpointIO`` for the weights, and a state dict
holding sharded tensors is refused.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, MissingDependencyError
from .integrations import lightning_load
from .integrations import lightning_keep
from .integrations.lightning_keep import last_checkpoint, s3_location as _s3
from .integrations.save_numbers import SaveNumbers
from .storage.parse import MAX_DEPTH, check_depth, parsing

try:
    from pytorch_lightning.plugins.io import CheckpointIO
except ImportError as _missing:  # the integration is an extra
    raise MissingDependencyError("ckptio.lightning needs PyTorch Lightning: pip install 'ckptio[lightning]'") from _missing

from .integrations import lightning_audit  # noqa: E402 (needs Lightning, checked above)

__all__ = ["CkptioCheckpointIO", "CkptioMetrics", "CkptioPreemption", "write_checkpoint", "read_checkpoint", "last_checkpoint", "install_loader",
           "uninstall_loader"]

log = logging.getLogger("ckptio")

from .storage.objstore.fsspec_fs import register as _register_objects  # noqa: E402
from .integrations.lightning_metrics import CkptioMetrics  # noqa: E402
from .integrations.lightning_preemption import CkptioPreemption  # noqa: E402

_register_objects()  # ModelCheckpoint(dirpath="s3://...", gs://, az://) lists and times its folder through fsspec

MODEL_DIR, STATE_DIR, TRAINER_STATE = "model", "state", "trainer_state.pt"
_FORMAT = "lightning-checkpoint/1"
_REF = "__ckptio_tensor__"
_META_BYTES = 256 << 20  # trainer_state.pt holds no tensor: loops, callbacks, hyper-parameters


class CkptioCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that writes each checkpoint as a committed, checksummed ckptio folder.

    ``async_save``: stage the tensors into host buffers (reused from save to save) and write in the background;
    ``save_checkpoint`` returns once the copy is taken. ``verify``: ``"full"`` (every byte's checksum, the
    default) or ``"size"`` when a checkpoint is loaded. ``install_loader``: let Lightning's loads outside ``fit``
    read ckptio folders, every byte checked (:func:`install_loader`).
    """

    def __init__(self, *, async_save: bool = False, verify: str = "full", install_loader: bool = True) -> None:
        if verify not in ("full", "size"):
            raise ValueError(f"verify must be 'full' or 'size', not {verify!r}")
        super().__init__()
        self.async_save, self.verify = async_save, verify
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stager: Any = None
        self._swept: set[Any] = set()
        self._written: Any = None  # the checkpoint saved last: never deleted
        self._audit: Any = None  # the run's record and resume audit (lightning_audit)
        self.numbers = SaveNumbers()
        """Each save's numbers: add a listener (``numbers.listeners``), or let :class:`CkptioMetrics` log them."""
        if install_loader:
            lightning_load.install(read_checkpoint, self)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` as the folder ``path`` (in the background with ``async_save``)."""
        if storage_options is not None:
            raise TypeError(f"CkptioCheckpointIO takes no storage_options (got {storage_options!r})")
        self.wait()
        self._sweep(path)
        lightning_audit.saved(self, checkpoint, path)  # the resume audit records the steps after it
        self._written = str(path) if _s3(path) is not None else Path(os.path.abspath(path))
        step, folder = _int(checkpoint.get("global_step")), str(path) if _s3(path) is not None else Path(path)
        timer = self.numbers.start(step=step, folder=folder)
        if not self.async_save:
            timer.wrap(lambda: write_checkpoint(checkpoint, path), background=False)()  # type: ignore[misc]
            return timer.returned()
        from .engine.staging import Stager

        self._stager = self._stager or Stager()
        staged = self._stager.stage(checkpoint)  # training may change its tensors as soon as this returns
        commit = timer.wrap(lambda: write_checkpoint(staged, path), background=True)

        def write() -> None:
            try:
                commit()  # type: ignore[misc]
            except BaseException as exc:  # raised on the training thread by the next call
                self._error = exc

        self._thread = threading.Thread(target=write, name="ckptio-lightning-save", daemon=False)
        self._thread.start()
        timer.returned()

    def _sweep(self, path: Any) -> None:
        """Once per folder, before the first save there: remove what a save or a removal killed mid-way left
        behind (on S3, a replacement cut short is finished first)."""
        s3 = _s3(path)
        parent = str(s3[0].root) if s3 is not None else Path(path).absolute().parent
        if parent in self._swept:
            return
        self._swept.add(parent)
        if s3 is not None:
            from .storage.objstore.replace import recover

            recover(s3[0])
        else:
            from .storage.posix import sweep_leftovers

            sweep_leftovers(parent)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        """The checkpoint at ``path`` (a ckptio folder, or a Lightning ``.ckpt`` file), checked before it is
        returned. When ``path`` is a ``last`` checkpoint that cannot be read (``fit(ckpt_path="last")`` picks the one
        modified last, torn or not), the newest other ``last`` one that can is read instead. ``ModelCheckpoint``
        states in it no longer count torn folders among the checkpoints kept."""
        from .integrations.lightning_keep import forget_torn, resume_instead

        self.wait()
        try:
            checkpoint = read_checkpoint(path, verify=self.verify)
        except CheckpointError as exc:
            if _s3(path) is not None:
                raise
            from pytorch_lightning.callbacks import ModelCheckpoint

            checkpoint = resume_instead(Path(path), exc, lambda p: read_checkpoint(p, verify=self.verify),
                                        last_name=ModelCheckpoint.CHECKPOINT_NAME_LAST,
                                        suffix=ModelCheckpoint.FILE_EXTENSION)
        forget_torn(checkpoint)
        lightning_audit.loaded(self, checkpoint, path)  # fit resumes from it: the steps after it are audited
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint Lightning no longer keeps (``save_top_k``), hidden first so a crash never leaves
        half of it under its name; refused, with a warning naming it, for the checkpoint just written and the newest
        complete one in its folder."""
        from .integrations.lightning_keep import keep_reason
        from .storage.posix import remove_tree

        self.wait()
        s3 = _s3(path)
        if s3 is not None:
            if str(path) == self._written:
                log.warning("ckptio: not deleting %s: it is the checkpoint just written", path)
            else:
                s3[0].remove_step(s3[1])
            return
        target = Path(path)
        why = keep_reason(target, self._written)
        if why is not None:
            log.warning("ckptio: not deleting %s: %s", target, why)
        elif target.is_dir() and not target.is_symlink():
            remove_tree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()

    def wait(self) -> None:
        """Block until the background save (if any) is durable and the run's record (if any) is on disk with every
        event so far; raise the save's error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._audit is not None:
            self._audit.flush()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background save of a Lightning checkpoint failed: {error}") from error

    def teardown(self) -> None:
        """Lightning calls this at the end of ``fit``: the last background save finishes first."""
        self.wait()


def install_loader() -> None:
    """Let ``LitModel.load_from_checkpoint(path)``, ``LightningDataModule.load_from_checkpoint(path)`` and a
    ``Trainer`` without the plugin read a ckptio checkpoint folder through :func:`read_checkpoint` (every byte's
    checksum checked); other paths stay Lightning's. The plugin's construction does this; idempotent."""
    lightning_load.install(read_checkpoint)


def uninstall_loader() -> None:
    """Undo :func:`install_loader`: Lightning's loads outside ``fit`` are Lightning's own again."""
    lightning_load.uninstall()


# ------------------------------------------------------------------------------------------------- writing
def write_checkpoint(checkpoint: dict[str, Any], path: str | Path) -> str | Path:
    """Write Lightning's checkpoint dict as a committed ckptio folder at ``path`` (replacing one that is there): a
    local path, or ``s3://bucket/prefix/NAME``."""
    from .storage import LocalFolderWriter

    parts = _split(checkpoint)  # checked before anything is created
    s3 = _s3(path)
    if s3 is not None:
        from .storage.objstore.replace import write_folder

        storage, name = s3
        write_folder(storage, name, lambda writer: _write_into(checkpoint, parts, writer, name))
        return str(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_into(checkpoint, parts, LocalFolderWriter.create(path), path.name)
    return path


def _split(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], bytes]:
    """(the model's tensors, every other tensor, the rest of the dict as bytes), refusing what cannot be written."""
    from .formats import pt as pt_format

    weights = checkpoint.get("state_dict")
    if not isinstance(weights, dict):
        raise TypeError("a Lightning checkpoint has a 'state_dict' mapping; this one does not")
    model = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    tensors: list[torch.Tensor] = []
    values = {k: v for k, v in weights.items() if not isinstance(v, torch.Tensor)}
    rest = {k: values if k == "state_dict" else v for k, v in checkpoint.items()}  # Lightning's order kept
    try:  # what could not be read back is refused before anything is written (a tensor's mark and the
        check_depth(rest, "Lightning's checkpoint", max_depth=MAX_DEPTH - 2)  # trainer state add 2 levels)
    except CheckpointCorruptError as exc:
        raise ValueError(str(exc)) from None
    skeleton = _without_tensors(rest, tensors)
    for t in list(model.values()) + tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"CkptioCheckpointIO writes plain tensors; this checkpoint holds a {type(t).__name__} "
                            "(a sharded strategy writes its own checkpoints)")
    data = pt_format.to_bytes({"format": _FORMAT, "skeleton": skeleton, "model_keys": list(model),
                               "state_dict_keys": list(weights), "tensors": len(tensors)}, "Lightning's checkpoint")
    return model, tensors, data


def _write_into(checkpoint: dict[str, Any], parts: tuple[dict[str, torch.Tensor], list[torch.Tensor], bytes],
                writer: Any, name: str) -> None:
    """Write the folder with ``writer`` and commit it with its manifest."""
    from .formats.safetensors import sharded as safetensors_sharded
    from .engine.manifest import MANIFEST_NAME, Manifest, StateEntry, software_versions

    model, tensors, data = parts
    try:
        sums = safetensors_sharded.save(model, writer, MODEL_DIR, rank=0, world_size=1)
        sums.update(safetensors_sharded.save({f"{i:06d}": t for i, t in enumerate(tensors)}, writer, STATE_DIR,
                                             rank=0, world_size=1, stem="state"))
        sums[TRAINER_STATE] = writer.write_bytes(TRAINER_STATE, data)
        sums[lightning_keep.NOTE] = writer.write_bytes(lightning_keep.NOTE, lightning_keep.NOTE_TEXT.encode())
        states = {"model": StateEntry("model", "safetensors", MODEL_DIR),
                  "lightning": StateEntry("object", "pt", TRAINER_STATE)}
        manifest = Manifest(name=name, step=_int(checkpoint.get("global_step")), epoch=_int(checkpoint.get("epoch")),
                            world_size=1, model_save_format="safetensors", states=states, files=writer.files(),
                            checksums=sums, metrics=lightning_keep.monitored(checkpoint), versions=software_versions())
        writer.commit((MANIFEST_NAME, manifest.to_json().encode()))
    except BaseException:
        writer.abort()
        raise


def _int(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def _without_tensors(value: Any, out: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``{"__ckptio_tensor__": i}`` (a plain dict: it loads with
    ``weights_only``), the tensor appended to ``out`` at ``i``; containers are rebuilt with their own types."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return {_REF: len(out) - 1}
    if isinstance(value, dict) and set(value) == {_REF}:
        raise TypeError(f"a Lightning checkpoint holds a dict whose only key is {_REF!r}, which ckptio uses to mark "
                        "where a tensor was")
    if isinstance(value, dict):
        return type(value)((k, _without_tensors(v, out)) for k, v in value.items()) if type(value) is not dict \
            else {k: _without_tensors(v, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_tensors(v, out) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_without_tensors(v, out) for v in value)
    return value


# ------------------------------------------------------------------------------------------------- reading
def read_checkpoint(path: str | Path, *, verify: str = "full") -> dict[str, Any]:
    """Lightning's checkpoint dict from a ckptio folder (manifest, sizes and checksums checked first) or from a
    Lightning ``.ckpt`` file (``weights_only``)."""
    from .formats.lightning import read_lightning
    from .formats.safetensors.sharded import SafetensorsSource
    from .integrations.framework_dirs import check_manifest
    from .storage.confined import Folder

    s3 = _s3(path)
    if s3 is not None:
        folder = _s3_folder(*s3)
        if folder is None:
            return _read_lightning_object(str(path))
    else:
        path = Path(path)
        if path.is_file():
            return read_lightning(path)
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{path}: no such checkpoint")
        folder = Folder(path)
    check_manifest(folder, verify, required=True)
    meta, where = _read_meta(folder), folder.display(TRAINER_STATE)
    weights = _read_all(SafetensorsSource(folder.sub(MODEL_DIR)), meta["model_keys"], folder.display(MODEL_DIR))
    tensors = _read_state(folder, meta["tensors"], where)
    with parsing(where, "Lightning's trainer state"):
        out = _with_tensors(meta["skeleton"], tensors, where)
    values = out.get("state_dict")
    if not isinstance(values, dict) or set(meta["state_dict_keys"]) != set(weights) | set(values):
        raise CheckpointCorruptError(f"{where}: its state_dict keys do not match the tensors in "
                                     f"{folder.display(MODEL_DIR)}")
    out["state_dict"] = {k: weights[k] if k in weights else values[k] for k in meta["state_dict_keys"]}
    return out


def _read_meta(folder: Any) -> dict[str, Any]:
    """``trainer_state.pt``, every field checked: the format, the skeleton (a mapping nested at most
    :data:`~ckptio.storage.parse.MAX_DEPTH` deep), the key lists (distinct strings), the tensor count."""
    from .formats import pt as pt_format
    from .storage.parse import as_int, field

    where = folder.display(TRAINER_STATE)
    with parsing(where, "Lightning's trainer state"):
        meta = pt_format.load_from(folder, TRAINER_STATE, max_size=_META_BYTES)
        if field(meta, "format", str, where) != _FORMAT:
            raise CheckpointCorruptError(f"{where}: not a Lightning checkpoint written by ckptio "
                                         f"(format {meta['format']!r:.60})")
        field(meta, "skeleton", dict, where)
        check_depth(meta, where)
        for key in ("model_keys", "state_dict_keys"):
            names = field(meta, key, list, where)
            odd = next((n for n in names if type(n) is not str), None)
            if odd is not None or len(set(names)) != len(names):
                raise CheckpointCorruptError(f"{where}: {key!r} must list distinct names, found "
                                             f"{'a ' + type(odd).__name__ if odd is not None else 'one twice'}")
        as_int(field(meta, "tensors", int, where), where, "'tensors'")
    return meta


def _read_state(folder: Any, count: int, where: object) -> list[torch.Tensor]:
    """The ``count`` tensors of ``state/`` by position (``count`` is checked against the tensors there first)."""
    from .formats.safetensors.sharded import SafetensorsSource

    if count == 0:
        return []
    tensors = _read_all(SafetensorsSource(folder.sub(STATE_DIR)), count, folder.display(STATE_DIR), where)
    return list(tensors.values())


def _s3_folder(storage: Any, name: str) -> Any:
    """The folder to read for ``name`` in ``storage``: itself, or the complete copy a replacement cut short left (the
    next save finishes that replacement); ``None`` when ``name`` is an object (a Lightning ``.ckpt`` file)."""
    from .storage.objstore.replace import complete_copy

    kind = storage.folder().kind(name)
    if kind == "file":
        return None
    copy = complete_copy(storage, name)
    if copy is not None:
        log.info("ckptio: %s was being replaced when its writer stopped; reading the complete new copy %s",
                 storage.root / name, copy)
        return storage.folder(copy)
    if kind is None:
        raise CheckpointNotFoundError(f"{storage.root / name}: no such checkpoint")
    return storage.folder(name)


def _read_lightning_object(url: str) -> dict[str, Any]:
    """A Lightning ``.ckpt`` file in an object store, copied to a temporary folder and read like a local one."""
    import tempfile

    from .formats.lightning import read_lightning
    from .storage import open_storage
    from .storage.transfer import copy_file_down

    parent, _, name = url.rpartition("/")
    with tempfile.TemporaryDirectory(prefix="ckptio-lightning-") as tmp:
        return read_lightning(copy_file_down(open_storage(parent).folder(), name, Path(tmp) / name))


def _read_all(source: Any, keys: list[str] | int, where: object, told: object = None) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of ``source`` (at ``where``); ``keys`` as a number ``n`` (what ``told`` says) is the
    ``n`` tensors named by position, and must be the number ``source`` holds before a name is made for them."""
    try:
        index = source.index()
        if isinstance(keys, int):
            if keys != len(index):
                raise CheckpointCorruptError(f"{told}: names {keys} tensors, {where} holds {len(index)}")
            keys = [f"{i:06d}" for i in range(keys)]
        missing = [k for k in keys if k not in index]
        if missing:
            raise CheckpointCorruptError(f"{where}: holds no tensor {missing[0]!r} ({len(missing)} missing)")
        return {k: source.read(k) for k in keys}
    finally:
        source.close()


def _with_tensors(value: Any, tensors: list[torch.Tensor], where: object) -> Any:
    if isinstance(value, dict):
        if set(value) == {_REF}:
            i = value[_REF]
            if type(i) is not int or not 0 <= i < len(tensors):
                raise CheckpointCorruptError(f"{where}: a tensor reference {i!r:.20} outside the {len(tensors)} stored")
            return tensors[i]
        rebuilt = {k: _with_tensors(v, tensors, where) for k, v in value.items()}
        return rebuilt if type(value) is dict else type(value)(rebuilt.items())
    if isinstance(value, list):
        return [_with_tensors(v, tensors, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_with_tensors(v, tensors, where) for v in value)
    return value

