"""An accelerate training loop checkpointed by ckptio: the only change to a plain accelerate script is the class.

    python examples/accelerate/train.py --dir /tmp/acc --steps 20     # trains, save_state every 5 steps
    python examples/accelerate/train.py --dir /tmp/acc --steps 40     # load_state: the newest complete one
    torchrun --nproc-per-node=2 examples/accelerate/train.py --dir /tmp/acc2 --steps 20   # DDP, 2 processes

Each ``checkpoints/checkpoint_N/`` keeps accelerate's files (the plain ``Accelerator.load_state`` reads it) and
gains a manifest of checksums; it appears under its name only once every process's files are in. The registered
``Progress`` object (steps done) comes back with the model, optimizer, scheduler, sampler and RNG states.
"""

from __future__ import annotations

import argparse

import torch
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

from ckptio.accelerate import CkptioAccelerator  # <- was: from accelerate import Accelerator


class Progress:
    """Anything with state_dict / load_state_dict can be registered for checkpointing."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="accelerate-run")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    accelerator = CkptioAccelerator(  # <- was: Accelerator(
        cpu=not torch.cuda.is_available(),
        project_config=ProjectConfiguration(project_dir=args.dir, automatic_checkpoint_naming=True, total_limit=2),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.square().sum(1, keepdim=True)),
                                         batch_size=16, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state()  # the newest complete checkpoint; nothing (a fresh run) when there is none
    loss = torch.zeros(())
    while progress.step < args.steps:
        epoch, seen = divmod(progress.step, len(loader))
        loader.set_epoch(epoch)  # this epoch's batch order, also on a rerun
        batches = accelerator.skip_first_batches(loader, seen) if seen else loader  # the batches already seen
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step % 5 == 0:
                accelerator.save_state()
            if progress.step >= args.steps:
                break
    accelerator.print(f"trained to step {progress.step}, loss {loss.item():.4f}; checkpoints in {args.dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
