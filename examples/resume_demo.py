"""Train a tiny Llama, get interrupted, rerun, and resume exactly where it stopped.

    python examples/resume_demo.py --checkpoint-dir runs/demo --max-steps 30 --stop-at 15   # "crashes" at 15
    python examples/resume_demo.py --checkpoint-dir runs/demo --max-steps 30                # resumes from 15
    torchrun --nproc-per-node=2 examples/resume_demo.py ...                                 # same, FSDP2

The model is built from a config (no downloads); the data are random token sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader, StepScheduler


def build_model(world: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, attention_dropout=0.1)
    model = LlamaForCausalLM(cfg)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--model-save-format", default="safetensors", choices=["safetensors", "torch_save"])
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--ckpt-every-steps", type=int, default=5)
    p.add_argument("--stop-at", type=int, default=None, help="exit after this step, as if the job were killed")
    p.add_argument("--report", default=None, help="write the final loss and step to this JSON file")
    args = p.parse_args()

    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    random.seed(rank), np.random.seed(rank), torch.manual_seed(rank)

    model = build_model(world)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = torch.randint(0, 128, (512, 32), generator=torch.Generator().manual_seed(0))
    loader = ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0)
    steps = StepScheduler(max_steps=args.max_steps, ckpt_every_steps=args.ckpt_every_steps)
    mgr = CheckpointManager(
        CheckpointConfig(checkpoint_dir=args.checkpoint_dir, model_save_format=args.model_save_format),
        model=model, optimizer=opt, lr_scheduler=lr, dataloader=loader, step_scheduler=steps,
    )
    info = mgr.restore()
    if rank == 0:
        print(f"[demo] {'resuming at step ' + str(info.step) if info else 'starting fresh'} on {world} rank(s)")

    loss = torch.tensor(float("nan"))
    model.train()
    while not steps.done:
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            lr.step()
            opt.zero_grad()
            steps.step += 1
            if rank == 0 and (steps.step % 5 == 0 or steps.step == 1):
                print(f"[demo] step {steps.step:>4}  loss {loss.item():.4f}")
            if steps.is_ckpt_step() or steps.done:
                mgr.save()
            if args.stop_at is not None and steps.step >= args.stop_at:
                if rank == 0:
                    print(f"[demo] simulated interruption after step {steps.step}")
                _exit(0)
            if steps.done:
                break
        else:
            steps.epoch += 1
    if rank == 0:
        print(f"[demo] finished {steps.step} steps, final loss {loss.item():.6f}")
        if args.report:
            with open(args.report, "w") as fh:
                json.dump({"step": steps.step, "loss": loss.item()}, fh)
    _exit(0)


def _exit(code: int) -> None:
    # Leave without interpreter teardown once the work is done: with transformers imported, a rank
    # occasionally aborts in teardown after destroy_process_group although everything was written.
    import sys

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
