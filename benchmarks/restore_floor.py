"""The floor of a cold restore into a fresh optimizer, against the raw cold read it is compared with.

    .venv/bin/python benchmarks/restore_floor.py [--gb 1.78] [--model-share 0.33] [--rounds 4] [--dir /var/tmp]

(as root: it drops the page cache before every contender). The yardstick's raw cold read fills memory it touched
before the page cache was dropped; a restore into a model built for it and an optimizer without state fills the
model's memory (touched) and the optimizer's (new: the kernel provides each page on first touch). No restore can
read less than that, so the contenders here are reads of one file, with no parsing and no checksums:

* ``raw cold read``: the whole file into touched memory, 64 MiB reads (the yardstick's baseline);
* ``buffered, fresh optimizer``: the model's share into touched memory, the rest into new memory (what any
  restore through the page cache must at least do);
* ``O_DIRECT, fresh optimizer``: the same, with the optimizer's share read around the page cache (four 32 MiB
  reads in flight) into the new memory;
* ``warm after O_DIRECT``: the same buffered read again right after the O_DIRECT one, without dropping the page
  cache: what a second restore on the node pays when the first one left nothing cached.

Contenders are interleaved in a shuffled order per round; printed are the medians, their ratios to the raw cold
read of the same rounds, and the kernel CPU time of each.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

CHUNK = 64 << 20
DIRECT_PIECE = 32 << 20
ALIGN = 4096


def _anon(nbytes: int) -> mmap.mmap:
    """New, page-aligned memory that nothing has touched."""
    return mmap.mmap(-1, max(nbytes, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _buffered(path: Path, dst: Any, lo: int, hi: int) -> None:
    view = memoryview(dst)
    with open(path, "rb", buffering=0) as f:
        off = lo
        while off < hi:
            n = os.preadv(f.fileno(), [view[off - lo:min(hi, off + CHUNK) - lo]], off)
            if n <= 0:
                raise OSError(f"{path}: short read at {off}")
            off += n


def _direct(path: Path, dst: mmap.mmap, lo: int, hi: int) -> None:
    """Bytes [lo, hi) of ``path`` (``lo`` aligned) into ``dst`` with O_DIRECT; ``dst`` has room for the rounding."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    view = memoryview(dst)

    def piece(off: int) -> None:
        n = -(-min(DIRECT_PIECE, hi - off) // ALIGN) * ALIGN
        if os.preadv(fd, [view[off - lo:off - lo + n]], off) < min(n, hi - off):
            raise OSError(f"{path}: short direct read at {off}")

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(piece, range(lo, hi, DIRECT_PIECE)))
    finally:
        os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.78, help="the state's bytes (the yardstick's medium: 1.78)")
    p.add_argument("--model-share", type=float, default=1 / 3, help="the model's share of them (AdamW: a third)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the file goes (default: the temporary folder)")
    args = p.parse_args()
    import numpy as np
    from save_load import drop_caches

    if not drop_caches():
        print("restore_floor.py: cannot drop the page cache (/proc/sys/vm/drop_caches needs root)", file=sys.stderr)
        return 2
    total = int(args.gb * 1e9) // ALIGN * ALIGN
    head = int(total * args.model_share) // ALIGN * ALIGN
    touched = _anon(total)
    np.frombuffer(touched, dtype=np.uint8)[:] = 1  # the raw read's and the model's memory: touched beforehand

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "state.bin"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            block = rng.integers(0, 256, CHUNK, dtype=np.uint8)
            for off in range(0, total, CHUNK):
                f.write(block[:min(CHUNK, total - off)])
            f.flush()
            os.fsync(f.fileno())

        def raw() -> None:
            _buffered(path, touched, 0, total)

        def fresh(direct: bool) -> Callable[[], None]:
            def run() -> None:
                new = _anon(total - head + DIRECT_PIECE)
                _buffered(path, touched, 0, head)
                (_direct if direct else _buffered)(path, new, head, total)
            return run

        contenders: dict[str, Callable[[], None]] = {
            "raw cold read": raw, "buffered, fresh optimizer": fresh(False), "O_DIRECT, fresh optimizer": fresh(True)}
        names = [*contenders, "warm after O_DIRECT"]
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in names}

        def timed(r: int, name: str, fn: Callable[[], None]) -> None:
            t0, c0 = time.perf_counter(), os.times()
            fn()
            gc.collect()
            times[name].append((time.perf_counter() - t0, os.times().system - c0.system))
            print(f"  round {r + 1} {name:28s} {times[name][-1][0]:6.2f} s", flush=True)

        for r in range(args.rounds):
            order = list(contenders)
            random.Random(r).shuffle(order)
            for name in order:
                drop_caches()
                time.sleep(0.5)
                timed(r, name, contenders[name])
                if name.startswith("O_DIRECT"):
                    timed(r, "warm after O_DIRECT", fresh(False))
    base = statistics.median(t for t, _ in times["raw cold read"])
    print(f"\n{total / 1e9:.2f} GB, the model's {head / 1e9:.2f} GB into touched memory (medians of {args.rounds}):")
    for name in names:
        wall = statistics.median(t for t, _ in times[name])
        kernel = statistics.median(k for _, k in times[name])
        print(f"  {name:28s} {wall:6.2f} s  x{wall / base:4.2f} of the raw cold read   kernel {kernel:5.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
