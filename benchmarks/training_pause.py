"""What a background save costs a training loop: ``save()``'s pause and the wait at the optimizer's next step.

    .venv/bin/python benchmarks/training_pause.py --size 600MB --rounds 5

With ``async_save`` and the default ``wait_for_staging: false``, ``save()`` returns before the parameters and the
optimizer's state are copied into the staging buffers: the writer's thread copies them while the loop runs its
next forward and backward, and the optimizer's ``step()`` waits for what is left. With ``wait_for_staging: true``
``save()`` makes every copy itself. This runs the same loop (an MLP and AdamW, one process) both ways, interleaved
round by round, and prints medians of:

* ``save()``: how long the call held the loop;
* ``step wait``: how long the optimizer's next ``step()`` waited for the copies (its time less a plain step's);
* ``lost``: the iteration that saved, against a plain iteration (forward, backward, step) of the same round;

each also as a ratio to a torch copy of the state's bytes into one buffer, measured in the same round. Each round
ends with ``wait()`` (untimed), so a write never overlaps the next round. On CPU the copy competes with the forward
and backward for the same cores; on a GPU it runs on a copy engine beside them.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time

import torch

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.formats.safetensors.hf_bundle import parse_size


def build(size: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, size // (3 * 4 * width * width))  # fp32 weights + AdamW's two moments
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def iteration(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[float, float]:
    """One forward, backward and step: (seconds until the step was called, seconds the step took)."""
    t0 = time.perf_counter()
    model(batch).pow(2).mean().backward()
    t1 = time.perf_counter()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return t1 - t0, time.perf_counter() - t1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="600MB", help="bytes of model and optimizer state")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256, help="rows per forward (sets the compute per step)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temporary folder)")
    args = p.parse_args()
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    model, optim = build(parse_size(args.size), args.width)
    batch = torch.randn(args.batch, args.width)
    for _ in range(2):  # the optimizer's state exists and the allocator is warm
        iteration(model, optim, batch)
    tensors = [t for t in model.state_dict().values()] + [
        v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(nbytes, dtype=torch.uint8)

    def torch_copy() -> float:
        t0, off = time.perf_counter(), 0
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[off: off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            off += n
        return time.perf_counter() - t0

    root = tempfile.mkdtemp(prefix="ckptio-pause-", dir=args.dir)
    modes = {"save() copies all (wait_for_staging=True)": True, "copies after save() (default)": False}
    managers = {name: CheckpointManager(CheckpointConfig(checkpoint_dir=f"{root}/{i}", async_save=True,
                                                         wait_for_staging=wait, save_top_k=1),
                                        model=model, optimizer=optim, rng=False)
                for i, (name, wait) in enumerate(modes.items())}
    rows: dict[str, dict[str, list[float]]] = {n: {"save": [], "wait": [], "lost": []} for n in modes}
    copies: list[float] = []
    try:
        for name, mgr in managers.items():  # untimed: the staging buffers are allocated
            mgr.save(step=0)
            mgr.wait()
        print(f"state {nbytes / 1e6:.0f} MB, {len(tensors)} tensors, batch {args.batch}x{args.width}, "
              f"{torch.get_num_threads()} torch threads", file=sys.stderr)
        step = 0
        for r in range(args.rounds):
            copies.append(torch_copy())
            for name in (list(managers) if r % 2 == 0 else list(reversed(managers))):
                mgr = managers[name]
                plain = [sum(iteration(model, optim, batch)) for _ in range(2)]
                plain_step = min(iteration(model, optim, batch)[1] for _ in range(2))
                step += 1
                t0 = time.perf_counter()
                mgr.save(step=step)
                saved = time.perf_counter() - t0
                before_step, in_step = iteration(model, optim, batch)
                lost = saved + before_step + in_step - statistics.median(plain)
                rows[name]["save"].append(saved)
                rows[name]["wait"].append(max(0.0, in_step - plain_step))
                rows[name]["lost"].append(lost)
                mgr.wait()
                print(f"  round {r} {name:44s} save() {saved:6.3f} s  step wait {in_step - plain_step:6.3f} s  "
                      f"lost {lost:6.3f} s  (plain iteration {statistics.median(plain):.3f} s)", file=sys.stderr)
    finally:
        for mgr in managers.values():
            mgr.close()
        shutil.rmtree(root, ignore_errors=True)
    copy = statistics.median(copies)
    print(f"\nstate {nbytes / 1e6:.0f} MB; torch copy of its bytes {copy:.3f} s (median of {len(copies)}); "
          f"medians of {args.rounds} rounds, x = / torch copy")
    print(f"{'':46s} {'save()':>14s} {'step wait':>14s} {'lost':>14s}")
    for name, row in rows.items():
        cells = [f"{statistics.median(v):6.3f} s x{statistics.median(v) / copy:4.2f}" for v in row.values()]
        print(f"{name:46s} " + " ".join(f"{c:>14s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
