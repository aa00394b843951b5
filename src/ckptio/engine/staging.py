"""Host staging buffers for background saves: the snapshot of a state at the moment of the save call.

:meth:`Stager.stage` walks a (nested) state dict and copies every tensor into a host buffer kept for
that key, so that training may update its parameters and optimizer state as soon as ``stage``
returns. Buffers are allocated on the first save and reused by the next ones while the key's shape and
dtype stay the same, so host memory does not grow from save to save. On CUDA the buffers are pinned
and the copies are asynchronous, with one synchronisation at the end.

DTensors are staged shard by shard: the local shard is copied and wrapped again with the same mesh
and placements, which is all a writer needs to place it in the global tensor (the wrapper is kept
with its buffer and reused while both stay the same: building hundreds of them cost a fifth of the
pause). A ``Partial`` DTensor is
reduced first (a collective on the training group, so this runs on the training thread).

**Deferred copies.** With ``defer``, the copies of the tensors it selects (the parameters and the optimizer's state:
what only the optimizer's ``step`` changes) are not made in :meth:`stage` but in :meth:`finish`, on the background
writer's thread, while training runs its next forward and backward; everything else (buffers, which a forward may
change, and the structure of the state) is captured in :meth:`stage`. :meth:`finish` is also the hook on the
optimizer's ``step``: whichever thread comes first makes the copies, the other waits for them (a lock). On CUDA,
:meth:`stage` records an event on each device's current stream and :meth:`finish` copies on a side stream that waits
for it. A tensor changed by hand before its copy fails that save (:meth:`finish`): seen by its version counter,
or, for a parameter changed through ``.data`` (which moves none of its counters), by a few of its elements that
:meth:`stage` read and its copy does not hold.

Thread safety: one :class:`Stager` per manager; :meth:`stage` is called on the training thread only
while no background write is reading the buffers (the manager waits for the previous save first);
:meth:`finish` on the thread that then writes them.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..errors import CheckpointError

__all__ = ["Stager", "changed_by_step", "finishing"]

_ATOMS = frozenset({bool, int, float, complex, str, bytes})


class Stager:
    """Reusable host buffers into which a background save copies device tensors, so the next training step can
    change them."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._wrapped: dict[str, tuple[torch.Tensor, tuple, DTensor]] = {}  # a DTensor around each buffer
        self._used: set[str] = set()
        self._needs_sync: set[torch.device] = set()
        self._defer: Callable[[torch.Tensor], bool] | None = None
        self._probe: Callable[[torch.Tensor], bool] | None = None
        # (buffer, source, key, the tensor the state holds, its version then): the copies left to finish()
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, str, torch.Tensor, int]] = []
        # a few elements of each deferred parameter as stage() saw them, by (device, dtype): (key, view, buffer), then
        # those and their values
        self._probes: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        self._sampled: list[tuple[list[tuple[str, torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]] = []
        self._events: dict[torch.device, Any] = {}  # CUDA: where each device's stream was when stage() returned
        self._streams: dict[torch.device, Any] = {}  # CUDA: the side stream finish() copies on, per device
        self._finishing = threading.Lock()
        self.failure: Exception | None = None
        """What went wrong in the deferred copies of the last :meth:`stage` (the writer raises it)."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def pending(self) -> bool:
        """Whether copies deferred by :meth:`stage` wait for :meth:`finish`."""
        return bool(self._deferred)

    def stage(self, state: Any, defer: Callable[[torch.Tensor], bool] | None = None,
              probe: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """A copy of ``state`` whose tensors live in this stager's host buffers. The copies of the tensors ``defer``
        selects are left to :meth:`finish` (their buffers are in the result already); of those, the ones ``probe``
        selects (the parameters) have a few elements read now, which :meth:`finish` checks their copies hold."""
        self.finish()  # nothing deferred may outlive the next snapshot
        self.failure = None
        self._used = set()
        self._needs_sync = set()
        self._defer, self._probe = defer, probe
        self._probes, self._sampled = {}, []
        try:
            with torch.no_grad():  # a DTensor's to_local is then its local tensor, not an autograd function's output
                out = self._stage(state, "")
                self._sample()
        except BaseException:
            self._deferred, self._sampled = [], []
            raise
        finally:
            self._defer = self._probe = None
            self._probes = {}
        for device in self._needs_sync:  # each device the copies came from (not only the current one)
            _synchronize(device)
        if self._deferred:
            self._events = {}
            for _, source, *_ in self._deferred:
                if source.device.type == "cuda" and source.device not in self._events:
                    self._events[source.device] = torch.cuda.current_stream(source.device).record_event()
        for key in set(self._buffers) - self._used:  # keys gone since the last save (a changed model)
            del self._buffers[key]
            self._wrapped.pop(key, None)
        return out

    def _stage(self, value: Any, key: str) -> Any:
        if isinstance(value, DTensor):
            if any(isinstance(p, Partial) for p in value.placements):
                value = value.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                       for p in value.placements])
            local = self._copy(key, value.to_local(), held=value)
            layout = (value.device_mesh, tuple(value.placements), tuple(value.shape), tuple(value.stride()))
            kept = self._wrapped.get(key)
            if kept is not None and kept[0] is local and kept[1] == layout:
                return kept[2]  # the same buffer in the same place: the wrapper of the last save still fits
            wrapped = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                         shape=value.shape, stride=value.stride())
            self._wrapped[key] = (local, layout, wrapped)
            return wrapped
        if isinstance(value, torch.Tensor):
            return self._copy(key, value)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in value.items()}
        if value is None or type(value) in _ATOMS:  # immutable: nothing to copy (most of an optimizer's hyper-parameters)
            return value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            staged = [self._stage(v, f"{key}/{i}") for i, v in enumerate(value)]
            return staged if isinstance(value, list) else tuple(staged)
        return copy.deepcopy(value)

    def _copy(self, key: str, tensor: torch.Tensor, held: torch.Tensor | None = None) -> torch.Tensor:
        held = tensor if held is None else held  # what the state holds (a DTensor's version moves, its shard's not)
        tensor = tensor.detach()
        if key in self._used:
            raise ValueError(f"two state entries stage to the same key {key!r}")
        self._used.add(key)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        if self._defer is not None and self._defer(tensor):
            self._deferred.append((buf, tensor, key, held, held._version))
            probe = _spread(tensor) if self._probe is not None and self._probe(tensor) else None
            if probe is not None:
                self._probes.setdefault((tensor.device, tensor.dtype), []).append((key, probe, buf))
            return buf
        non_blocking = tensor.device.type != "cpu" and buf.is_pinned()  # from pageable memory it would block anyway
        buf.copy_(tensor, non_blocking=non_blocking)
        if non_blocking:
            self._needs_sync.add(tensor.device)
        return buf

    def _sample(self) -> None:
        """Read the probed elements of the deferred sources now, one ``cat`` per device and dtype (on CUDA queued on
        the current stream, before the event :meth:`finish`'s copies wait for)."""
        for probes in self._probes.values():
            values = torch.cat([probe for _, probe, _ in probes])
            pin = values.device.type == "cuda" and torch.cuda.is_available()
            self._sampled.append((probes, values, torch.empty(values.shape, dtype=values.dtype, pin_memory=pin)))

    def finish(self) -> None:
        """Make the copies :meth:`stage` deferred on the calling thread, or wait while another thread makes them; a
        no-op once they are made. Never raises: a failure is kept in :attr:`failure`, a :class:`CheckpointError` when
        a tensor was changed in place meanwhile, as its copy may then mix before and after. Seen by its version
        counter (``torch.no_grad()`` updates) or, for a parameter changed in a way that moves none (``p.data.mul_(…)``:
        ``.data`` has a counter of its own), by :data:`PROBES` elements sampled across it at :meth:`stage` that its
        copy does not hold: a change of a whole parameter is seen, one of a few elements may not be, nor a change
        through ``.data`` of the optimizer's state (see ``wait_for_staging``)."""
        with self._finishing:
            deferred, self._deferred = self._deferred, []
            sampled, self._sampled = self._sampled, []
            if not deferred:
                return
            try:
                self._copy_deferred(deferred + [(host, values) for _, values, host in sampled])
                changed = [key for _, _, key, held, version in deferred if held._version != version]
                changed += [key for probes, _, host in sampled for key in _unlike(probes, host) if key not in changed]
                if changed:
                    changed = [key.lstrip("/") for key in changed]
                    raise CheckpointError(
                        f"{len(changed)} tensor(s) of the state were changed in place while the background save "
                        f"copied them ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}), so this "
                        "checkpoint is not written (earlier ones are untouched). Change parameters or optimizer state "
                        "other than by the optimizer's step() (torch.no_grad() updates, p.data edits, loading "
                        "weights) only after manager.wait_for_staging(), or set wait_for_staging: true")
            except Exception as exc:  # noqa: BLE001 - raised by the writer, on every rank
                self.failure = exc
            finally:
                self._events = {}

    def _copy_deferred(self, deferred: Sequence[tuple[Any, ...]]) -> None:
        """Copy each ``(buffer, source, ...)`` of ``deferred``."""
        with torch.no_grad():
            for buf, source, *_ in deferred:
                if source.device.type == "cuda":
                    stream = self._streams.get(source.device)
                    if stream is None:
                        stream = self._streams[source.device] = torch.cuda.Stream(source.device)
                    stream.wait_event(self._events[source.device])  # the training stream's work until stage()
                    with torch.cuda.stream(stream):
                        buf.copy_(source, non_blocking=buf.is_pinned())
                else:
                    buf.copy_(source)
            for device in {source.device for _, source, *_ in deferred if source.device.type != "cpu"}:
                if device in self._streams:
                    self._streams[device].synchronize()
                else:
                    _synchronize(device)


PROBES = 8
"""Elements of each deferred parameter, spread across it, whose values at ``stage()`` its copy must hold (their view
and the test of which tensors are parameters cost about 3 µs a parameter in the pause)."""


def _spread(tensor: torch.Tensor) -> torch.Tensor | None:
    """A view of :data:`PROBES` elements spread evenly across a contiguous tensor (``None``: not contiguous)."""
    n = tensor.numel()
    if n == 0 or not tensor.is_contiguous():
        return None
    count = min(n, PROBES)
    return tensor.as_strided((count,), (n // count,), tensor.storage_offset())


def _unlike(probes: list[tuple[str, torch.Tensor, torch.Tensor]], host: torch.Tensor) -> list[str]:
    """The keys whose copy (the same elements of its buffer) does not hold, bit for bit, the values ``host`` sampled at
    stage()."""
    out, start = [], 0
    for key, probe, buf in probes:
        copied = _spread(buf)
        assert copied is not None and copied.numel() == probe.numel()  # the buffer is a contiguous tensor alike
        then = host[start:start + copied.numel()]
        start += copied.numel()
        if not torch.equal(_bits(then), _bits(copied)):
            out.append(key)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-D tensor (NaN equals NaN); the values where a dtype cannot be viewed so."""
    try:
        return t.contiguous().view(torch.uint8)
    except RuntimeError:
        return t


def _synchronize(device: torch.device) -> None:
    """Wait for the copies queued from ``device`` (``torch.cuda.synchronize()`` alone waits for the current device
    only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        accelerator.synchronize(device)


def changed_by_step(optimizer: Any) -> tuple[Any, Any]:
    """Which tensors of a state only ``optimizer``'s step changes (its parameters and its state), and which of those are
    its parameters, recognised by where their bytes are: their staging copies may wait for the writer's thread (the
    parameters' with a few elements sampled first, :meth:`Stager.finish`). ``None``: nothing waits."""
    if optimizer is None:
        return None, None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        weights = {(t.to_local() if isinstance(t, DTensor) else t).data_ptr() for t in params}
        owned = weights | {(t.to_local() if isinstance(t, DTensor) else t).data_ptr() for t in states}
    owned.discard(0)
    weights.discard(0)
    return (lambda tensor: tensor.numel() > 0 and tensor.data_ptr() in owned,
            lambda tensor: tensor.data_ptr() in weights)


def finishing(stager: Stager) -> Any:
    """The optimizer's step pre-hook: the staging copies of the save in flight are made (here, or by the writer's
    thread while the step waits) before the step changes what they copy."""
    def hook(*_: Any) -> None:
        stager.finish()
    return hook
