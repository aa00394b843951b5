"""A DeepSpeed training run for the tests (real DeepSpeed on CPU, under torchrun with ``DS_ACCELERATOR=cpu``).

    python ds_run.py OUT --stage {1,2,3} [--bf16 | --fp16] [--model toy|llama] [--hidden 32] [--steps 3] [--more 0]
                         [--hf] [--load UNIVERSAL_DIR]

Trains ``--steps`` steps of AdamW with a StepLR scheduler on fixed per-rank batches and saves with
``engine.save_checkpoint``; ``--hf`` saves into ``OUT/checkpoint-N/`` beside the model's ``config.json`` (what the HF
Trainer does); ``--more K`` trains K further steps and saves again (DeepSpeed's own continuation, to compare a resume
with). ``OUT/logits.pt`` keeps the model's logits on a fixed input after the first save. ``--load DIR`` instead loads
a universal folder with ``load_universal`` and trains ``--steps`` more steps: ``OUT/loaded.pt`` keeps what it loaded
and the losses. ``--hidden`` is the toy model's width (33 gives parameters of odd sizes, which ZeRO-3 pads).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from toy import VOCAB, TinyLM, llama_config  # noqa: E402


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--model", default="toy")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--more", type=int, default=0)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--load")
    a = p.parse_args()
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU accelerator compiles a shared-memory allreduce (C++) the first time a process group starts; a
    # machine without a C++ compiler fails there. The files this script writes do not depend on it: gloo carries the
    # same collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    if "RANK" not in os.environ:  # one process, not under torchrun
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    if a.model == "llama":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(attention_dropout=0.0))
    else:
        model = TinyLM(hidden=a.hidden)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": a.stage}, "steps_per_print": 10 ** 6}
    if a.bf16:
        config["bf16"] = {"enabled": True}
    if a.fp16:  # DeepSpeed's CPU accelerator says no to fp16; its ZeRO code and files are the same as on a GPU
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if a.load:
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    first = 0
    if a.load:
        engine.load_checkpoint(a.load)
        first = engine.global_steps
    losses = []

    def train(n: int) -> None:
        for _ in range(n):
            x = batch(rank, engine.global_steps)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))

    def save() -> None:
        where = out / f"checkpoint-{engine.global_steps}" if a.hf else out
        engine.save_checkpoint(str(where))
        if a.hf and rank == 0:
            model.config.save_pretrained(where)

    train(a.steps)
    if a.load:
        if rank == 0:
            torch.save({"first": first, "losses": losses, "lr": engine.optimizer.param_groups[0]["lr"]}, out / "loaded.pt")
        return
    save()
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=torch.arange(16).view(1, 16) % VOCAB).logits.float()
    engine.train()
    if rank == 0:
        torch.save(logits, out / "logits.pt")
    if a.more:
        train(a.more)
        save()


if __name__ == "__main__":
    main()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)
