"""Fresh host memory, faulted in ahead of the reads that fill it.

Restoring an optimizer allocates its whole state (twice the parameters for AdamW) and fills it from
disk. The first touch of fresh pages is slow (on the reference VM, reading into fresh memory took 2.6x
as long as into touched memory, whether or not the pages are huge); the cost is the kernel providing
pages, not the copy. :func:`populate_async` has a helper thread ask the kernel to provide them
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), tensor by tensor, while the reader fills the tensors
before it: measured 0.14 s instead of 0.23 s for 512 MiB. ``MADV_POPULATE_WRITE`` never changes the
memory's contents, so racing the reader is harmless. Where it is not available, nothing happens.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, Iterable

import torch

__all__ = ["populate_async"]

_MADV_POPULATE_WRITE = 23
_state = {"usable": True}


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def populate_async(tensors: Iterable[torch.Tensor]) -> Callable[[], None]:
    """Start faulting in the pages of ``tensors`` (CPU, in order) on a helper thread; returns ``join``."""
    madvise = _madvise() if _state["usable"] and os.name == "posix" else None
    chunks = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if madvise is None or not chunks:
        return lambda: None
    page = os.sysconf("SC_PAGE_SIZE")

    def run() -> None:
        for t in chunks:
            addr, n = t.data_ptr(), t.numel() * t.element_size()
            start, end = (addr + page - 1) // page * page, (addr + n) // page * page
            if end > start and madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                _state["usable"] = False  # an older kernel (EINVAL): do not try again
                return

    thread = threading.Thread(target=run, name="ckptio-populate", daemon=True)
    thread.start()
    return thread.join
