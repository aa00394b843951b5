"""Lightning's loads outside ``fit`` read a ckptio checkpoint folder: ``LitModel.load_from_checkpoint(path)``,
``LightningDataModule.load_from_checkpoint(path)`` and a ``Trainer`` without the plugin (``trainer.test(
ckpt_path=path)``, ``validate``, ``predict``, ``fit``).

Those do not ask a ``CheckpointIO`` plugin: the classmethods call ``pytorch_lightning.core.saving.pl_load`` and
Lightning's default ``TorchCheckpointIO`` calls ``lightning_fabric.plugins.io.torch_io.pl_load``; both are
``lightning_fabric.utilities.cloud_io._load``, which opens the path as one file and ``torch.load``s it (a folder
raises ``IsADirectoryError``). No file a folder could hold makes ``open`` work, so :func:`install` rebinds those two
names to a router: a path that is a folder (local, or ``s3://`` when it is no object) is read by ckptio (manifest,
sizes and every byte's checksum checked, nothing unpickled beyond ``weights_only``; a failure is a ckptio error
naming the file), its tensors placed as ``map_location`` says; anything else (a ``.ckpt`` file, a URL, a stream)
goes to Lightning's own function unchanged. :func:`uninstall` puts Lightning's back.

``CkptioCheckpointIO()`` installs the router when it is constructed (``install_loader=False`` opts out);
``ckptio.lightning.install_loader()`` installs it in a script that loads without constructing the plugin. Before a
routed read, every live plugin's background save finishes.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["install", "uninstall", "installed", "TARGETS"]

log = logging.getLogger("ckptio")

# the modules whose ``pl_load`` Lightning's loads outside ``fit`` call (the same in Lightning 2.4 to 2.6)
TARGETS = ("pytorch_lightning.core.saving", "lightning_fabric.plugins.io.torch_io")
_NAME = "pl_load"

_lock = threading.Lock()
_replaced: dict[str, Callable[..., Any]] = {}  # module -> what its pl_load was before install
_reader: list[Callable[[Any], dict[str, Any]]] = []
_savers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # live plugins, whose background saves a load waits for


def install(read: Callable[[Any], dict[str, Any]], saver: Any = None) -> None:
    """Route Lightning's checkpoint loads outside ``fit`` through ``read`` for folders (idempotent); ``saver``, an
    object with ``wait()``, is waited for before each routed read while it lives."""
    with _lock:
        if saver is not None:
            _savers.add(saver)
        _reader[:] = [read]
        for name in TARGETS:
            if name in _replaced:
                continue
            module = importlib.import_module(name)
            current = getattr(module, _NAME, None)
            if current is None:
                log.warning("ckptio: %s has no %s; Lightning's loads there do not read ckptio folders", name, _NAME)
                continue
            _replaced[name] = current
            setattr(module, _NAME, _router(current))


def uninstall() -> None:
    """Give Lightning its own ``pl_load`` back where :func:`install` replaced it (a name rebound since by someone
    else is left as it is)."""
    with _lock:
        for name, original in list(_replaced.items()):
            module = importlib.import_module(name)
            if getattr(getattr(module, _NAME, None), "_ckptio_original", None) is original:
                setattr(module, _NAME, original)
            del _replaced[name]


def installed() -> bool:
    """Whether Lightning's loads outside ``fit`` currently read ckptio folders."""
    return any(getattr(getattr(importlib.import_module(n), _NAME, None), "_ckptio_original", None) is not None
               for n in TARGETS)


def _router(original: Callable[..., Any]) -> Callable[..., Any]:
    def pl_load(path_or_url: Any, map_location: Any = None, **kwargs: Any) -> Any:
        folder = _folder(path_or_url)
        if folder is None:
            return original(path_or_url, map_location=map_location, **kwargs)
        for saver in list(_savers):
            saver.wait()
        checkpoint = _reader[0](folder)  # restricted whatever weights_only says: the folder needs no more
        return _place(checkpoint, map_location)

    pl_load._ckptio_original = original  # type: ignore[attr-defined]
    pl_load.__doc__ = "Lightning's checkpoint load; a ckptio folder is read by ckptio (see ckptio.integrations.lightning_load)."
    return pl_load


def _folder(path: Any) -> str | Path | None:
    """What to read when ``path`` names a folder (a local directory, or an ``s3://`` name that is no object);
    ``None`` for anything else."""
    from ..errors import MissingDependencyError
    from .lightning_keep import s3_location

    if not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    try:
        s3 = s3_location(text)
        if s3 is not None:
            return text if s3[0].folder().kind(s3[1]) != "file" else None
    except MissingDependencyError:  # no ckptio S3 client (boto3): the bucket is Lightning's (s3fs) to read
        return None
    local = Path(text[len("file://"):] if text.startswith("file://") else text)
    return local if "://" not in str(local) and local.is_dir() else None


def _place(value: Any, map_location: Any) -> Any:
    """``value`` with each tensor (read on the CPU) where ``torch.load`` would have put it for ``map_location``: a
    device, a ``{"cpu": device}`` mapping, or a ``fn(storage, "cpu")`` returning the storage to use (``None``: stay)."""
    if map_location is None:
        return value
    if isinstance(value, torch.Tensor):
        target = _target(value, map_location)
        return value if target is None or target == value.device else value.to(target)
    if isinstance(value, dict):
        placed = {k: _place(v, map_location) for k, v in value.items()}
        return placed if type(value) is dict else type(value)(placed.items())
    if isinstance(value, list):
        return [_place(v, map_location) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_place(v, map_location) for v in value)
    return value


def _target(tensor: torch.Tensor, map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        where = map_location.get(str(tensor.device))
        return None if where is None else torch.device(where)
    if callable(map_location):
        storage = map_location(tensor.untyped_storage(), str(tensor.device))
        return None if storage is None else storage.device
    raise TypeError(f"map_location must be a device, a mapping or a function, not {type(map_location).__name__}")
