"""Does this machine's storage serve parallel streams faster? Raw writes and cold reads with 1..N threads.

    .venv/bin/python benchmarks/parallel_io.py --size 256MiB --repeats 5

One file of ``--size`` bytes, written (pwrite of 8 MiB chunks, interleaved between threads, then fsync)
and read back after dropping the page cache (preadv into a touched buffer), with 1, 2, 4 and 8 threads.
Medians after a warm-up round, with the ratio to one thread. ckptio's ``io_threads`` default follows
what this and ``save_load.py --io-threads`` measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time


def _run(threads: int, fn) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--dir", default="/var/tmp")
    args = p.parse_args()
    from ckptio.formats.safetensors.hf_bundle import parse_size

    size, chunk = parse_size(args.size), 8 << 20
    size -= size % chunk
    counts = [int(x) for x in args.threads.split(",")]
    data = memoryview(bytearray(os.urandom(1 << 20) * (size >> 20)))
    out = memoryview(bytearray(size))
    folder = tempfile.mkdtemp(prefix="ckptio-pio-", dir=args.dir)
    path = os.path.join(folder, "f")
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(args.repeats + 1):
            for n in counts:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                t0 = time.perf_counter()
                _run(n, lambda i: [os.pwrite(fd, data[o:o + chunk], o) for o in range(i * chunk, size, n * chunk)])
                os.fsync(fd)
                dt = time.perf_counter() - t0
                os.close(fd)
                if r:
                    times.setdefault(("write", n), []).append(dt)
                os.sync()
                try:
                    with open("/proc/sys/vm/drop_caches", "w") as fh:
                        fh.write("3\n")
                except OSError:
                    pass
                fd = os.open(path, os.O_RDONLY)
                t0 = time.perf_counter()
                _run(n, lambda i: [os.preadv(fd, [out[o:o + chunk]], o) for o in range(i * chunk, size, n * chunk)])
                dt = time.perf_counter() - t0
                os.close(fd)
                if r:
                    times.setdefault(("read", n), []).append(dt)
    finally:
        os.unlink(path) if os.path.exists(path) else None
        os.rmdir(folder)
    for op in ("write", "read"):
        base = statistics.median(times[(op, 1)])
        print(f"{op} ({size >> 20} MiB, median of {args.repeats}; x = time / 1 thread)")
        for n in counts:
            med = statistics.median(times[(op, n)])
            print(f"  {n} thread(s)  {med:6.3f} s  {size / med / 1e9:5.2f} GB/s  x{med / base:4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
