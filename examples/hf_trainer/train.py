"""A Hugging Face Trainer run checkpointed by ckptio: the only change to a plain Trainer script is the class.

    python examples/hf_trainer/train.py --dir /tmp/hf --steps 20     # trains, checkpoints every 5 steps
    python examples/hf_trainer/train.py --dir /tmp/hf --steps 40     # resumes from the newest complete one

Each ``checkpoint-N/`` keeps the Trainer's files (``from_pretrained`` loads it, the plain Trainer resumes from it)
and gains a manifest of checksums written last; it appears under its name only once complete. The model is a tiny
Llama built from a config, so nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from ckptio.hf_trainer import CkptioTrainer  # <- was: from transformers import Trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="hf-checkpoints")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    training = TrainingArguments(output_dir=args.dir, max_steps=args.steps, per_device_train_batch_size=8,
                                 learning_rate=1e-3, save_steps=5, save_total_limit=2, logging_steps=5, use_cpu=True,
                                 report_to=[], disable_tqdm=True)
    trainer = CkptioTrainer(model=model, args=training, train_dataset=Tokens())  # <- was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)  # the newest complete checkpoint; a fresh run when there is none
    print(f"trained to step {trainer.state.global_step}; checkpoints in {args.dir}")


if __name__ == "__main__":
    main()
