"""Cold restores with and without the direct reads of cold files (``CKPTIO_DIRECT_READS``), against a raw cold read.

    .venv/bin/python benchmarks/direct_reads.py [--rounds 4] [--layers 9] [--hidden 1024] [--dir /var/tmp]

Saves a Llama-shaped model with AdamW once (the default layout: safetensors model, DCP optimizer; 1.7 GB with the
defaults), then runs ``--rounds`` rounds, each in a shuffled order: a raw cold read of every file of the checkpoint
into touched memory, a cold restore into a new model and optimizer with direct reads on, and one with them off.
Each then restores once more right away: with direct reads the files are still not in the page cache, without
them they are. The page cache is dropped before each cold run (``/proc/sys/vm/drop_caches``: run as root).
Printed: the median of each, its ratio to the raw cold read, and the process's CPU time (user + kernel).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: the temporary folder)")
    args = p.parse_args()
    import torch
    from save_load import drop_caches
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager
    from ckptio.storage import reading

    shape = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden)

    def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_model(seed=seed, **shape)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    if not drop_caches():
        print("direct_reads.py: cannot drop the page cache (/proc/sys/vm/drop_caches needs root); a cold restore "
              "cannot be measured here", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "ck"
        model, opt = fresh(0)
        for q in model.parameters():
            q.grad = torch.randn_like(q)
        opt.step()
        mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt)
        mgr.save(step=1)
        mgr.close()
        del model, opt, mgr
        files = [f for f in root.rglob("*") if f.is_file()]
        total = sum(f.stat().st_size for f in files)
        buf = memoryview(bytearray(max(f.stat().st_size for f in files)))  # touched: bytearray zeroes it

        def raw() -> None:
            for f in files:
                with open(f, "rb", buffering=0) as fh:
                    view, done = buf[:f.stat().st_size], 0
                    while done < len(view):
                        done += fh.readinto(view[done:done + (64 << 20)])

        def restore(setting: str) -> None:
            os.environ["CKPTIO_DIRECT_READS"] = setting
            model, opt = fresh(1)
            m = CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt)
            try:
                m.restore()
            finally:
                m.close()

        runs = {"raw cold read": raw, "direct reads": lambda: restore("1"), "plain reads": lambda: restore("0")}
        times: dict[str, list[float]] = {k: [] for k in [*runs, "direct reads, again", "plain reads, again"]}
        cpu: dict[str, list[float]] = {k: [] for k in times}
        rng = random.Random(0)
        print(f"checkpoint: {total / 1e9:.2f} GB in {len(files)} files; {args.rounds} rounds", flush=True)
        for r in range(args.rounds):
            for name in rng.sample(list(runs), len(runs)):
                drop_caches()
                for label in [name] if name == "raw cold read" else [name, f"{name}, again"]:
                    served = reading.STATS["bytes"]
                    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                    runs[name]()
                    dt, u1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                    times[label].append(dt)
                    cpu[label].append(u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime)
                    print(f"  round {r + 1} {label:22s} {dt:6.2f} s  cpu {cpu[label][-1]:5.2f} s  "
                          f"direct {(reading.STATS['bytes'] - served) / 1e9:.2f} GB", flush=True)
        base = statistics.median(times["raw cold read"])
        print(f"\n{'':22s} {'median s':>9s} {'x raw cold':>10s} {'cpu s':>7s}")
        for label, ts in times.items():
            print(f"{label:22s} {statistics.median(ts):9.2f} {statistics.median(ts) / base:10.2f} "
                  f"{statistics.median(cpu[label]):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
