"""``torch.save`` files written by Megatron, read without running any of their code.

Megatron-LM's ``model_optim_rng.pt`` and Megatron-Core's ``common.pt`` pickle more than tensors: the
run's ``argparse.Namespace`` (holding Megatron enums such as ``AttnBackend``, a ``signal.Signals``,
torch dtypes), numpy RNG states and ordered dicts. ``torch.load(weights_only=True)`` refuses them, and
an unrestricted load would execute whatever the file names. This module reads the zip archive that
``torch.save`` writes with its own unpickler:

* an allow-list of plain classes is built for real (containers, ``Namespace``, numpy arrays and
  dtypes, torch dtypes and sizes, ``signal.Signals``, tensors rebuilt from the archive's storages);
* a class of a training framework (``megatron.*``, ``transformer_engine.*``, ``apex.*``, ``nemo.*``)
  becomes an inert :class:`Placeholder` that only remembers its name and arguments, and is reported;
* anything else is refused with a :class:`CheckpointCorruptError` naming the file and the global.

Tensors are checked against their storage (dtype, size, offset and strides in bounds) before they are
made. The whole file is read through the confined folder (a regular file, bounded in size).
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import zipfile
from typing import Any

import torch

from ...errors import CheckpointCorruptError
from ...storage.confined import Folder
from ...storage.parse import Budget, check_pickle, parsing, zip_member

__all__ = ["Placeholder", "load", "loads"]

MAX_PICKLE_BYTES = 256 << 20
"""Largest ``data.pkl`` record (the pickle itself, tensors excluded)."""
MAX_MEMBERS = 1 << 20
PLACEHOLDER_PREFIXES = ("megatron.", "transformer_engine.", "apex.", "nemo.", "modelopt.")


class Placeholder:
    """An object of a class that is not loaded (a Megatron enum, a config class): its name and arguments.

    Each framework global becomes a subclass of this one named after it (``qualname``), so both ways a
    pickle makes objects work on it — calling the class (REDUCE) and ``cls.__new__`` (NEWOBJ) — and
    neither runs anything: the arguments and any later state are only stored.
    """

    qualname = "?"
    args: tuple
    state: Any

    def __new__(cls, *args: Any) -> "Placeholder":
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any) -> None:
        """Everything was stored by ``__new__``."""

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"


def _placeholder_class(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (Placeholder,), {"qualname": qualname})


_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _numpy_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    out: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = _np_reconstruct
        out[(mod, "scalar")] = _np_scalar
    for name in ("float64", "float32", "int64", "int32", "uint32", "uint8", "bool_"):
        out[("numpy", name)] = getattr(np, name)
    return out


def _np_reconstruct(cls: Any, shape: Any, dtype: Any) -> Any:
    import numpy as np

    if cls is not np.ndarray:
        raise pickle.UnpicklingError(f"numpy _reconstruct of {cls!r}")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _np_scalar(dtype: Any, data: bytes = b"") -> Any:
    import numpy as np

    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError("a numpy scalar with a bad dtype or size")
    return np.frombuffer(data, dtype=dtype)[0]


def _codecs_encode(text: str, encoding: str = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode with an unexpected encoding")
    return text.encode("latin1")


def _signal(value: int) -> Any:
    import signal

    return signal.Signals(int(value))


def _allowed() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("_codecs", "encode"): _codecs_encode,
        ("signal", "Signals"): _signal,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): lambda data, *_: data,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
    }
    table.update(_numpy_globals())
    return table


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> torch.Tensor:
    if not isinstance(storage, torch.Tensor) or storage.dim() != 1:
        raise pickle.UnpicklingError("a tensor whose storage is not one of the archive's")
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or any(s < 0 for s in size + stride) or int(offset) < 0:
        raise pickle.UnpicklingError(f"a tensor with sizes {list(size)}, strides {list(stride)}, offset {offset}")
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    if int(offset) + extent > storage.numel():
        raise pickle.UnpicklingError(f"a tensor of sizes {list(size)} at offset {offset} runs past its storage "
                                     f"of {storage.numel()} elements")
    return storage.as_strided(size, stride, int(offset))


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, budget: Budget) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.budget = archive, prefix, budget
        self.table = _allowed()
        self.placeholders: set[str] = set()
        self.classes: dict[str, type] = {}
        self.storages: dict[str, torch.Tensor] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.table:
            return self.table[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        qualname = f"{module}.{name}"
        if qualname.startswith(PLACEHOLDER_PREFIXES):
            self.placeholders.add(qualname)
            return self.classes.setdefault(qualname, _placeholder_class(qualname))
        raise pickle.UnpicklingError(f"refusing to load the global {qualname} (not a plain data class)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"an unexpected persistent id {str(pid)[:80]}")
        _, kind, key, _location, numel = pid
        if not isinstance(key, str) or not key.isalnum():
            raise pickle.UnpicklingError(f"a storage key {key!r}")
        if key not in self.storages:
            itemsize = torch.empty((), dtype=kind.dtype).element_size()
            if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
                raise pickle.UnpicklingError(f"storage {key} claims {str(numel)[:40]} elements")
            # the size is checked, and taken from the file's budget, before a byte is inflated
            raw = zip_member(self.archive, f"{self.prefix}data/{key}", self.budget, expect=numel * itemsize)
            self.storages[key] = torch.frombuffer(bytearray(raw), dtype=kind.dtype) if raw else \
                torch.empty(0, dtype=kind.dtype)
        return self.storages[key]


def loads(data: bytes, where: object) -> tuple[Any, list[str]]:
    """The object in a ``torch.save`` archive held in ``data``, and the placeholder classes met in it.

    ``torch.save`` stores its members uncompressed, so all of them together never hold more bytes than the
    archive: a member that would inflate past that is refused before it is read."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return _load_archive(archive, Budget(len(data), where))
    except zipfile.BadZipFile as exc:
        raise CheckpointCorruptError(f"{where}: not a torch.save archive ({exc}); files of the pre-1.6 "
                                     "format are not read") from exc


def load(folder: Folder, rel: str, *, max_size: int) -> tuple[Any, list[str]]:
    """:func:`loads` of ``rel`` inside ``folder`` (a regular file of at most ``max_size`` bytes)."""
    return loads(folder.read_bytes(rel, max_size=max_size), folder.display(rel))


def _load_archive(archive: zipfile.ZipFile, budget: Budget) -> tuple[Any, list[str]]:
    where = budget.where
    names = archive.namelist()
    if len(names) > MAX_MEMBERS:
        raise CheckpointCorruptError(f"{where}: {len(names)} archive members")
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointCorruptError(f"{where}: a torch.save archive has one data.pkl; found {len(pickles)}")
    info = archive.getinfo(pickles[0])
    if info.file_size > MAX_PICKLE_BYTES:
        raise CheckpointCorruptError(f"{where}: data.pkl is {info.file_size} bytes")
    data = zip_member(archive, pickles[0], budget)
    check_pickle(data, f"{where}: {pickles[0]}")
    unpickler = _Unpickler(data, archive, pickles[0][: -len("data.pkl")], budget)
    with parsing(where, also=(MemoryError,)):  # a length field claiming a terabyte fails its allocation
        obj = unpickler.load()
    return obj, sorted(unpickler.placeholders)
