"""What checking a checkpoint while loading it costs: ``restore(verify="none" | "size" | "full")``.

    .venv/bin/python benchmarks/verify_cost.py [--size 512MiB] [--repeats 5] [--format safetensors]

A Llama plus its AdamW state (about ``--size`` bytes) is saved once; then the three modes restore it in
turn, interleaved, each both cold (page cache dropped first: needs root, else the "cold" rows are warm
too and say so) and warm (read right after another load). Medians (min–max) and the ratio of each mode
to ``none`` in the same run. ``full`` hashes every byte as it is read (CRC-32C), so its cost is the
checksum speed against the read speed; the default of ``CheckpointConfig.verify`` was chosen from this.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    from save_load import _size, build_state, drop_caches

    from ckptio import CheckpointConfig, CheckpointManager

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="512MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--format", default="safetensors", choices=["safetensors", "torch_save"])
    args = p.parse_args()
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    model, opt = build_state(_size(args.size))
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor))
    root = Path(tempfile.mkdtemp(prefix="ckptio-verify-"))
    cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=args.format)
    with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
    can_drop = drop_caches()
    modes = ("none", "size", "full")
    times: dict[tuple[str, str], list[float]] = {(m, c): [] for m in modes for c in ("cold", "warm")}
    mgr = CheckpointManager(cfg, model=model, optimizer=opt, rng=False)
    mgr.restore(verify="none")  # warm-up
    for r in range(args.repeats):
        order = modes if r % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop_caches()
                t0 = time.perf_counter()
                mgr.restore(verify=mode)
                times[(mode, cache)].append(time.perf_counter() - t0)
    print(f"state {nbytes / 2**20:.0f} MiB ({args.format} model + DCP optimizer), {args.repeats} repeats, medians "
          f"(min-max){'' if can_drop else '; page cache NOT dropped (not root): cold rows are warm'}")
    print(f"{'mode':<6} {'cold load':>22} {'x none':>7} {'warm load':>22} {'x none':>7}")
    for mode in modes:
        row = f"{mode:<6}"
        for cache in ("cold", "warm"):
            t = times[(mode, cache)]
            base = statistics.median(times[("none", cache)])
            row += f" {statistics.median(t):8.3f} s ({min(t):.3f}-{max(t):.3f})  x{statistics.median(t) / base:5.2f}"
        print(row)
    mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
