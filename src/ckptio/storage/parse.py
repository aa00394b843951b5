"""Turning a checkpoint's bytes into values: the second half of the one gate (:mod:`.confined` opens the files).

Every reader of ckptio — step directories, the frameworks' folders, adopted AutoModel steps, memory
snapshots, chunk indexes, configs and JSON side files, pickles through the restricted unpicklers — parses
what it read through these pieces, so that a hostile or damaged file meets the same rules everywhere:

* **sizes before allocation**: a file is read only up to the cap its kind allows (``Folder.read_bytes``);
  a compressed archive member is checked against a :class:`Budget` of decompressed bytes before a byte of
  it is inflated (:func:`zip_member`);
* **nesting bounded**: JSON deeper than :data:`MAX_DEPTH` is refused (:func:`json_value`), so no reader
  walking it can recurse without end;
* **YAML without aliases**: :func:`yaml_value` refuses anchors and aliases (a few hundred bytes of nested
  anchors expand to gigabytes of lists), documents over :data:`YAML_MAX_BYTES` and nesting past
  :data:`YAML_MAX_DEPTH`; checkpoint configs never need them;
* **types checked**: :func:`field`, :func:`as_int` and :func:`as_float` take a value of the expected type
  and range or refuse it naming the file and the field (a 400-digit integer is refused, never an
  ``OverflowError`` later);
* **pickles walked first**: :func:`check_pickle` reads a pickle's opcodes without building anything before a
  restricted unpickler loads it, so that no length or memo slot it claims makes the unpickler allocate past
  the file (the C unpickler sizes its memo by the largest slot stored: one flipped byte asked for gigabytes);
* **each pickle walked once per read**: inside :func:`one_read`, bytes walked before are not walked again;
* **one error**: whatever a parser still raises about its input (``ValueError``, ``TypeError``,
  ``KeyError``, ``OverflowError``, ``RecursionError``, a bad zip, a bad pickle...) becomes, inside
  :class:`parsing`, a :class:`~ckptio.errors.CheckpointCorruptError` naming the file — never a bare traceback.

A reader that finds a folder damaged through any of these raises a ckptio error; the discovery of each
folder kind then skips that folder with its reason and takes the next older complete one, or raises
:class:`~ckptio.errors.NoUsableCheckpointError` when there is none.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import pickle
import struct
import zipfile
import zlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, BinaryIO, Callable, Iterator, Literal, TypeVar

from ..errors import CheckpointCorruptError, CheckpointError
from .pickle_walk import PickleTooCostly, walk

__all__ = ["MAX_DEPTH", "DATA_ERRORS", "parsing", "check_pickle", "json_value", "json_object", "read_json", "check_depth",
           "field", "as_int", "as_float", "Budget", "zip_member", "yaml_value", "YAML_MAX_BYTES",
           "YAML_MAX_DEPTH", "one_read", "within_one_read", "digest", "parsed_once"]

MAX_DEPTH = 64
"""Deepest nesting of lists and dicts any checkpoint side file may have (real ones stay under 10)."""

DATA_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, KeyError, IndexError, AttributeError, LookupError, ArithmeticError, RecursionError,
    UnicodeError, EOFError, struct.error, pickle.UnpicklingError, zipfile.BadZipFile, zipfile.LargeZipFile,
    zlib.error, RuntimeError,
)
"""What a parser raises about bad input. Inside :class:`parsing` each becomes a ckptio error naming the file."""


class parsing:  # noqa: N801 - used as a statement: ``with parsing(path):``
    """Context in which bad input to a parser becomes a :class:`CheckpointCorruptError` naming ``where``.

    ckptio's own errors pass through unchanged (they name their file already); ``also`` adds a reader's own
    error types (``SafetensorError``). Use it around the parsing of one file (or one folder's files), never
    around collectives.
    """

    def __init__(self, where: object, what: str = "", *, also: tuple[type[BaseException], ...] = ()) -> None:
        self.where, self.what, self.errors = where, what, DATA_ERRORS + also

    def __enter__(self) -> "parsing":
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None or isinstance(exc, CheckpointError) or not isinstance(exc, self.errors):
            return False
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        what = f"{self.what} " if self.what else ""
        raise CheckpointCorruptError(f"{self.where}: {what}cannot be read safely ({type(exc).__name__}: {text})") from exc


_KNOWN_MAX, _KNOWN_COUNT = 4096, 1024
_known_good: set[bytes] = set()
"""Small pickles :func:`check_pickle` accepted (the very bytes: the same bytes always get the same verdict)."""


def check_pickle(source: "bytes | BinaryIO", where: object, *, size: int | None = None) -> None:
    """Walk the pickle in ``source`` (its bytes, or a seekable stream at its start, of ``size`` bytes from there)
    opcode by opcode without building anything; refuse it, naming ``where``, unless every opcode is one a pickler
    writes, with arguments inside the input, and every memo slot it stores into is the next one or one already
    stored (as every pickler numbers them). A stream is left where it started, for the unpickler.

    The restricted unpicklers are ``pickle.Unpickler`` (C) subclasses: their ``find_class`` refuses every global
    not allowed, but the C unpickler sizes its memo by the largest slot a ``LONG_BINPUT`` names and zeroes it, so
    one flipped byte there costs gigabytes before any class is looked up. The walk (:mod:`.pickle_walk`) also bounds
    what the pickle would build. It costs several times the load it guards (``benchmarks/pickle_walk.py``); small
    pickles seen whole before (a DCP folder's items of one shape carry the same pickle) are not walked again, nor
    larger ones walked earlier in the same read (:func:`one_read`: the same bytes, by their digest)."""
    if not isinstance(source, (bytes, bytearray, memoryview)):
        start = source.tell()
        data = source.read(-1 if size is None else size)
        source.seek(start)
        _walk_once(data, where)
        return
    known = bytes(source) if len(source) <= _KNOWN_MAX else None
    if known is not None and known in _known_good:
        return
    if known is None:
        _walk_once(source, where)
        return
    _walk(known, where, len(known))
    if len(_known_good) >= _KNOWN_COUNT:
        _known_good.clear()
    _known_good.add(known)


def _walk_once(data: "bytes | bytearray | memoryview", where: object) -> None:
    """:func:`_walk` of ``data`` unless the same bytes were walked before in this read (their digest is taken only
    when a pickle of that length was: a pickle refused at its first byte costs no hashing)."""
    scope = _scope.get()
    if scope is None:
        _walk(data if isinstance(data, bytes) else bytes(data), where, len(data))
        return
    seen = scope["walked"].setdefault(len(data), set())
    key = digest(data) if seen else None
    if key is not None and key in seen:
        return
    _walk(data if isinstance(data, bytes) else bytes(data), where, len(data))
    seen.add(key if key is not None else digest(data))


walked: "collections.Counter[str]" = collections.Counter()
"""How many times each pickle (by the name the gate gave it) was walked in this process: a measure of the gate's
costliest step (forgotten past 4096 names)."""


def _walk(data: bytes, where: object, size: int) -> None:
    """:func:`check_pickle` of ``data`` (``size``: what the bounds are measured against)."""
    if len(walked) >= 4096:
        walked.clear()
    walked[str(where)] += 1
    try:
        walk(data, size)
    except PickleTooCostly as exc:
        raise CheckpointCorruptError(f"{where}: refused as a pickle: {exc}") from None
    except (ValueError, OverflowError) as exc:
        text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise CheckpointCorruptError(f"{where}: not a well-formed pickle ({text})") from None


# ------------------------------------------------------------------------------------------ one read's memory
# A reader may open one file more than once in one read (Megatron's: a rank file for the run's arguments, then for
# its weights; a torch_dist .metadata once per Adam moment), and the walk costs several times the load it guards.
# Within one_read (a top-level load, conversion, open_adam...), a pickle's verdict is kept under the digest of its
# very bytes (length and BLAKE2b-256: the bytes an unpickler is handed are the bytes walked), and a parsed file (a
# DCP .metadata) under its name and the digest of the bytes read for it now (a file changed in between is parsed
# again). It lives in a context variable set for the outermost one_read and dropped when it ends: nothing outlives
# the read, and reads in other threads or tasks each have their own.

_scope: ContextVar["dict[str, dict[Any, Any]] | None"] = ContextVar("ckptio_read_scope", default=None)
_F = TypeVar("_F", bound=Callable[..., Any])


@contextmanager
def one_read() -> Iterator[None]:
    """The duration of one read: inside it (and in every :func:`one_read` nested in it), each pickle is walked at
    most once and each parsed file kept here is parsed once; all of it forgotten when the outermost one ends."""
    if _scope.get() is not None:
        yield
        return
    token = _scope.set({"walked": {}, "parsed": {}})
    try:
        yield
    finally:
        _scope.reset(token)


def within_one_read(fn: _F) -> _F:
    """``fn`` run inside :func:`one_read` (a top-level entry of a reader)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_read():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def digest(data: "bytes | bytearray | memoryview") -> tuple[int, bytes]:
    """The key of some bytes: their length and their BLAKE2b-256 digest."""
    return len(data), hashlib.blake2b(data, digest_size=32).digest()


def parsed_once(kind: str, identity: Any, data: bytes, parse: Callable[[bytes], Any]) -> Any:
    """``parse(data)``; within :func:`one_read`, what it gave before in this read for the file ``identity`` of this
    ``kind`` when it held these very bytes (by their :func:`digest`: a file changed in between is parsed again). The
    digest is taken only within a read."""
    scope = _scope.get()
    if scope is None:
        return parse(data)
    key = digest(data)
    held = scope["parsed"].get((kind, identity))
    if held is not None and held[0] == key:
        return held[1]
    value = parse(data)
    scope["parsed"][(kind, identity)] = (key, value)
    return value


def check_depth(value: Any, where: object, *, max_depth: int = MAX_DEPTH) -> Any:
    """``value`` when its lists/dicts/tuples nest at most ``max_depth`` deep; walked without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > max_depth:
            raise CheckpointCorruptError(f"{where}: nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return value


def json_value(data: "str | bytes", where: object, what: str = "", *, max_depth: int = MAX_DEPTH,
               unique_keys: bool = False) -> Any:
    """``data`` parsed as JSON, nested at most ``max_depth`` deep (``unique_keys``: an object naming a key twice is
    refused too); anything else is a :class:`CheckpointCorruptError` naming ``where`` (and ``what`` it should be,
    e.g. ``"manifest "``)."""
    try:
        parsed = json.loads(data, object_pairs_hook=_unique if unique_keys else None)
    except (ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: {what}is not valid JSON ({str(exc)[:200]})") from exc
    return check_depth(parsed, where, max_depth=max_depth)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def json_object(data: "str | bytes", where: object, what: str = "", *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """:func:`json_value` that must be a JSON object."""
    parsed = json_value(data, where, what, max_depth=max_depth)
    if not isinstance(parsed, dict):
        raise CheckpointCorruptError(f"{where}: {what}holds a JSON {type(parsed).__name__}, not an object")
    return parsed


def read_json(folder: Any, rel: str, *, max_size: int = 64 << 20, what: str = "") -> dict[str, Any]:
    """The JSON object in the small file ``rel`` of the confined ``folder`` (at most ``max_size`` bytes)."""
    return json_object(folder.read_bytes(rel, max_size=max_size), folder.display(rel), what)


_MISSING = object()
_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
          bool: "true or false", tuple: "a list"}


def _type_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_NAMES.get(k, k.__name__) for k in kinds)


def field(obj: Any, key: str, kind: Any, where: object, *, default: Any = _MISSING) -> Any:
    """``obj[key]`` when ``obj`` is a dict and the value has type ``kind`` (a type or tuple of types; ``bool``
    never passes for ``int``); ``default`` when the key is absent and one is given; else an error naming it."""
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(f"{where}: expected an object holding {key!r}, found {type(obj).__name__}")
    if key not in obj:
        if default is not _MISSING:
            return default
        raise CheckpointCorruptError(f"{where}: {key!r} is missing")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise CheckpointCorruptError(f"{where}: {key!r} must be {_type_name(kind)}, "
                                     f"found {type(value).__name__} {str(value)[:60]}")
    return value


def as_int(value: Any, where: object, what: str, *, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """``value`` as an ``int`` in ``[lo, hi]`` (an integer, not a bool or a float), or an error naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        shown = str(value)[:40] + ("..." if len(str(value)) > 40 else "") if isinstance(value, int) else repr(value)[:60]
        raise CheckpointCorruptError(f"{where}: {what} must be an integer in [{lo}, {hi}], found {shown}")
    return value


def as_float(value: Any, where: object, what: str) -> float:
    """``value`` (an int or float, not a bool) as a finite ``float``, or an error naming ``what``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            out = float(value)
        except OverflowError:
            out = math.inf
        if math.isfinite(out) or isinstance(value, float):
            return out
    shown = str(value)[:40] + "..." if len(str(value)) > 40 else repr(value)
    raise CheckpointCorruptError(f"{where}: {what} must be a finite number, found {shown}")


class Budget:
    """Decompressed bytes an archive may still yield: checked before each member is inflated."""

    def __init__(self, limit: int, where: object) -> None:
        self.left, self.limit, self.where = limit, limit, where

    def take(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or nbytes > self.left:
            raise CheckpointCorruptError(
                f"{self.where}: {what} would expand to {nbytes} bytes, more than the {self.limit} this file may hold "
                "in all (a compressed member larger than the file's kind allows)")
        self.left -= nbytes


def zip_member(archive: zipfile.ZipFile, name: str, budget: Budget, *, expect: int | None = None) -> bytes:
    """The bytes of member ``name``: its declared size is checked against ``expect`` and taken from ``budget``
    before anything is inflated, and no more than that size is ever produced (``zipfile`` stops at it and checks
    the CRC)."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise CheckpointCorruptError(f"{budget.where}: the archive has no member {name!r}") from None
    if expect is not None and info.file_size != expect:
        raise CheckpointCorruptError(f"{budget.where}: member {name!r} holds {info.file_size} bytes, expected {expect}")
    budget.take(info.file_size, f"member {name!r}")
    with parsing(budget.where, f"member {name!r}"):
        with archive.open(info) as fh:
            data = fh.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise CheckpointCorruptError(f"{budget.where}: member {name!r} holds {len(data)} bytes, "
                                     f"its header says {info.file_size}")
    return data


YAML_MAX_BYTES = 16 * 1024 * 1024
"""Largest YAML document :func:`yaml_value` parses (a ``.nemo``'s ``model_config.yaml``, a recipe's ``model.yaml``)."""
YAML_MAX_DEPTH = 100


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's ``SafeLoader``, refusing aliases and deep nesting while it composes the document (built on first use:
    most restores read no YAML, and importing PyYAML costs)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.YAMLError(f"aliases are not allowed (*{event.anchor} {event.start_mark})")
            self._depth = getattr(self, "_depth", 0) + 1
            try:
                if self._depth > YAML_MAX_DEPTH:
                    raise yaml.YAMLError(f"nested deeper than {YAML_MAX_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return Loader


def yaml_value(data: str | bytes, where: object, *, max_bytes: int = YAML_MAX_BYTES) -> Any:
    """Parse one YAML document (plain values only); a refused or malformed one is a
    :class:`~ckptio.CheckpointCorruptError` naming ``where``."""
    import yaml

    size = len(data.encode() if isinstance(data, str) else data)
    if size > max_bytes:
        raise CheckpointCorruptError(f"{where}: {size} bytes of YAML, more than the {max_bytes} allowed")
    try:
        return yaml.load(data, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader without aliases
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid YAML for ckptio ({exc})") from exc
