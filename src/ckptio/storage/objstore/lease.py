"""The writer lock of a checkpoint folder in object storage: a lease object, renewed while held."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointCorruptError
from ..lock import LOCK_NAME, CheckpointDirLocked, parse_holder
from ..parse import as_float, field, json_object
from ._store import LEASE_SECONDS, MAX_POINTER_BYTES, PreconditionFailed

if TYPE_CHECKING:
    from . import ObjectStorage

_leases: dict[str, list[Any]] = {}  # location -> [renewing thread stop event, number of holders, the thread]
_leases_lock = threading.Lock()


class ObjectLease:
    """One writer per checkpoint folder in an object store: a lease object (``.ckptio.lock``) created with a
    create-only write, holding ``pid N on HOST`` and renewed every third of :data:`LEASE_SECONDS` by a thread
    while held. A lease not renewed for :data:`LEASE_SECONDS` is taken over; a live one is refused naming
    its holder. Shared within a process, like the local lock."""

    def __init__(self, storage: "ObjectStorage") -> None:
        self.storage = storage
        self.key = storage._key(LOCK_NAME)
        self.where = storage.root / LOCK_NAME
        self.forced_over: str | None = None
        self._held = False

    @property
    def held(self) -> bool:
        return self._held or self.forced_over is not None

    def _body(self) -> bytes:
        return json.dumps({"holder": f"pid {os.getpid()} on {socket.gethostname()}", "renewed": time.time()}).encode()

    def acquire(self, *, force: bool = False) -> None:
        if self.held:
            return
        store = self.storage.store
        location = str(self.storage.root)
        with _leases_lock:
            if location in _leases:
                _leases[location][1] += 1
                self._held = True
                return
            try:
                store.put(self.key, self._body(), if_absent=True)
            except PreconditionFailed:
                text, token = store.get(self.key, MAX_POINTER_BYTES)
                try:
                    doc = json_object(text, self.key)
                    holder = field(doc, "holder", str, self.key)
                    renewed = as_float(field(doc, "renewed", (int, float), self.key), self.key, "renewed")
                except CheckpointCorruptError:
                    holder, renewed = "an unreadable lease", 0.0
                from ..lock import _alive

                pid, host = parse_holder(holder)
                here = host == socket.gethostname() and pid is not None
                alive_here = here and pid is not None and _alive(pid)
                # a holder on this host that no longer runs (a killed job being restarted) is checked directly;
                # one elsewhere is gone once its lease is no longer renewed
                stale = time.time() - renewed > LEASE_SECONDS or (here and not alive_here)
                if not stale and not force:
                    raise CheckpointDirLocked(
                        f"{self.storage.root} is in use by {holder} (its lease was renewed "
                        f"{time.time() - renewed:.0f} s ago); two jobs must not share a checkpoint_dir (give this run "
                        f"its own, or stop the other job; a lease not renewed for {LEASE_SECONDS:.0f} s is taken over)"
                    ) from None
                if not stale and force and alive_here:
                    raise CheckpointDirLocked(f"{self.storage.root} is in use by {holder}, which is running") from None
                # take over the lease the holder no longer renews, only if nobody else did meanwhile
                store.put(self.key, self._body(), if_token=token)
                if not stale:
                    self.forced_over = holder
            stop = threading.Event()
            thread = threading.Thread(target=self._renew, args=(stop,), name="ckptio-lease", daemon=True)
            _leases[location] = [stop, 1, thread]
            thread.start()
            self._held = True

    def _renew(self, stop: threading.Event) -> None:
        while not stop.wait(LEASE_SECONDS / 3):
            try:
                self.storage.store.put(self.key, self._body())
            except Exception:  # noqa: BLE001 - retried at the next tick; a lost lease shows as a commit conflict
                continue

    def release(self) -> None:
        self.forced_over = None
        if not self._held:
            return
        self._held = False
        location = str(self.storage.root)
        with _leases_lock:
            entry = _leases.get(location)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _leases[location]
            entry[0].set()
        # joined, so that no thread of ours is inside the store's client when the interpreter exits (a renewal in flight
        # ends within the client's own timeouts)
        entry[2].join(timeout=60)
        try:
            self.storage.store.delete(self.key)
        except Exception:  # noqa: BLE001 - a lease left behind expires
            pass
