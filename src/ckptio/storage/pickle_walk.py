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
depth is carried up to every holder (once round a cycle: a list that holds itself nests no deeper).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Walk", "PickleTooCostly", "MAX_PICKLE_DEPTH", "MEMORY_FACTOR", "MEMORY_FLOOR", "MEMORY_CAP", "HASH_FACTOR",
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


class _Obj:
    """A stand-in for one object the unpickler would make: what hashing it costs, how deep it nests, who holds it,
    and for a tuple of constants its value (to see colliding keys)."""

    __slots__ = ("cost", "depth", "holders", "const", "hashes")

    def __init__(self, cost: int = 1, depth: int = 1, const: Any = None) -> None:
        self.cost, self.depth, self.const = cost, depth, const
        self.holders: list[_Obj] | None = None
        self.hashes: dict[int, int] | None = None


_MARK = object()
_LEAF = None
"""A value with nothing inside (a string, bytes, None, a global): costs 1 to hash, nests 0 deep."""
_NUMBERS = (int, float)


def _cost(value: Any) -> int:
    return value.cost if type(value) is _Obj else 1


def _depth(value: Any) -> int:
    return value.depth if type(value) is _Obj else 0


def _const(value: Any) -> Any:
    """A value whose hash is the same in every process (numbers and tuples of them), else None."""
    if type(value) in _NUMBERS or type(value) is bool:
        return value
    return value.const if type(value) is _Obj else None


class _Ledger:
    """What the objects made so far cost: memory, hashing and nesting, each against its bound."""

    def __init__(self, size: int) -> None:
        self.memory, self.hashing = 0, 0
        self.memory_limit = min(MEMORY_CAP, MEMORY_FACTOR * size + MEMORY_FLOOR)
        self.hash_limit = HASH_FACTOR * size + HASH_FLOOR

    def _spend(self, nbytes: int) -> None:
        self.memory += nbytes
        if self.memory > self.memory_limit:
            raise PickleTooCostly(f"it would build over {self.memory_limit} bytes of objects (estimated), more than "
                                  "its size allows")

    def _hash(self, value: Any, into: _Obj | None) -> None:
        self.hashing += _cost(value)
        if self.hashing > self.hash_limit:
            raise PickleTooCostly(f"hashing its keys would take over {self.hash_limit} steps (a key nested with repeats)")
        const = _const(value)
        if into is not None and const is not None:
            seen = into.hashes if into.hashes is not None else {}
            into.hashes = seen
            h = hash(const)
            seen[h] = seen.get(h, 0) + 1
            if seen[h] > MAX_COLLISIONS:
                raise PickleTooCostly(f"more than {MAX_COLLISIONS} keys of one dict or set share the hash {h}")

    def _holds(self, outer: _Obj, inner: Any) -> None:
        if type(inner) is not _Obj:
            return
        if inner.holders is None:
            inner.holders = []
        inner.holders.append(outer)

    def _make(self, items: list[Any], const_ok: bool = False, extra: int = 0) -> _Obj:
        """A new object holding ``items`` (a tuple, a list, an object built from them)."""
        cost = 1 + extra
        depth = 0
        for item in items:
            cost += _cost(item)
            d = _depth(item)
            if d > depth:
                depth = d
        if depth + 1 > MAX_PICKLE_DEPTH:
            raise PickleTooCostly(f"it nests objects more than {MAX_PICKLE_DEPTH} levels deep")
        const = None
        if const_ok and len(items) <= 16:
            values = [_const(item) for item in items]
            if all(v is not None for v in values):
                const = tuple(values)
        obj = _Obj(min(cost, _UNBOUNDED), depth + 1, const)
        for item in items:
            self._holds(obj, item)
        return obj

    def _grow(self, target: Any, items: list[Any]) -> None:
        """``target`` takes ``items`` in after it was made (APPENDS, SETITEMS, BUILD...)."""
        if type(target) is not _Obj:
            return  # a leaf (a global's result...): the unpickler fails on it, or the object is opaque to the walk
        for item in items:
            target.cost = min(target.cost + _cost(item), _UNBOUNDED)
            self._holds(target, item)
            self._deepen(target, _depth(item) + 1)
        if target.holders:
            self._unbound(target.holders)

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


class Walk(_Ledger):
    """One pickle's walk: feed it every opcode with :meth:`step` (``pickletools.genops`` order); it raises
    :class:`PickleTooCostly` at the first bound passed, or ``ValueError`` when the opcodes cannot run."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.ops: dict[str, Callable[[Any], None]] = {}
        for names, method in _TABLE:
            for name in names.split():
                self.ops[name] = getattr(self, method)
        _bind_sized(self)

    def step(self, name: str, arg: Any) -> None:
        handler = self.ops.get(name)
        if handler is None:
            raise ValueError(f"opcode {name} not understood")
        handler(arg)

    def _pop(self) -> Any:
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
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
        if not self.stack or (self.marks and len(self.stack) <= self.marks[-1]):
            raise ValueError("the pickle's stack runs empty")
        return self.stack[-1]

    # -- opcodes ----------------------------------------------------------------------------------------------------
    def _number(self, arg: Any) -> None:
        if type(arg) is not int or not -5 <= arg <= 256:  # small ints are the interpreter's own: nothing built
            self._spend(32 + (arg.bit_length() // 8 if type(arg) is int else 0))
        self.stack.append(arg)

    def _text(self, arg: Any) -> None:
        self._spend(49 + len(arg))
        self.stack.append(_LEAF)

    def _singleton(self, arg: Any) -> None:
        self.stack.append(_LEAF)

    def _empty(self, nbytes: int) -> Callable[[Any], None]:
        def push(arg: Any) -> None:
            self._spend(nbytes)
            self.stack.append(_Obj())
        return push

    def _mark(self, arg: Any) -> None:
        self.marks.append(len(self.stack))

    def _tuple(self, items: list[Any]) -> None:
        self._spend(40 + 8 * len(items))
        self.stack.append(self._make(items, const_ok=True))

    def _tuple_mark(self, arg: Any) -> None:
        self._tuple(self._pop_mark())

    def _tuple_n(self, n: int) -> Callable[[Any], None]:
        def make(arg: Any) -> None:
            items = [self._pop() for _ in range(n)][::-1]
            self._tuple(items)
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
        self.memory += 16
        self.memo[arg] = self._top()

    def _memoize(self, arg: Any) -> None:
        self.memory += 16
        self.memo[len(self.memo)] = self._top()

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

    def _reduce(self, arg: Any) -> None:
        args = self._pop()
        self._call(self._pop(), [args])

    def _newobj(self, arg: Any) -> None:
        args = self._pop()
        self._call(self._pop(), [args])

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
    ("MARK", "_mark"), ("TUPLE", "_tuple_mark"), ("LIST", "_list"), ("DICT", "_dict"),
    ("SETITEM", "_setitem"), ("SETITEMS", "_setitems"), ("APPEND", "_append"), ("APPENDS", "_appends"),
    ("ADDITEMS", "_additems"), ("FROZENSET", "_frozenset"), ("POP", "_pop_op"), ("POP_MARK", "_pop_mark_op"),
    ("DUP", "_dup"), ("PUT BINPUT LONG_BINPUT", "_put"), ("MEMOIZE", "_memoize"), ("GET BINGET LONG_BINGET", "_get"),
    ("GLOBAL EXT1 EXT2 EXT4 NEXT_BUFFER", "_push_leaf"), ("STACK_GLOBAL", "_stack_global"),
    ("REDUCE", "_reduce"), ("NEWOBJ", "_newobj"), ("NEWOBJ_EX", "_newobj_ex"), ("OBJ", "_obj"), ("INST", "_inst"),
    ("BUILD", "_build"), ("BINPERSID", "_binpersid"), ("PERSID", "_persid"), ("PROTO FRAME", "_nothing"),
    ("STOP", "_stop"), ("READONLY_BUFFER", "_readonly_buffer"),
]


def _bind_sized(walk: Walk) -> None:
    for name, nbytes in (("EMPTY_LIST", 56), ("EMPTY_DICT", 64), ("EMPTY_SET", 216)):
        walk.ops[name] = walk._empty(nbytes)
    for name, n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3)):
        walk.ops[name] = walk._tuple_n(n)
