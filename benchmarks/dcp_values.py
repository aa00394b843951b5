"""What parsing a DCP optimizer's hyper-parameter records costs a restore, with and without the reader's memo.

    .venv/bin/python benchmarks/dcp_values.py [--rounds 8] [--layers 14] [--hidden 768]

A DCP optimizer state stores every hyper-parameter once per parameter (AdamW: 11 records a parameter, 1,419 for a
14-layer Llama), most of them byte for byte the same. ckptio's reader parses a record it has seen in the same file
only once (``formats/dcp/items.plain_value``'s ``memo``). This saves a Llama-shaped model with AdamW once (both
model and optimizer in DCP) and restores it warm into new objects ``--rounds`` times each way, alternating: with
the memo, and with every record parsed (the memo dropped). Printed: the medians of the wall time and of the
process's user CPU time per restore, and their ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--hidden", type=int, default=768)
    args = p.parse_args()
    import torch
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager
    from ckptio.formats.dcp import direct, items

    shape = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=8 * args.hidden // 3)

    def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_model(seed=seed, **shape)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    parse_each = items.plain_value

    def without_memo(handle, base, length, memo=None):  # type: ignore[no-untyped-def]
        return parse_each(handle, base, length, None)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = CheckpointConfig(checkpoint_dir=tmp, model_save_format="torch_save")
        model, opt = fresh(0)
        for q in model.parameters():
            q.grad = torch.randn_like(q)
        opt.step()
        mgr = CheckpointManager(cfg, model=model, optimizer=opt)
        mgr.save(step=1)
        mgr.close()
        runs: dict[str, list[tuple[float, float]]] = {"memo": [], "every record parsed": []}
        for _ in range(args.rounds):
            for name in runs:
                direct.plain_value = parse_each if name == "memo" else without_memo
                model, opt = fresh(1)
                m = CheckpointManager(cfg, model=model, optimizer=opt)
                u0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime, time.perf_counter()
                m.restore()
                runs[name].append((time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_utime - u0))
                m.close()
        direct.plain_value = parse_each
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    base = med["every record parsed"]
    print(f"{'':22s} {'wall s':>8s} {'user cpu s':>11s} {'x wall':>7s} {'x cpu':>6s}")
    for name, (wall, cpu) in med.items():
        print(f"{name:22s} {wall:8.3f} {cpu:11.3f} {wall / base[0]:7.2f} {cpu / base[1]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
