"""Small helpers over ``torch.distributed`` that degrade to one process without special cases.

Every function here may be called whether or not a process group is initialised. Functions whose
name says "collective" must be called by every rank of the group, in the same order.
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch.distributed as dist

from .errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

T = TypeVar("T")


_local = threading.local()


@contextmanager
def using_group(group: Any) -> Iterator[None]:
    """Within this block, on this thread, the collectives of this module (and DCP saves) use ``group``.

    The background writer of async saves runs on its own process group, so that its collectives can
    never interleave with the training loop's on the default group. ``group`` spans every rank, so
    ranks in it are the global ranks.
    """
    previous = getattr(_local, "group", None)
    _local.group = group
    try:
        yield
    finally:
        _local.group = previous


def current_group() -> Any:
    """The process group this thread's collectives use (``None``: the default group)."""
    return getattr(_local, "group", None)


def group_key() -> str:
    """A name of the current group that is the same on each of its ranks and never given to another group of this
    process (c10d names groups in the order they are made, which every rank shares): for caches that must agree
    across ranks (a DCP plan, a round's frame size). Not ``id()``: each process has its own, and a group made after
    another is freed may get the freed one's."""
    group = current_group()
    if group is None:
        return "default"
    return f"{getattr(group, 'group_name', '')}:{','.join(map(str, dist.get_process_group_ranks(group)))}"


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _alone() -> bool:
    """No other rank in this thread's group (not distributed, or a group of one rank: a job of one process started by
    ``torchrun``): a collective there would return this rank's own values, at the cost of a real one (gloo's
    all-gather of a pickle, broadcast, all-reduce: ~2.4 ms of CPU in a 1-rank save), so it is skipped."""
    return not is_dist() or dist.get_world_size(current_group()) == 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def new_gloo_group() -> Any:
    """Collective: a gloo group of every rank, ckptio's own. Destroyed by :func:`destroy_group` when its owner closes,
    and at the latest at interpreter exit (atexit runs before the interpreter tears down), so that no group of ours is
    left for a destructor at teardown."""
    group = dist.new_group(backend="gloo")
    _owned.append(group)
    if len(_owned) == 1:
        import atexit

        atexit.register(_destroy_owned)
    return group


def destroy_group(group: Any) -> None:
    """Destroy a group of ours, unless the job already did (``destroy_process_group()`` destroys every group)."""
    if group in _owned:
        _owned.remove(group)
    if not is_dist():
        return  # the default group's destruction shut ours down; the caller drops its handle
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": destroyed already
        pass


def _destroy_owned() -> None:
    while _owned:
        destroy_group(_owned[-1])


_owned: list[Any] = []


def destroy_default_at_exit() -> None:
    """At interpreter exit, destroy the default process group if it is still there (and with it every group). For a
    process ckptio ends itself (``on_preemption="exit"``: ``SystemExit`` from inside a framework's loop, so the
    script's own clean-up never runs): gloo's threads still alive when the interpreter tears down abort the process
    (SIGABRT), and the job would be reported failed although every rank saved. atexit runs its hooks last registered
    first, before the teardown: this one after anything the script or the framework registered earlier."""
    import atexit

    if not _exit_hook:
        atexit.register(_destroy_default)
        _exit_hook.append(True)


def _destroy_default() -> None:
    if is_dist():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the process is ending; nothing to report it to
            pass


_exit_hook: list[bool] = []


def barrier() -> None:
    if is_dist():
        dist.barrier(group=current_group())


OBJECT_ROUND = 4096
"""Bytes (an 8-byte length, then the pickle) an object collective sends in its first round: an object that fits
(ckptio's rounds send a few hundred bytes: a flag, a folder's name, shapes, checksums) takes one collective. torch's
``broadcast_object_list``/``all_gather_object`` always take two (the sizes, then the bytes), ~0.5 ms of a rank's CPU
each on gloo, a dozen times in a save or restore on several ranks. A larger object takes a second round, as there.
The pickles are the job's own ranks' objects sent over its process group, never a checkpoint's bytes: they are
trusted as torch's object collectives trust them (which unpickle them the same way)."""


def _framed(data: bytes, size: int, device: Any) -> Any:
    import torch

    framed = len(data).to_bytes(8, "little") + data[:size - 8]
    out = torch.zeros(size, dtype=torch.uint8)
    out[:len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
    return out.to(device)


def _unframed(buf: Any) -> tuple[int, bytes]:
    raw = buf.cpu().numpy().tobytes()
    return int.from_bytes(raw[:8], "little"), raw[8:]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Collective: every rank returns rank ``src``'s ``obj`` (one broadcast when it fits :data:`OBJECT_ROUND`)."""
    if _alone():
        return obj
    import pickle

    import torch

    group = current_group()
    device = flag_device(group)
    data = pickle.dumps(obj) if rank() == src else b""
    buf = _framed(data, OBJECT_ROUND, device)
    dist.broadcast(buf, src=src, group=group)
    size, head = _unframed(buf)
    if size > OBJECT_ROUND - 8:  # a second round, every rank knowing the size now
        rest = _framed(data, size + 8, device) if rank() == src else torch.empty(size + 8, dtype=torch.uint8,
                                                                                  device=device)
        dist.broadcast(rest, src=src, group=group)
        size, head = _unframed(rest)
    return obj if rank() == src else pickle.loads(head[:size])


def all_gather_object(obj: T) -> list[T]:
    """Collective: a list with every rank's ``obj``, indexed by rank (one all-gather when each fits
    :data:`OBJECT_ROUND`)."""
    if _alone():
        return [obj]
    import pickle

    import torch

    group = current_group()
    device = flag_device(group)
    data = pickle.dumps(obj)
    bufs = [torch.empty(OBJECT_ROUND, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(bufs, _framed(data, OBJECT_ROUND, device), group=group)
    parts = [_unframed(b) for b in bufs]
    largest = max(size for size, _ in parts)
    if largest > OBJECT_ROUND - 8:  # a second round, every rank knowing every size now
        bufs = [torch.empty(largest + 8, dtype=torch.uint8, device=device) for _ in bufs]
        dist.all_gather(bufs, _framed(data, largest + 8, device), group=group)
        parts = [_unframed(b) for b in bufs]
    return [pickle.loads(head[:size]) for size, head in parts]  # this rank's too: a copy, as torch's


def decide_on_gathered(obj: Any, decide: Callable[[list[Any]], T], key: str = "") -> T:
    """Collective: rank 0 runs ``decide`` on every rank's ``obj`` (a list indexed by rank, each an unpickled copy, as
    torch's ``gather_object`` gives; in one process ``[obj]`` itself) and every rank returns what it returned.

    A gather to rank 0 and a broadcast: two collectives, where torch's ``gather_object`` and
    ``broadcast_object_list`` make four. Each rank's pickle travels in a frame of an agreed size: :data:`OBJECT_ROUND`,
    or for a ``key`` used before, a little more than the largest pickle of its last round (rank 0 sends that size
    with the decision, so every rank knows it: a DCP save's write results, ~200 bytes per tensor, fit their frame
    from the second save on). A pickle larger than its frame costs two more collectives: rank 0's broadcast asks
    for a second gather in frames that fit, then sends the decision. A decision larger than :data:`OBJECT_ROUND`
    costs one more (:func:`broadcast_object`). ``decide`` must not raise (only rank 0 runs it: the other ranks
    would wait): it returns a failure as a value. A group of one rank makes no collective (:func:`_alone`); ``decide``
    gets an unpickled copy there as well."""
    import pickle

    if _alone():
        return decide([pickle.loads(pickle.dumps(obj))] if is_dist() else [obj])

    import torch

    group = current_group()
    device = flag_device(group)
    root = rank() == 0
    data = pickle.dumps(obj)

    def gather(size: int) -> list[tuple[int, bytes]]:
        bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(world_size())] if root else None
        dist.gather(_framed(data, size, device), gather_list=bufs, dst=0, group=group)
        return [_unframed(b) for b in bufs] if bufs is not None else []

    frame = _frames.get(key, OBJECT_ROUND)
    parts = gather(frame)
    message: tuple[str, Any, int] | None = None
    if root:
        largest = max(size for size, _ in parts)
        message = ("again", None, largest + 8) if largest > frame - 8 else (
            "decided", decide([pickle.loads(head[:size]) for size, head in parts]), largest)
    kind, value, size = broadcast_object(message)  # type: ignore[misc]  # rank 0 sends a tuple
    if kind == "again":
        parts = gather(size)
        if root:
            message = ("decided", decide([pickle.loads(head[:n]) for n, head in parts]), size - 8)
        kind, value, size = broadcast_object(message)  # type: ignore[misc]
    if key:
        # the next round of this key: an eighth more than the largest pickle of this one, in whole 4 KB
        _frames[key] = max(OBJECT_ROUND, -(-(size + 8 + size // 8) // OBJECT_ROUND) * OBJECT_ROUND)
    return value


_frames: dict[str, int] = {}
"""The frame size of :func:`decide_on_gathered`'s next round for each key, the same on every rank (set from what rank
0 broadcast)."""


def flag_device(group: Any = None) -> Any:
    """Where ``group``'s (default: the default group's) all-reduce takes a flag: on the CPU with gloo, else on this
    rank's GPU."""
    import torch

    backend = str(dist.get_backend(group))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def any_rank(flag: bool) -> bool:
    """Collective: whether ``flag`` is true on any rank (one all-reduce of an integer, on this thread's group:
    ~8x cheaper on gloo than an ``all_gather_object``, which pickles and makes two collectives)."""
    if _alone():
        return flag
    import torch

    group = current_group()
    value = torch.tensor([int(flag)], dtype=torch.int64, device=flag_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def run_collectively(what: str, fn: Callable[[], T]) -> T:
    """Collective: run ``fn`` on every rank, then raise the same error everywhere if any rank failed.

    Without this, a rank that fails while the others wait in the next collective would hang the job. When every
    rank succeeded the round is one all-reduce of a flag (:func:`any_rank`); the reports are gathered only when one
    failed.
    Every rank raises: the failing rank re-raises its own exception (chained, with its traceback), the
    others raise a :class:`CheckpointError` that names the failing ranks and their messages (a
    :class:`CheckpointCorruptError` when every failing rank found damage, so that all fall back alike).
    ``fn`` itself must not run a collective: a rank that failed before it would not be there.
    """
    return agree(what, fn)[0]


def agree(what: str, fn: Callable[[], T], share: Callable[[T], Any] | None = None) -> tuple[T, list[Any]]:
    """Collective: :func:`run_collectively`, whose one round also hands every rank each rank's ``share(result)``
    (something small and picklable: a flag, a list of shapes), indexed by rank. Returns this rank's result and
    the shares; a round that fails raises on every rank as :func:`run_collectively` does."""
    result = None
    error: Exception | None = None
    shared = None
    try:
        result = fn()
        shared = share(result) if share is not None else None
    except Exception as exc:  # gathered and re-raised below on every rank
        error = exc
    if share is None and not any_rank(error is not None):  # nothing to share, no rank failed: one all-reduce
        return result, [None] * world_size()  # type: ignore[return-value]
    rounds = all_gather_object((report_of(error), shared))
    raise_if_any_failed(what, error, [report for report, _ in rounds])
    return result, [part for _, part in rounds]  # type: ignore[return-value]


def attempt(fn: Callable[[], Any]) -> Exception | None:
    """``fn()`` without a round of its own: the error it raised (``None``: it succeeded), for a later round of the
    caller's (:func:`agree`'s ``fn`` calling :func:`raise_if`) to raise on every rank, as :func:`run_collectively`
    would have, a round earlier."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the caller's later round
        return exc
    return None


def raise_if(error: Exception | None) -> None:
    """Raise ``error`` (an :func:`attempt`'s), if any."""
    if error is not None:
        raise error


def report_of(error: Exception | None) -> tuple[str, bool] | None:
    """What other ranks are told of this rank's ``error`` in a round: its message, and whether it is damage."""
    if error is None:
        return None
    return f"{type(error).__name__}: {error}", isinstance(error, (CheckpointCorruptError, CheckpointNotFoundError))


def raise_if_any_failed(what: str, error: Exception | None, reports: list[tuple[str, bool] | None]) -> None:
    """Raise on every rank when any rank's report (:func:`report_of`, gathered in a round) says it failed: the
    failing rank its own ``error``, the others a :class:`CheckpointError` naming the failing ranks and their
    messages (a :class:`CheckpointCorruptError` when every failing rank found damage)."""
    failed = {r: rep for r, rep in enumerate(reports) if rep is not None}
    if not failed:
        return
    if error is not None:
        raise error
    summary = "; ".join(f"rank {r}: {msg}" for r, (msg, _) in sorted(failed.items()))
    # damage another rank found is damage here too: an automatic resume falls back on every rank together
    cls = CheckpointCorruptError if all(damaged for _, damaged in failed.values()) else CheckpointError
    raise cls(f"{what} failed on rank(s) {sorted(failed)}: {summary}")


def decide_on_rank0(what: str, fn: Callable[[], T]) -> T:
    """Collective, one broadcast: rank 0 runs ``fn`` and every rank returns its result, or raises its exception
    (the same class and message on every rank; one that cannot travel becomes a :class:`CheckpointError`)."""
    if _alone():
        return fn()
    outcome: tuple[bool, Any] | None = None
    own: Exception | None = None
    if rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as exc:  # sent to every rank below, raised there and here
            own, outcome = exc, (False, _portable(what, exc))
    received: tuple[bool, Any] = broadcast_object(outcome)  # type: ignore[assignment]  # rank 0 sends a tuple
    ok, value = received
    if ok:
        return value
    raise own if own is not None else value


def _portable(what: str, exc: Exception) -> Exception:
    """``exc`` if a broadcast can carry it (it pickles, and rebuilding it from its class and arguments, as the
    receiving ranks will, gives the same message), else a :class:`CheckpointError` saying it."""
    import copy
    import pickle

    try:
        pickle.dumps(exc)
        back = copy.copy(exc)  # rebuilt through __reduce__, as unpickling on the other ranks does
        if type(back) is type(exc) and str(back) == str(exc):
            return exc
    except Exception:  # an exception that cannot be pickled or rebuilt: sent as its message
        pass
    return CheckpointError(f"{what} failed on rank 0: {type(exc).__name__}: {exc}")


def format_exc_short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
