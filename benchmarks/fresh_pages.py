"""What new memory costs right after the page cache was dropped: within the pages just freed, and beyond them.

    .venv/bin/python benchmarks/fresh_pages.py [--gb 2] [--rounds 3] [--dir /var/tmp]     # as root

A cold restore needs new pages twice: the page cache its reads fill, and the fresh optimizer it fills. The raw
cold read it is compared with needs only the first, into memory it touched before. On a virtual machine whose free
memory is handed back to the host (a balloon's free page reporting), a page the guest freed a moment ago and a page
it has not used for long cost differently. Each round writes ``--gb`` GB to a file, makes it durable, drops the page
cache (those pages are now free), and at once fills new memory: ``--gb`` × 0.75 (inside what was just freed) or
× 1.75 (beyond it), in an order alternating per round. Printed: the medians, and the seconds per GB of the part
beyond what was freed, against the part inside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="bytes written, then freed by dropping the page cache")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the file goes (default: the temporary folder)")
    args = p.parse_args()
    import numpy as np
    from save_load import drop_caches

    if not drop_caches():
        print("fresh_pages.py: cannot drop the page cache (/proc/sys/vm/drop_caches needs root)", file=sys.stderr)
        return 2
    freed = int(args.gb * 1e9)
    chunk = np.ones(64 << 20, dtype=np.uint8)

    def fill(nbytes: int) -> float:
        t0 = time.perf_counter()
        a = np.empty(nbytes, dtype=np.uint8)
        a.fill(1)  # every page touched once: the kernel provides (and zeroes) each
        dt = time.perf_counter() - t0
        del a
        return dt

    sizes = {"inside (0.75 x freed)": int(0.75 * freed), "beyond (1.75 x freed)": int(1.75 * freed)}
    times: dict[str, list[float]] = {k: [] for k in sizes}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "freed.bin"
        for r in range(args.rounds):
            for name in (list(sizes) if r % 2 == 0 else list(reversed(sizes))):
                with open(path, "wb") as f:
                    for _ in range(freed // chunk.size):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                drop_caches()
                times[name].append(fill(sizes[name]))
                print(f"  round {r + 1} {name:22s} {times[name][-1]:6.2f} s", flush=True)
    inside, beyond = (statistics.median(times[k]) for k in sizes)
    per_gb_inside = inside / (sizes["inside (0.75 x freed)"] / 1e9)
    per_gb_beyond = (beyond - per_gb_inside * freed / 1e9) / ((sizes["beyond (1.75 x freed)"] - freed) / 1e9)
    print(f"\nnew memory right after {freed / 1e9:.1f} GB of page cache was dropped (medians of {args.rounds}):")
    for name, ts in times.items():
        print(f"  {name:22s} {statistics.median(ts):6.2f} s  ({sizes[name] / 1e9:.2f} GB)")
    print(f"  s/GB inside what was freed {per_gb_inside:.2f}, beyond it {per_gb_beyond:.2f} "
          f"(x{per_gb_beyond / per_gb_inside:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
