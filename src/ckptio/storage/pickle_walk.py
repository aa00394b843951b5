"""What a pickle would build, worked out from its opcodes without building it: the bounds of the read gate.

:func:`ckptio.storage.parse.check_pickle` runs every pickle a reader unpickles through :class:`Walk` before a
restricted C unpickler loads it. The walk keeps a stack and a memo as the unpickler does, but of small stand-ins
that only know what matters for cost, so a pickle is refused when what it *would build* is out of proportion to
its size, not only when an opcode is malformed:

* **memory**: an estimate of the bytes of every object it makes (an empty set is one opcode byte and 216
  bytes of memory) may not pass :data:`MEMORY_FACTOR` times the file's size plus :data:`MEMORY_FLOOR`, nor
  :data:`MEMORY_CAP` in all;
* **nesting**: no object may hold others more than :data:`MAX_PICKLE_DEPTH` levels deep (hashing a tuple a
  million levels deep overflows the C stack: a SIGSEGV, not an exception);
* **hashing**: every value used as a dict key or set member, or handed to a constructor, costs its size counted
  with repeats (64 tuples, each holding the previous one twice, are 329 bytes and 2^64 hashes); the sum may not
  pass :data:`HASH_FACTOR` times the file's size plus :data:`HASH_FLOOR`; and no dict or set may receive more than
  :data:`MAX_COLLISIONS` keys of one hash (integer keys, whose hashes are not randomised, could be chosen to
  collide and make each insertion scan all the earlier ones).

Objects a pickle changes after another object took them in (a list appended to after a tuple holds it, as only
cycles do in what picklers write) make everything that holds them count as unbounded for hashing, and their new
depth is carried up to every holder (once round a cycle: a list that holds itself nests no deeper). Knowing the
holders costs a list per object, so a walk first only marks what is held and starts again keeping the lists the
first time a held object changes (:func:`walk`): a pickle without cycles is walked once, cheaply.
"""

from __future__ import annotations

from typing import Any, Callable

from . import pickle_ops

__all__ = ["walk", "Walk", "PickleTooCostly", "MAX_PICKLE_DEPTH", "MEMORY_FACTOR", "MEMORY_FLOOR", "MEMORY_CAP", "HASH_FACTOR",
           "HASH_FLOOR", "MAX_COLLISIONS"]

MAX_PICKLE_DEPTH = 100
"""Deepest nesting of objects in a pickle (real checkpoints stay under 20)."""
MEMORY_FACTOR, MEMORY_FLOOR, MEMORY_CAP = 32, 64 << 20, 8 << 30
"""Estimated bytes of what a pickle builds: at most 32 times its size plus 64 MiB, and 8 GiB in any case (a DCP
``.metadata`` builds ~13 times its size, a list of empty dicts ~40, a run of empty-set opcodes 216)."""
HASH_FACTOR, HASH_FLOOR = 8, 1 << 22
"""Hash work (objects hashed, counted with repeats): at most 8 per byte of the pickle plus 4 million."""
MAX_COLLISIONS = 32
"""Keys of one dict or set that may share one hash value."""
_UNBOUNDED = 1 << 62


class PickleTooCostly(ValueError):
    """A pickle whose objects would cost more than its size allows (the message says which bound)."""


class _Changed(Exception):
    """A walk that keeps no holders met an object changed after it was held: walk again, keeping them."""


class _Obj:
    """A stand-in for one object the unpickler would make: what hashing it costs, how deep it nests, whether (or,
    walking with holders, who) holds it, and for a tuple of constants its value (to see colliding keys)."""

    __slots__ = ("cost", "depth", "holders", "const", "hashes", "held")

    def __init__(self, cost: int = 1, depth: int = 1, const: Any = None) -> None:
        self.cost, self.depth, self.const = cost, depth, const
        self.holders: list[_Obj] | None = None
        self.hashes: dict[int, int] | None = None
        self.held = False


_LEAF = None
"""A value with nothing inside (a string, bytes, None, a global): costs 1 to hash, nests 0 deep."""
_NUMBERS = (int, float, bool)


def _const(value: Any) -> Any:
    """A value whose hash is the same in every process (numbers and tuples of them), else None."""
    if type(value) in _NUMBERS:
        return value
    return value.const if type(value) is _Obj else None


class _Ledger:
    """What the objects made so far cost: memory, hashing and nesting, each against its bound."""

    def __init__(self, size: int, holders: bool) -> None:
        self.memory, self.hashing, self.keep_holders = 0, 0, holders
        self.memory_limit = min(MEMORY_CAP, MEMORY_FACTOR * size + MEMORY_FLOOR)
        self.hash_limit = HASH_FACTOR * size + HASH_FLOOR

    def _spend(self, nbytes: int) -> None:
        self.memory += nbytes
        if self.memory > self.memory_limit:
            raise PickleTooCostly(f"it would build over {self.memory_limit} bytes of objects (estimated), more than "
                                  "its size allows")

    def _hash(self, value: Any, into: _Obj | None) -> None:
        if type(value) is _Obj:
            self.hashing += value.cost
            const = value.const
        else:
            self.hashing += 1
            const = value if type(value) in _NUMBERS else None
        if self.hashing > self.hash_limit:
            raise PickleTooCostly(f"hashing its keys would take over {self.hash_limit} steps (a key nested with repeats)")
        if into is not None and const is not None:
            seen = into.hashes if into.hashes is not None else {}
            into.hashes = seen
            h = hash(const)
            seen[h] = seen.get(h, 0) + 1
            if seen[h] > MAX_COLLISIONS:
                raise PickleTooCostly(f"more than {MAX_COLLISIONS} keys of one dict or set share the hash {h}")

    def _take(self, outer: _Obj, items: list[Any], cost: int, depth: int) -> tuple[int, int]:
        """``outer`` holds ``items`` from now on: ``cost`` and ``depth`` with theirs added (each item marked held, or
        told its holder when the walk keeps them)."""
        for item in items:
            if type(item) is _Obj:
                cost += item.cost
                if item.depth >= depth:
                    depth = item.depth + 1
                item.held = True
                if self.keep_holders:
                    if item.holders is None:
                        item.holders = []
                    item.holders.append(outer)
            else:
                cost += 1
        if depth > MAX_PICKLE_DEPTH:
            raise PickleTooCostly(f"it nests objects more than {MAX_PICKLE_DEPTH} levels deep")
        return min(cost, _UNBOUNDED), depth

    def _make(self, items: list[Any], const_ok: bool = False) -> _Obj:
        """A new object holding ``items`` (a tuple, a list, an object built from them); ``const_ok``: a tuple, whose
        value is kept when it holds only numbers and such tuples (at most 16)."""
        obj = _Obj()
        obj.cost, obj.depth = self._take(obj, items, 1, 1)
        if const_ok and len(items) <= 16:
            values = []
            for item in items:
                value = _const(item)
                if value is None:
                    return obj  # most tuples: a string or an object first
                values.append(value)
            obj.const = tuple(values)
        return obj

    def _grow(self, target: Any, items: list[Any]) -> None:
        """``target`` takes ``items`` in after it was made (APPENDS, SETITEMS, BUILD...)."""
        if type(target) is not _Obj:
            return  # a leaf (a global's result...): the unpickler fails on it, or the object is opaque to the walk
        if target.held and not self.keep_holders:
            raise _Changed
        cost, depth = self._take(target, items, target.cost, target.depth)
        target.cost = cost
        if target.holders:
            self._deepen(target, depth)
            self._unbound(target.holders)
        else:
            target.depth = depth

    def _deepen(self, obj: _Obj, depth: int) -> None:
        if depth <= obj.depth:
            return  # deep enough already: nothing above it changes (the common case, checked before any set-up)
        todo, seen = [(obj, depth)], set()
        while todo:
            node, d = todo.pop()
            if d <= node.depth or id(node) in seen:
                continue  # deep enough already, or met again round a cycle (a list holding itself nests no deeper)
            seen.add(id(node))
            if d > MAX_PICKLE_DEPTH:
                raise PickleTooCostly(f"it nests objects more than {MAX_PICKLE_DEPTH} levels deep")
            node.depth = d
            todo.extend((holder, d + 1) for holder in node.holders or ())

    def _unbound(self, holders: list[_Obj]) -> None:
        """What holds a changed object costs too much to hash: the walk no longer knows how much (each once)."""
        todo = list(holders)
        while todo:
            node = todo.pop()
            if node.cost >= _UNBOUNDED:
                continue
            node.cost, node.const = _UNBOUNDED, None
            todo.extend(node.holders or ())


def walk(data: bytes, size: int) -> None:
    """Walk the pickle ``data`` (``size`` bytes: the bounds' measure) to its STOP: :class:`PickleTooCostly` at the
    first bound passed, ``ValueError`` when its opcodes cannot run. Once without holders, again with them only when
    an object changed after it was held."""
    try:
        Walk(size, holders=False).run(data)
    except _Changed:
        Walk(size, holders=True).run(data)


class Walk(_Ledger):
    """One pickle's walk: :meth:`run` feeds it every opcode; it raises :class:`PickleTooCostly` at the first bound
    passed, or ``ValueError`` when the opcodes cannot run."""

    def __init__(self, size: int, holders: bool = True) -> None:
        super().__init__(size, holders)
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.by_code: list[Callable[[Any], None]] = [self._unknown] * 256
        for names, method in _TABLE:
            for name in names.split():
                self.by_code[pickle_ops.CODES[name]] = getattr(self, method)
        _bind_sized(self)

    def run(self, data: bytes) -> None:
        pickle_ops.run(data, self)

    def _unknown(self, arg: Any) -> None:
        raise ValueError("an opcode the walk does not know")

    def _pop(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise ValueError("the pickle's stack runs empty")
        return self.stack.pop()

    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise ValueError("the pickle pops a mark it never set")
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def _top(self) -> Any:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise ValueError("the pickle's stack runs empty")
        return self.stack[-1]

    # -- opcodes ----------------------------------------------------------------------------------------------------
    def _number(self, arg: Any) -> None:
        if type(arg) is not int or not -5 <= arg <= 256:  # small ints are the interpreter's own: nothing built
            self._spend(32 + (arg.bit_length() // 8 if type(arg) is int else 0))
        self.stack.append(arg)

    def _text(self, arg: Any) -> None:
        self._spend(49 + arg)  # its length (pickle_ops reads no text)
        self.stack.append(_LEAF)

    def _singleton(self, arg: Any) -> None:
        self.stack.append(_LEAF)

    def _empty(self, nbytes: int) -> Callable[[Any], None]:
        def push(arg: Any) -> None:
            self._spend(nbytes)
            self.stack.append(_Obj())
        return push

    def _tuple(self, items: list[Any]) -> None:
        self._spend(40 + 8 * len(items))
        self.stack.append(self._make(items, const_ok=True))

    def _tuple_mark(self, arg: Any) -> None:
        self._tuple(self._pop_mark())

    def _tuple_n(self, n: int) -> Callable[[Any], None]:
        def make(arg: Any) -> None:
            stack = self.stack
            if len(stack) - n < (self.marks[-1] if self.marks else 0):
                raise ValueError("the pickle's stack runs empty")
            items = stack[-n:]
            del stack[-n:]
            self._spend(40 + 8 * n)
            stack.append(self._make(items, const_ok=True))
        return make

    def _list(self, arg: Any) -> None:
        items = self._pop_mark()
        self._spend(56 + 8 * len(items))
        self.stack.append(self._make(items))

    def _dict(self, arg: Any) -> None:
        items = self._pop_mark()
        self._spend(64 + 48 * (len(items) // 2))
        obj = _Obj()
        self._set_items(obj, items)
        self.stack.append(obj)

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise ValueError("a dict built from an odd number of items")
        self._spend(48 * (len(items) // 2))
        for key in items[::2]:
            self._hash(key, target if type(target) is _Obj else None)
        self._grow(target, items)

    def _setitem(self, arg: Any) -> None:
        value, key = self._pop(), self._pop()
        self._set_items(self._top(), [key, value])

    def _setitems(self, arg: Any) -> None:
        items = self._pop_mark()
        self._set_items(self._top(), items)

    def _appends(self, arg: Any) -> None:
        items = self._pop_mark()
        self._spend(8 * len(items))
        self._grow(self._top(), items)

    def _append(self, arg: Any) -> None:
        item = self._pop()
        self._spend(8)
        self._grow(self._top(), [item])

    def _additems(self, arg: Any) -> None:
        items = self._pop_mark()
        target = self._top()
        self._spend(40 * len(items))
        for item in items:
            self._hash(item, target if type(target) is _Obj else None)
        self._grow(target, items)

    def _frozenset(self, arg: Any) -> None:
        items = self._pop_mark()
        self._spend(216 + 40 * len(items))
        obj = self._make(items)
        for item in items:
            self._hash(item, obj)
        obj.cost = 1 + len(items)  # a frozenset hashes the hashes it keeps
        self.stack.append(obj)

    def _pop_op(self, arg: Any) -> None:
        if self.stack and not (self.marks and len(self.stack) <= self.marks[-1]):
            self.stack.pop()
        elif self.marks:
            self.marks.pop()
        else:
            raise ValueError("the pickle's stack runs empty")

    def _pop_mark_op(self, arg: Any) -> None:
        self._pop_mark()

    def _dup(self, arg: Any) -> None:
        self.stack.append(self._top())

    # the memo's opcodes are half of what a DCP .metadata holds: kept short (their 16 bytes a slot are counted at
    # the next opcode that spends, before anything more is built)
    def _put(self, arg: Any) -> None:
        if type(arg) is not int or not 0 <= arg <= len(self.memo):
            raise ValueError(f"memo slot {arg} stored after {len(self.memo)} slots (a pickler stores them in order)")
        self.memory += 16
        self.memo[arg] = self._top()

    def _get(self, arg: Any) -> None:
        try:
            self.stack.append(self.memo[arg])
        except KeyError:
            raise ValueError(f"memo slot {arg} read before it was stored") from None

    def _push_leaf(self, arg: Any) -> None:
        self.stack.append(_LEAF)

    def _stack_global(self, arg: Any) -> None:
        self._pop()
        self._pop()
        self.stack.append(_LEAF)

    def _call(self, callable_: Any, args: list[Any]) -> None:
        """An object built by calling a global with ``args``: the call may hash or walk all of them."""
        for item in args:
            self._hash(item, None)
        self._spend(64)
        obj = self._make([callable_, *args])
        self.stack.append(obj)

    def _reduce(self, arg: Any) -> None:  # REDUCE and NEWOBJ: a callable or class, and a tuple of arguments
        stack = self.stack
        if len(stack) - 2 < (self.marks[-1] if self.marks else 0):
            raise ValueError("the pickle's stack runs empty")
        callable_, args = stack[-2:]
        del stack[-2:]
        self._call(callable_, [args])

    def _newobj_ex(self, arg: Any) -> None:
        kwargs, args = self._pop(), self._pop()
        self._call(self._pop(), [args, kwargs])

    def _obj(self, arg: Any) -> None:
        items = self._pop_mark()
        if not items:
            raise ValueError("OBJ without a class")
        self._call(items[0], items[1:])

    def _inst(self, arg: Any) -> None:
        self._call(_LEAF, self._pop_mark())

    def _build(self, arg: Any) -> None:
        state = self._pop()
        self._spend(16)
        self._grow(self._top(), [state])

    def _binpersid(self, arg: Any) -> None:
        self._pop()
        self._spend(64)
        self.stack.append(_Obj())

    def _persid(self, arg: Any) -> None:
        self._spend(64)
        self.stack.append(_Obj())

    def _nothing(self, arg: Any) -> None:
        pass

    def _stop(self, arg: Any) -> None:
        self._pop()

    def _readonly_buffer(self, arg: Any) -> None:
        self._top()


_TABLE: list[tuple[str, str]] = [
    ("INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT", "_number"),
    ("STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 UNICODE SHORT_BINUNICODE "
     "BINUNICODE BINUNICODE8", "_text"),
    ("NONE NEWTRUE NEWFALSE EMPTY_TUPLE", "_singleton"),
    ("TUPLE", "_tuple_mark"), ("LIST", "_list"), ("DICT", "_dict"),
    ("SETITEM", "_setitem"), ("SETITEMS", "_setitems"), ("APPEND", "_append"), ("APPENDS", "_appends"),
    ("ADDITEMS", "_additems"), ("FROZENSET", "_frozenset"), ("POP", "_pop_op"), ("POP_MARK", "_pop_mark_op"),
    ("DUP", "_dup"), ("PUT BINPUT LONG_BINPUT", "_put"), ("GET", "_get"),
    ("GLOBAL EXT1 EXT2 EXT4 NEXT_BUFFER", "_push_leaf"), ("STACK_GLOBAL", "_stack_global"),
    ("REDUCE NEWOBJ", "_reduce"), ("NEWOBJ_EX", "_newobj_ex"), ("OBJ", "_obj"), ("INST", "_inst"),
    ("BUILD", "_build"), ("BINPERSID", "_binpersid"), ("PERSID", "_persid"), ("PROTO FRAME", "_nothing"),
    ("STOP", "_stop"), ("READONLY_BUFFER", "_readonly_buffer"),
]


def _bind_sized(walk: Walk) -> None:
    for name, nbytes in (("EMPTY_LIST", 56), ("EMPTY_DICT", 64), ("EMPTY_SET", 216)):
        walk.by_code[pickle_ops.CODES[name]] = walk._empty(nbytes)
    for name, n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3)):
        walk.by_code[pickle_ops.CODES[name]] = walk._tuple_n(n)
