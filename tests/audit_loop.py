"""A plain training loop of one's own, killed and resumed by ``tests/test_resume_audit.py`` (the resume audit).

    python tests/audit_loop.py DIR MAX_STEPS KILL_AT [no-dataloader] [no-rng] [no-scheduler] [memory=N] [persist=N]
    torchrun --nproc-per-node=2 tests/audit_loop.py ...   (gloo)

A tiny model with dropout (data parallel on several ranks), a :class:`ckptio.ResumableDataLoader` that shuffles, AdamW and a step scheduler; a durable
save every 5 steps (``persist=N``: every N), a memory snapshot every N steps with ``memory=N`` (the memory folder:
``CKPTIO_MEMORY_DIR``); after each step ``maybe_save(step=..., metrics={loss, grad_norm, lr})``, nothing else of the
audit. At step ``KILL_AT`` (0: never) the process kills itself with SIGKILL (every rank), right after
``maybe_save`` and the commit of what it started. The words after it leave that state out of the manager (the
resumed run's mistake).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import torch
import torch.distributed as dist

from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader


def main() -> None:
    folder, max_steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    left_out = {a for a in sys.argv[4:] if "=" not in a}
    every = dict({"persist": "5"}, **dict(a.split("=", 1) for a in sys.argv[4:] if "=" in a))
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where it is, and ends
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = ResumableDataLoader(data, batch_size=4, shuffle=True, seed=1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    cfg = CheckpointConfig(checkpoint_dir=folder, persist_every_steps=int(every["persist"]),
                           memory_every_steps=int(every["memory"]) if "memory" in every else None)
    mgr = CheckpointManager(cfg, model=model, optimizer=opt,
                            lr_scheduler=None if "no-scheduler" in left_out else sched,
                            dataloader=None if "no-dataloader" in left_out else loader, rng="no-rng" not in left_out)
    info = mgr.restore()
    step = info.step if info is not None else 0
    while step < max_steps:
        for x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if dist.is_initialized():  # data parallel by hand: the ranks' gradients averaged, the replicas stay equal
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            mgr.maybe_save(step=step, metrics={"loss": loss.item(), "grad_norm": norm.item(),
                                               "lr": sched.get_last_lr()[0]})
            if step == kill_at:
                mgr.wait()  # the snapshot or save started is committed: the kill comes after it, not racing it
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= max_steps:
                break
    mgr.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
