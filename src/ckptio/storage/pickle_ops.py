"""Reading a pickle's opcodes off its bytes, for the gate's walk (:mod:`.pickle_walk`).

One loop over the bytes, the argument of each opcode decoded by its kind, and the walk's handler for that opcode
called with it: the same opcodes and arguments ``pickletools.genops`` yields, at a fraction of its cost (the walk
runs before every load of a DCP ``.metadata`` of a million opcodes). Only what the walk needs is decoded: numbers
and memo slots as values; strings and bytes as their length (the unpickler decodes them, and its errors are the
gate's too); a global's names not at all. Every length is checked against what is left of the bytes before it is
skipped, so no opcode reads past the pickle's end.
"""

from __future__ import annotations

import pickletools
from struct import unpack_from
from typing import Any, Callable

__all__ = ["run", "CODES", "STOP"]

_NONE, _BYTE, _FIXED, _COUNTED, _LINE, _LINES, _STOP, _MEMOIZE, _GET, _MARK, _SMALL_INT, _LEAF = range(12)
_FIXED_FORMATS = {"uint2": ("<H", 2), "int4": ("<i", 4), "uint4": ("<I", 4), "uint8": ("<Q", 8), "float8": (">d", 8)}
_LENGTH_FORMATS = {-2: ("<B", 1), -3: ("<i", 4), -4: ("<I", 4), -5: ("<Q", 8)}
"""pickletools' ``n`` of a counted argument: the format and size of the length before it."""

CODES: dict[str, int] = {op.name: ord(op.code) for op in pickletools.opcodes}
STOP = CODES["STOP"]
_FRAME = CODES["FRAME"]
_LONGS = frozenset((CODES["LONG1"], CODES["LONG4"]))


_INLINE = {"MEMOIZE": _MEMOIZE, "BINGET": _GET, "LONG_BINGET": _GET, "MARK": _MARK, "BININT1": _SMALL_INT,
           "NONE": _LEAF, "NEWTRUE": _LEAF, "NEWFALSE": _LEAF, "EMPTY_TUPLE": _LEAF}
"""The opcodes that are most of a large pickle (a DCP ``.metadata``: 60% of a million), run by the loop itself."""


def _line_value(name: str) -> Callable[[bytes], Any]:
    """How a newline-terminated argument becomes the value the walk needs (its length for text)."""
    if name == "decimalnl_short":  # INT, PUT, GET: "00" and "01" are protocol 0's False and True
        return lambda text: text == b"01" if text in (b"00", b"01") else int(text)
    if name == "decimalnl_long":
        return lambda text: int(text[:-1] if text.endswith(b"L") else text)
    if name == "floatnl":
        return float
    return len


def _kinds() -> list[tuple[int, Any, int, str]]:
    """For each of the 256 byte values: (how its argument is read, the format or parser, the size, the name)."""
    table: list[tuple[int, Any, int, str]] = [(-1, None, 0, "")] * 256
    for op in pickletools.opcodes:
        code, arg = ord(op.code), op.arg
        if op.name in _INLINE:
            fmt, size = _FIXED_FORMATS.get(arg.name if arg else "", ("<B", 1 if arg else 0))
            table[code] = (_INLINE[op.name], fmt, size, op.name)
        elif op.name == "STOP":
            table[code] = (_STOP, None, 0, op.name)
        elif arg is None:
            table[code] = (_NONE, None, 0, op.name)
        elif arg.name == "uint1":
            table[code] = (_BYTE, None, 1, op.name)
        elif arg.name in _FIXED_FORMATS:
            fmt, size = _FIXED_FORMATS[arg.name]
            table[code] = (_FIXED, fmt, size, op.name)
        elif arg.n in _LENGTH_FORMATS:
            fmt, size = _LENGTH_FORMATS[arg.n]
            table[code] = (_COUNTED, fmt, size, arg.name)
        elif arg.name == "stringnl_noescape_pair":
            table[code] = (_LINES, len, 2, op.name)
        else:
            table[code] = (_LINE, _line_value(arg.name), 1, op.name)
    return table


_KINDS = _kinds()


def run(data: bytes, walk: Any) -> None:
    """Feed every opcode of ``data`` up to its STOP, with its argument, to ``walk.by_code[opcode byte]`` (the most
    common ones run here, on ``walk``'s stack, marks and memo); ``ValueError`` naming the byte when an opcode is
    unknown, an argument runs past the end or the bytes end before STOP."""
    kinds, handlers, end, pos = _KINDS, walk.by_code, len(data), 0
    stack, marks, memo = walk.stack, walk.marks, walk.memo
    while pos < end:
        code = data[pos]
        kind, fmt, size, name = kinds[code]
        pos += 1
        if kind == _NONE:
            handlers[code](None)
        elif kind == _MEMOIZE:
            if len(stack) <= (marks[-1] if marks else 0):
                raise ValueError(f"MEMOIZE at byte {pos - 1} with nothing on the stack")
            memo[len(memo)] = stack[-1]
            walk.memory += 16  # checked at the next opcode that spends, before anything more is built
        elif kind == _GET or kind == _SMALL_INT:
            if pos + size > end:
                break
            arg = data[pos] if size == 1 else unpack_from(fmt, data, pos)[0]
            pos += size
            if kind == _SMALL_INT:
                stack.append(arg)
            elif arg in memo:
                stack.append(memo[arg])
            else:
                raise ValueError(f"memo slot {arg} read at byte {pos - size - 1} before it was stored")
        elif kind == _MARK:
            marks.append(len(stack))
        elif kind == _LEAF:
            stack.append(None)  # the walk's stand-in for a value with nothing inside
        elif kind == _STOP:
            handlers[code](None)
            return
        elif kind >= 0:
            pos, arg = _argument(data, pos, code)
            handlers[code](arg)
        else:
            raise ValueError(f"opcode byte {code:#04x} at byte {pos - 1} is unknown")
    raise ValueError(f"it ends at byte {end} before its STOP opcode")


def _argument(data: bytes, pos: int, code: int) -> tuple[int, Any]:
    """Where the argument of opcode ``code`` (read from ``pos``) ends, and its value."""
    kind, fmt, size, name = _KINDS[code]
    end = len(data)
    if kind == _LINE or kind == _LINES:
        return _lines(data, pos, size, fmt, name)
    if pos + size > end:
        raise ValueError(f"{name} at byte {pos - 1} runs past the end ({end} bytes)")
    arg = data[pos] if kind == _BYTE else unpack_from(fmt, data, pos)[0]
    pos += size
    if kind == _FIXED and code == _FRAME and arg > end - pos:
        raise ValueError(f"a frame of {arg} bytes at byte {pos - size - 1} of {end}")
    if kind != _COUNTED:
        return pos, arg
    if not 0 <= arg <= end - pos:
        raise ValueError(f"a {name} of {arg} bytes at byte {pos - size - 1}, with {end - pos} left")
    if code in _LONGS:
        return pos + arg, int.from_bytes(data[pos:pos + arg], "little", signed=True)
    return pos + arg, arg


def _lines(data: bytes, pos: int, count: int, parse: Callable[[bytes], Any], name: str) -> tuple[int, Any]:
    """The value of ``count`` newline-terminated lines at ``pos`` (the last one's), and where they end."""
    value: Any = None
    for _ in range(count):
        nl = data.find(b"\n", pos)
        if nl < 0:
            raise ValueError(f"{name}'s argument at byte {pos} has no end of line")
        value = parse(data[pos:nl])
        pos = nl + 1
    return pos, value
