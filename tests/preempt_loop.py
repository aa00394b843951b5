"""A plain training loop of one's own, with ``on_preemption`` set: what ``tests/test_preemption.py`` runs under the
real ``torchrun`` and preempts.

    torchrun --nproc-per-node=2 tests/preempt_loop.py DIR MAX_STEPS exit|return

Each rank prints its pid once (``rank R pid P``), each step it reaches (``rank R step S``), where it resumed
(``rank R resumed at S``) and, when the manager stopped it, ``rank R preempted at S`` (``on_preemption="return"``:
the loop sees ``mgr.preempted``; ``"exit"``: the manager's ``SystemExit`` passes through the loop).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from ckptio import CheckpointConfig, CheckpointManager


def main() -> None:
    folder, max_steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = CheckpointConfig(checkpoint_dir=folder, persist_every_steps=10_000, on_preemption=mode)
    mgr = CheckpointManager(cfg, model=model, optimizer=opt)
    info = mgr.restore()
    start = info.step if info is not None else 0
    print(f"rank {rank} resumed at {start}", flush=True)
    step = start
    try:
        for step in range(start + 1, max_steps + 1):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            print(f"rank {rank} step {step}", flush=True)
            time.sleep(0.05)
            mgr.maybe_save(step=step)
            if mgr.preempted:
                print(f"rank {rank} preempted at {step}", flush=True)
                break
    except SystemExit:
        print(f"rank {rank} preempted at {step} (exiting)", flush=True)
        raise
    finally:
        mgr.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
