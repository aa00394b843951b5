"""``torch.save`` files written by Megatron, read without running any of their code.

Megatron-LM's ``model_optim_rng.pt`` and Megatron-Core's ``common.pt`` pickle more than tensors: the
run's ``argparse.Namespace`` (holding Megatron enums such as ``AttnBackend``, a ``signal.Signals``,
torch dtypes), numpy RNG states and ordered dicts. ``torch.load(weights_only=True)`` refuses them, and
an unrestricted load would execute whatever the file names. This module reads the zip archive that
``torch.save`` writes with its own unpickler:

* an allow-list of plain classes is built for real (containers, ``Namespace``, numpy arrays and
  dtypes, torch dtypes and sizes, ``signal.Signals``, tensors rebuilt from the archive's storages);
* a class of a training framework (``megatron.*``, ``transformer_engine.*``, ``apex.*``, ``nemo.*``, or for a
  DeepSpeed checkpoint exactly the DeepSpeed classes its files hold: ``standins=``) becomes an inert
  :class:`Placeholder` that only remembers its name and arguments, and is reported;
* anything else is refused with a :class:`CheckpointCorruptError` naming the file and the global.

:func:`open_lazy` reads only the pickle: each tensor becomes a :class:`LazyTensor` that reads its elements from
the archive when asked, a range at a time (a ZeRO partition file holds the whole rank's optimizer state; a
reader that wants one parameter reads that parameter's bytes only).

Tensors are checked against their storage (dtype, size, offset and strides in bounds) before they are
made. The whole file is read through the confined folder (a regular file, bounded in size).
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import pickle
import zipfile
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ..storage.confined import Folder
from ..storage.parse import Budget, check_pickle, parsing, zip_member

__all__ = ["Placeholder", "LazyTensor", "load", "loads", "open_lazy"]

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


def _view(offset: Any, size: Any, stride: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """A tensor's offset, sizes and strides as plain numbers, refused when negative or of unequal lengths, and how
    many elements of its storage it spans."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or any(s < 0 for s in size + stride) or int(offset) < 0:
        raise pickle.UnpicklingError(f"a tensor with sizes {list(size)}, strides {list(stride)}, offset {offset}")
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    return int(offset), size, stride, extent


def _rebuild_tensor(storage: Any, offset: int, size: Any, stride: Any, *_: Any) -> Any:
    offset, size, stride, extent = _view(offset, size, stride)
    numel = storage.numel if isinstance(storage, _LazyStorage) else \
        storage.numel() if isinstance(storage, torch.Tensor) and storage.dim() == 1 else None
    if numel is None:
        raise pickle.UnpicklingError("a tensor whose storage is not one of the archive's")
    if offset + extent > numel:
        raise pickle.UnpicklingError(f"a tensor of sizes {list(size)} at offset {offset} runs past its storage "
                                     f"of {numel} elements")
    if isinstance(storage, _LazyStorage):
        return LazyTensor.of(storage, offset, size, stride)
    return storage.as_strided(size, stride, offset)


class _TensorType:
    """``torch.Tensor`` or ``torch.nn.Parameter`` named as the type of a rebuilt tensor (only ever compared)."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    """``torch._tensor._rebuild_from_type_v2`` for a plain tensor or parameter: the tensor its rebuild gives. Plain
    attributes set on it (DeepSpeed's ``ds_id``) are dropped."""
    plain = (str, int, float, bool, type(None))
    if func is not _rebuild_tensor or new_type is not _TensorType or not isinstance(args, tuple) or \
            not (state is None or isinstance(state, dict) and all(type(v) in plain for v in state.values())):
        raise pickle.UnpicklingError("a tensor rebuilt as another type, or with state that is not plain values")
    return _rebuild_tensor(*args)


class _LazyStorage:
    """A storage of the archive not read yet: where its bytes are in the file, and the CRC-32 the archive records
    for them, checked (streaming, 16 MiB at a time) the first time any of them is read: a damaged byte anywhere in
    the member is an error, never a wrong value."""

    def __init__(self, handle: Any, start: int, dtype: torch.dtype, numel: int, where: object, info: zipfile.ZipInfo) -> None:
        self.handle, self.start, self.dtype, self.numel, self.where = handle, start, dtype, numel, where
        self.nbytes, self.crc, self.name, self.checked = info.file_size, info.CRC, info.filename, False

    def check(self) -> None:
        if self.checked:
            return
        import zlib

        crc, at, step = 0, 0, 16 << 20
        while at < self.nbytes:
            crc = zlib.crc32(self.handle.read(self.start + at, min(step, self.nbytes - at)), crc)
            at += step
        if crc != self.crc:
            raise CheckpointCorruptError(f"{self.where}: member {self.name!r} does not match its CRC-32 (damaged)")
        self.checked = True


class LazyTensor:
    """A contiguous tensor of a ``torch.save`` archive whose elements are read from the file when asked."""

    def __init__(self, storage: _LazyStorage, offset: int, shape: tuple[int, ...]) -> None:
        self.storage, self.offset, self.shape = storage, offset, shape
        self.dtype = storage.dtype
        self.numel = math.prod(shape)

    @classmethod
    def of(cls, storage: _LazyStorage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> "LazyTensor":
        """A tensor of ``storage`` checked by :func:`_rebuild_tensor`; it must be contiguous (ranges are read)."""
        contiguous: list[int] = []
        step = 1
        for n in reversed(size):
            contiguous.insert(0, step)
            step *= n
        if step and any(n > 1 and s != e for n, s, e in zip(size, stride, contiguous)):
            raise pickle.UnpicklingError(f"a tensor of sizes {list(size)} with strides {list(stride)} (not contiguous)")
        return cls(storage, offset, size)

    def read(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``start`` to ``start + count`` of the flattened tensor (all of them by default), as a new 1-D tensor."""
        count = self.numel - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel:
            raise CheckpointCorruptError(f"{self.storage.where}: elements {start}..{start + count} of a tensor of "
                                         f"{self.numel}")
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        buf = bytearray(count * itemsize)
        if count:
            self.storage.check()
            self.storage.handle.readinto(buf, self.storage.start + (self.offset + start) * itemsize)
        return torch.frombuffer(buf, dtype=self.dtype) if count else torch.empty(0, dtype=self.dtype)

    def load(self) -> torch.Tensor:
        """The whole tensor, in its shape."""
        return self.read().view(self.shape)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, budget: Budget,
                 standins: Any = None, handle: Any = None) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.budget = archive, prefix, budget
        self.standins, self.handle = standins, handle
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
        if (module, name) in (("torch", "Tensor"), ("torch.nn.parameter", "Parameter")):
            return _TensorType
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type
        if qualname in self.standins if self.standins is not None else qualname.startswith(PLACEHOLDER_PREFIXES):
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
            if self.handle is not None:
                return self.storages.setdefault(key, self._lazy(key, kind.dtype, numel, itemsize))
            # the size is checked, and taken from the file's budget, before a byte is inflated
            raw = zip_member(self.archive, f"{self.prefix}data/{key}", self.budget, expect=numel * itemsize)
            self.storages[key] = torch.frombuffer(bytearray(raw), dtype=kind.dtype) if raw else \
                torch.empty(0, dtype=kind.dtype)
        return self.storages[key]


    def _lazy(self, key: str, dtype: torch.dtype, numel: int, itemsize: int) -> Any:
        """Where storage ``key``'s bytes are in the file: a member stored as is, of the size its elements need."""
        name = f"{self.prefix}data/{key}"
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise pickle.UnpicklingError(f"the archive has no member {name!r}") from None
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != numel * itemsize:
            raise pickle.UnpicklingError(f"member {name!r} holds {info.file_size} bytes (compression "
                                         f"{info.compress_type}), expected {numel * itemsize} stored")
        header = self.handle.read(info.header_offset, 30) if info.header_offset + 30 <= self.handle.size else b""
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise pickle.UnpicklingError(f"member {name!r} has no local header at {info.header_offset}")
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        if start + info.file_size > self.handle.size:
            raise pickle.UnpicklingError(f"member {name!r} runs past the end of the file")
        return _LazyStorage(self.handle, start, dtype, numel, self.budget.where, info)


def loads(data: bytes, where: object, *, standins: Any = None) -> tuple[Any, list[str]]:
    """The object in a ``torch.save`` archive held in ``data``, and the placeholder classes met in it.

    ``torch.save`` stores its members uncompressed, so all of them together never hold more bytes than the
    archive: a member that would inflate past that is refused before it is read."""
    try:
        with parsing(where, "not a torch.save archive"):  # a member name that is no UTF-8, a cut directory...
            archive = zipfile.ZipFile(io.BytesIO(data))
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{exc}; files of the pre-1.6 format are not read") from exc.__cause__
    with archive:
        return _load_archive(archive, Budget(len(data), where), standins)


def load(folder: Folder, rel: str, *, max_size: int, standins: Any = None) -> tuple[Any, list[str]]:
    """:func:`loads` of ``rel`` inside ``folder`` (a regular file of at most ``max_size`` bytes)."""
    return loads(folder.read_bytes(rel, max_size=max_size), folder.display(rel), standins=standins)


def open_lazy(folder: Folder, rel: str, *, standins: Any = None) -> tuple[Any, list[str], Any]:
    """The object in the ``torch.save`` archive ``rel`` with :class:`LazyTensor` for its tensors, the placeholder
    classes met, and the open handle the tensors read from (the caller closes it). Only the pickle is read now."""
    where = folder.display(rel)
    handle = folder.open(rel)
    try:
        with parsing(where, "not a torch.save archive"):
            archive = zipfile.ZipFile(handle.stream())
        with archive:
            obj, placeholders = _load_archive(archive, Budget(MAX_PICKLE_BYTES, where), standins, handle)
    except BaseException:
        handle.close()
        raise
    return obj, placeholders, handle


def _load_archive(archive: zipfile.ZipFile, budget: Budget, standins: Any = None,
                  handle: Any = None) -> tuple[Any, list[str]]:
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
    unpickler = _Unpickler(data, archive, pickles[0][: -len("data.pkl")], budget, standins, handle)
    with parsing(where, also=(MemoryError,)):  # a length field claiming a terabyte fails its allocation
        obj = unpickler.load()
    return obj, sorted(unpickler.placeholders)
