"""What the read gate's pickle walk costs beside the load it guards, on the DCP ``.metadata`` of N tensors.

    .venv/bin/python benchmarks/pickle_walk.py [--tensors 10000] [--repeats 9]

A plain ``torch.distributed.checkpoint.save`` (one process) writes a state of N small tensors; its ``.metadata`` is
what a folder DCP or NeMo AutoModel wrote gives ckptio to read (a folder ckptio wrote is read through its chunk
index and never unpickles it). Interleaved, for each repeat: the walk alone (``storage/parse.check_pickle``), the
allow-list unpickler alone, ``pickle.loads`` (no checks at all) and the whole ``read_metadata`` (walk, unpickle,
structural checks). Prints the medians and the walk's cost as a ratio to the restricted load and to the whole read.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptio.formats.dcp import metadata as md
    from ckptio.storage import parse

    with tempfile.TemporaryDirectory(prefix="ckptio-walk-") as tmp:
        state = {f"layers.{i}.weight": torch.full((4, 4), float(i)) for i in range(args.tensors)}
        dcp.save(state, checkpoint_id=tmp)
        data = (Path(tmp) / ".metadata").read_bytes()
        contenders = {
            "walk": lambda: parse.check_pickle(data, "bench"),
            "restricted load": lambda: md._MetadataUnpickler(io.BytesIO(data)).load(),
            "pickle.loads": lambda: pickle.loads(data),
            "read_metadata": lambda: md.read_metadata(tmp),
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for fn in contenders.values():
            fn()  # warm: imports, first allocations
        for _ in range(args.repeats):
            for name, fn in contenders.items():
                parse._known_good.clear()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f".metadata of {args.tensors} tensors: {len(data) / 1e6:.2f} MB; medians of {args.repeats}")
    for name, t in med.items():
        print(f"  {name:<16} {t * 1e3:8.1f} ms")
    print(f"walk / restricted load: {med['walk'] / med['restricted load']:.2f}x; "
          f"walk / whole read_metadata: {med['walk'] / med['read_metadata']:.2f}x "
          f"({med['walk'] / len(data) * 1e9:.0f} ns per byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
