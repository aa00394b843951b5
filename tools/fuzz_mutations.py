"""Structural mutations of a checkpoint's files, each noted on the input's :class:`~fuzz_kit.Case`: JSON documents
(other types, deep nesting, huge and negative numbers, NaN, keys dropped, duplicated or added), pickles and
``torch.save`` files (cut, flipped, hostile pickles that run code or nest without end, zip bombs, archive
members dropped or lying about their size, the saved object changed), and folder entries (missing, renamed,
links, FIFOs, folders, huge sparse files)."""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

from fuzz_kit import MARKER, Case, Special, flip


# ---------------------------------------------------------------------------------------------- JSON
HOSTILE_JSON = ["null", "true", "-1", "0", "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1.5", '""', '"x"',
                '"../../etc/passwd"', "[]", "{}", "[1, 2]", '{"a": 1}', "9" * 4000, "-" + "9" * 4000,
                str(2 ** 63), str(2 ** 64), str(-(2 ** 63) - 1), '"' + "A" * 100000 + '"', "[" * 5000 + "]" * 5000,
                '{"a":' * 3000 + "1" + "}" * 3000]


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            out += _paths(v, at + (i,))
    return out


def _set_raw(doc: Any, path: tuple, raw: str) -> str:
    """The JSON text of ``doc`` with the value at ``path`` replaced by the raw JSON text ``raw`` (which may be
    deeper, larger or stranger than ``json.dumps`` writes)."""
    token = "\u0000FUZZ\u0000"
    if not path:
        return raw
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = token
    return json.dumps(doc, allow_nan=True).replace(json.dumps(token), raw)


def mutate_json(rng: Case, data: bytes, what: str) -> bytes:
    """A structural mutation of the JSON document ``data``: a value of another type or a hostile one (deep, huge,
    negative, NaN), a key dropped, duplicated or added, or random damage."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        rng.note(f"{what}: bytes flipped")
        return flip(rng, data)
    kind = rng.choice(["set", "set", "set", "drop", "dup", "add", "flip", "whole"])
    paths = _paths(doc)
    if kind in ("drop", "dup") and not any(p for p in paths if p and isinstance(p[-1], str)):
        kind = "set"
    if kind == "set":
        path = rng.choice(paths)
        raw = rng.choice(HOSTILE_JSON)
        rng.note(f"{what}: {'/'.join(map(str, path)) or '<root>'} <- {raw[:40]}{'...' if len(raw) > 40 else ''}")
        return _set_raw(doc, path, raw).encode()
    if kind == "drop":
        path = rng.choice([p for p in paths if p and isinstance(p[-1], str)])
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        rng.note(f"{what}: key {'/'.join(map(str, path))} dropped")
        return json.dumps(doc, allow_nan=True).encode()
    if kind == "dup":  # the same key twice in one object: JSON parsers keep the last
        path = rng.choice([p for p in paths if p and isinstance(p[-1], str) and len(p) == 1] or [paths[0]])
        raw = rng.choice(HOSTILE_JSON[:17])
        text = json.dumps(doc, allow_nan=True)
        if not (isinstance(doc, dict) and path and text.endswith("}")):
            return text.encode()
        rng.note(f"{what}: key {path[0]} duplicated with {raw[:40]}")
        return (text[:-1] + f", {json.dumps(path[0])}: {raw}}}").encode()
    if kind == "add":
        path = rng.choice([p for p in paths if isinstance(_get(doc, p), dict)] or [()])
        raw = rng.choice(HOSTILE_JSON)
        node = _get(doc, path)
        if isinstance(node, dict):
            node["fuzz_extra"] = 0
            rng.note(f"{what}: key {'/'.join(map(str, path + ('fuzz_extra',)))} added = {raw[:40]}")
            return _set_raw(doc, path + ("fuzz_extra",), raw).encode()
    if kind == "whole":
        raw = rng.choice(HOSTILE_JSON)
        rng.note(f"{what}: replaced by {raw[:40]}")
        return raw.encode()
    rng.note(f"{what}: bytes flipped")
    return flip(rng, data)


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


# ---------------------------------------------------------------------------------------------- pickles
def hostile_pickle(rng: Case, marker_dir: Path) -> tuple[bytes, str]:
    """A pickle that attacks its reader: runs code (creates :data:`MARKER`), nests without end, or claims a huge
    string."""
    kind = rng.choice(["exec", "exec_reduce", "deep_list", "deep_tuple", "huge_bytes", "huge_list", "global",
                       "dag_key", "deep_key", "empty_sets", "colliding_keys", "wide_dict", "late_fill"])
    target = str(marker_dir / MARKER)
    built = _builds_too_much(rng, kind)
    if built is not None:
        return built
    if kind == "exec":  # protocol 0: GLOBAL posix.mkdir, called with the marker's path
        return f"cposix\nmkdir\n(V{target}\ntR.".encode(), "a pickle calling os.mkdir"
    if kind == "exec_reduce":
        payload = b"\x80\x02cbuiltins\nexec\nX" + struct.pack("<I", len(f"import os;os.mkdir({target!r})")) \
            + f"import os;os.mkdir({target!r})".encode() + b"\x85R."
        return payload, "a pickle calling builtins.exec"
    if kind == "deep_list":
        n = rng.choice([1000, 50_000])
        return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b".", f"a list nested {n} deep"
    if kind == "deep_tuple":
        n = rng.choice([1000, 50_000])
        return b"\x80\x02N" + b"\x85" * n + b".", f"a tuple nested {n} deep"
    if kind == "huge_bytes":
        return b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xx", "BINBYTES8 claiming 1 TiB"
    if kind == "huge_list":  # a list of 2**24 references to one object: small pickle, large list
        return b"\x80\x02](" + b"N" * (1 << 16) + b"e.", "a list of 65536 Nones"
    return b"\x80\x02ctorch\nload\n.", "a pickle naming torch.load"


def _builds_too_much(rng: Case, kind: str) -> tuple[bytes, str] | None:
    """Pickles whose opcodes are all well formed but whose objects cost far more than their bytes (issue 46): a key
    hashed 2^n times, a key nested past the C stack, empty sets by the million, integer keys that share a hash, a
    dict wide through memo references, and a list filled with a costly key after a constructor's arguments hold it."""
    if kind == "dag_key":
        n = rng.choice([24, 40, 64])
        return b"\x80\x04}N" + b"2\x86" * n + b"Ns.", f"a dict key of {n} tuples each holding the previous twice"
    if kind == "deep_key":
        n = rng.choice([5_000, 200_000, 1_000_000])
        return b"\x80\x04}N" + b"\x85" * n + b"Ns.", f"a dict key nested {n} tuples deep"
    if kind == "empty_sets":
        n = rng.choice([100_000, 2_500_000])  # accepted (built in proportion to its size), refused (230x its size)
        return b"\x80\x04(" + b"\x8f" * n + b"l.", f"{n} empty sets"
    if kind == "colliding_keys":
        n, m = rng.choice([40, 2000]), (1 << 61) - 1
        keys = b"".join(b"\x8a\x0c" + (i * m).to_bytes(12, "little", signed=True) + b"N" for i in range(1, n))
        return b"\x80\x04}(" + keys + b"u.", f"{n} integer keys sharing one hash"
    if kind == "wide_dict":
        n = rng.choice([20_000, 100_000])  # within the bounds: built, and refused by the reader's type checks
        return (b"\x80\x04}(" + b"N\x94" + b"".join(b"J" + struct.pack("<i", i) + b"h\x00" for i in range(n))
                + b"u.", f"a dict of {n} keys, each value the same memo reference")
    if kind == "late_fill":
        return (b"\x80\x04cbuiltins\nset\n]q\x00\x85h\x00N" + b"2\x86" * 64 + b"a0R.",
                "a list handed to set() and then filled with a key hashed 2^64 times")
    return None


_BOMBS: dict[int, tuple[bytes, int]] = {}
BOMB_SIZES = (64 << 20, 384 << 20)
"""What a zip bomb's member inflates to: more than any file of these tiny checkpoints may hold, and (the larger)
more than the RSS bound."""


def _deflated_zeros(size: int) -> tuple[bytes, int]:
    """``size`` zero bytes deflated (raw, as in a zip member) and their CRC-32, made once."""
    if size not in _BOMBS:
        comp, crc, chunk = zlib.compressobj(9, zlib.DEFLATED, -15), 0, b"\0" * (1 << 20)
        parts = []
        for _ in range(size >> 20):
            parts.append(comp.compress(chunk))
            crc = zlib.crc32(chunk, crc)
        parts.append(comp.flush())
        _BOMBS[size] = (b"".join(parts), crc)
    return _BOMBS[size]


def _zip(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive of ``(name, stored bytes, method, crc, uncompressed size)`` members, written by hand so that a
    member can be given already deflated (a bomb is made once, not for every input)."""
    out, central = io.BytesIO(), []
    for name, data, method, crc, size in members:
        raw = name.encode()
        central.append(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, len(data), size,
                                   len(raw), 0, 0, 0, 0, 0, out.tell()) + raw)
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(raw), 0) + raw)
        out.write(data)
    at = out.tell()
    for c in central:
        out.write(c)
    out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(central), len(central), out.tell() - at, at, 0))
    return out.getvalue()


def rebuild_zip(data: bytes, change: Callable[[str, bytes], "bytes | None"], *, bomb: tuple[set[str], int] = (set(), 0)
                ) -> bytes:
    """The zip archive ``data`` with each member's bytes replaced by ``change(name, bytes)`` (``None`` drops it);
    the members named in ``bomb[0]`` become ``bomb[1]`` zero bytes, deflated."""
    members = []
    with zipfile.ZipFile(io.BytesIO(data)) as src:
        for info in src.infolist():
            if info.filename in bomb[0]:
                packed, crc = _deflated_zeros(bomb[1])
                members.append((info.filename, packed, zipfile.ZIP_DEFLATED, crc, bomb[1]))
                continue
            new = change(info.filename, src.read(info))
            if new is not None:
                members.append((info.filename, new, zipfile.ZIP_STORED, zlib.crc32(new), len(new)))
    return _zip(members)


def _lie_about_size(data: bytes, claim: int) -> bytes:
    """Patch every central-directory and local header of a zip archive to claim ``claim`` bytes uncompressed."""
    buf = bytearray(data)
    for sig, off in ((b"PK\x01\x02", 24), (b"PK\x03\x04", 22)):
        i = buf.find(sig)
        while i >= 0:
            buf[i + off:i + off + 4] = struct.pack("<I", claim & 0xFFFFFFFF)
            i = buf.find(sig, i + 4)
    return bytes(buf)


def mutate_pickle(rng: Case, data: bytes, what: str, marker_dir: Path, obj: Any = None) -> bytes:
    """A mutation of a pickle or a ``torch.save`` file: cut, flipped, a hostile pickle in its place or inside its
    archive, a zip bomb (a member deflated from hundreds of MiB of zeros, or a header lying about its size), an
    archive member dropped, or (given the saved ``obj``) the object itself changed and saved again."""
    try:
        # an archive a mutation before this one made a bomb is not rebuilt (that would inflate it here)
        is_zip = all(i.file_size < (16 << 20) for i in zipfile.ZipFile(io.BytesIO(data)).infolist())
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, struct.error, KeyError, IndexError, zlib.error,
            NotImplementedError):  # NotImplementedError: zipfile on a flipped "version needed" field
        is_zip = False  # not an archive, or one a mutation before this one broke: byte-level damage only
    kinds = ["truncate", "flip", "hostile", "hostile"] + (["bomb", "lie", "drop", "inner_hostile"] if is_zip else [])
    kinds += ["object", "object", "object"] if obj is not None else []
    kind = rng.choice(kinds)
    if kind == "truncate":
        cut = rng.randrange(len(data)) if data else 0  # a mutation before this one may have emptied it
        rng.note(f"{what}: cut to {cut} of {len(data)} bytes")
        return data[:cut]
    if kind == "flip":
        rng.note(f"{what}: bytes flipped")
        return flip(rng, data)
    if kind == "hostile":
        payload, told = hostile_pickle(rng, marker_dir)
        rng.note(f"{what}: replaced by {told}")
        return payload
    if kind in ("inner_hostile", "bomb", "lie", "drop"):
        try:
            return _mutate_archive(rng, data, what, marker_dir, kind)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, struct.error, KeyError, IndexError, zlib.error):
            rng.note(f"{what}: bytes flipped (an earlier mutation broke the archive)")
            return flip(rng, data)
    import torch

    changed, told = mutate_object(rng, obj)
    rng.note(f"{what}: object changed and saved again: {told}")
    buf = io.BytesIO()
    try:
        torch.save(changed, buf)
    except RecursionError:  # torch.save's own limit: a deep list it cannot write; the pickle kinds cover deeper
        rng.note(f"{what}: (too deep for torch.save: a deep pickle instead)")
        return b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."
    return buf.getvalue()


def _mutate_archive(rng: Case, data: bytes, what: str, marker_dir: Path, kind: str) -> bytes:
    if kind == "inner_hostile":
        payload, told = hostile_pickle(rng, marker_dir)
        rng.note(f"{what}: its data.pkl replaced by {told}")
        return rebuild_zip(data, lambda n, b: payload if n.endswith("data.pkl") else b)
    if kind == "bomb":
        size = rng.choice(BOMB_SIZES)
        victim = rng.choice(["data.pkl", "data/0", "version", "byteorder"])
        rng.note(f"{what}: member */{victim} replaced by {size >> 20} MiB of zeros, deflated (a zip bomb)")
        names = {n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if n.endswith("/" + victim)}
        return rebuild_zip(data, lambda n, b: b, bomb=(names, size))
    if kind == "lie":
        claim = rng.choice([1 << 31, (1 << 32) - 1, 0])
        rng.note(f"{what}: zip headers claim {claim} bytes per member")
        return _lie_about_size(data, claim)
    if kind == "drop":
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        gone = rng.choice(names)
        rng.note(f"{what}: archive member {gone} dropped")
        return rebuild_zip(data, lambda n, b: None if n == gone else b)
    raise ValueError(kind)


def mutate_object(rng: Case, obj: Any) -> tuple[Any, str]:
    """A copy of the saved object with one value changed in type or size, or a key dropped or added."""
    import copy

    import torch

    obj = copy.deepcopy(obj)
    slots: list[tuple[Any, Any, str]] = []

    def walk(node: Any, where: str, depth: int) -> None:
        if depth > 6:
            return
        if isinstance(node, dict):
            for k in list(node)[:20]:
                slots.append((node, k, f"{where}/{k}"))
                walk(node[k], f"{where}/{k}", depth + 1)
        elif isinstance(node, list):
            for i in range(min(len(node), 8)):
                slots.append((node, i, f"{where}[{i}]"))
                walk(node[i], f"{where}[{i}]", depth + 1)

    walk(obj, "", 0)
    if not slots:
        return rng.choice([None, "x", [obj], {"x": obj}]), "replaced whole"
    parent, key, where = rng.choice(slots)
    choice = rng.choice(["type", "type", "big", "neg", "deep", "tensor", "drop", "add"])
    if choice == "drop" and isinstance(parent, dict):
        del parent[key]
        return obj, f"{where} dropped"
    if choice == "add" and isinstance(parent, dict):
        parent[rng.choice(["fuzz", 7, None, ("t",)])] = 1
        return obj, f"a key added beside {where}"
    value = {
        "type": lambda: rng.choice([None, "x", 1.5, -3, True, [], {}, (1, 2), b"raw"]),
        "big": lambda: rng.choice([10 ** 30, 2 ** 63, 2 ** 64, float("nan"), float("inf")]),
        "neg": lambda: -rng.randint(1, 10 ** 6),
        "deep": lambda: _deep(rng.choice([100, 250])),
        "tensor": lambda: rng.choice([torch.zeros(0), torch.zeros(3, dtype=torch.int64), torch.zeros(2, 2),
                                      torch.zeros(5000, dtype=torch.uint8), torch.tensor(float("nan"))]),
        "drop": lambda: None, "add": lambda: None,
    }[choice]()
    parent[key] = value
    return obj, f"{where} <- {type(value).__name__} {str(value)[:30]}"


def _deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


# ---------------------------------------------------------------------------------------------- entries
def mutate_entry(rng: Case, image: dict[str, Any], rel: str, outside: Path) -> None:
    """Replace, in ``image``, the file ``rel`` by something else: nothing, a link (leading out, to a sibling,
    dangling, to itself), a FIFO, a folder, an empty or a huge sparse file, or move it under another name."""
    kind = rng.choice(["missing", "link_out", "link_sibling", "dangling", "loop", "fifo", "dir", "empty", "sparse",
                       "rename", "copy_over"])
    siblings = [r for r in image if r != rel and isinstance(image[r], bytes)]
    rng.note(f"{rel}: {kind}")
    value = image.pop(rel, None)
    if kind == "missing":
        return
    if kind == "link_out":
        image[rel] = Special(("link", str(outside / "canary.bin")))
    elif kind == "link_sibling" and siblings:
        image[rel] = Special(("link", os.path.relpath(rng.choice(siblings), os.path.dirname(rel) or ".")))
    elif kind == "dangling":
        image[rel] = Special(("link", "no-such-file"))
    elif kind == "loop":
        image[rel] = Special(("link", os.path.basename(rel)))
    elif kind == "fifo":
        image[rel] = Special(("fifo",))
    elif kind == "dir":
        image[rel] = Special(("dir",))
    elif kind == "empty":
        image[rel] = b""
    elif kind == "sparse":
        image[rel] = Special(("sparse", rng.choice([1 << 30, 1 << 40])))
    elif kind == "rename" and value is not None:
        image[rel + rng.choice([".bak", "~", ".1"])] = value
    elif kind == "copy_over" and siblings:
        image[rel] = image[rng.choice(siblings)]
    else:
        image[rel] = b""
