"""A tiny Llama training setup shared by the tests (built from a config: no downloads)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader, StepScheduler

VOCAB = 64
SEQ = 16


def llama_config(**overrides: Any):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attention_dropout=0.1)
    kw.update(overrides)
    return LlamaConfig(**kw)


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class TinyLM(torch.nn.Module):
    """A small language model in plain torch, shaped like the tiny Llama (``model.embed_tokens``,
    ``model.layers``, ``lm_head``, dropout) and called like it (``model(input_ids=…, labels=…).loss``).

    What ``CKPTIO_TOY_MODEL=plain`` gives the multi-node tests' ``torchrun`` workers: a fresh interpreter that does
    not import transformers starts ~4 s sooner, and those tests are about the checkpointing, not the model."""

    def __init__(self, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, hidden)
        self.model.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(2 * hidden, hidden)) for _ in range(layers))
        self.lm_head = torch.nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        from types import SimpleNamespace

        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = h + layer(h)
        logits = self.lm_head(h)
        loss = None if labels is None else torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(logits=logits, loss=loss)


def make_model(seed: int = 0, peft: bool = False, base_dir: str | None = None, **overrides: Any) -> torch.nn.Module:
    """The tiny Llama (LoRA-wrapped when ``peft``), FSDP2-sharded when there are several ranks; :class:`TinyLM`
    instead when ``CKPTIO_TOY_MODEL=plain``.

    ``base_dir``: rank 0 saves the base model there first (what a PEFT adapter refers to).
    """
    import os

    torch.manual_seed(seed)
    if os.environ.get("CKPTIO_TOY_MODEL") == "plain" and not peft and base_dir is None:
        model: Any = TinyLM()
        return _sharded(model, model.model.layers)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(**overrides))
    if base_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        model.save_pretrained(base_dir)
    layers = model.model.layers
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    return _sharded(model, layers)


def _sharded(model: torch.nn.Module, layers: Any) -> torch.nn.Module:
    if world() > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    return model


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 96, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class Counter:
    """A user object registered by name."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = sd["seen"]


class Run:
    """Model + AdamW + warmup scheduler + shuffling loader + step scheduler + manager."""

    def __init__(self, ckpt_dir: str | Path, fmt: str = "safetensors", max_steps: int = 12,
                 ckpt_every: int | None = None, seed: int = 0, peft: bool = False, base_dir: str | None = None,
                 freeze: bool = False, **config: Any) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        random.seed(100 + rank)
        np.random.seed(200 + rank)
        torch.manual_seed(300 + rank)
        self.model = make_model(seed, peft=peft, base_dir=base_dir)
        self.model.train()
        if freeze:  # a frozen fine-tune: the embeddings (tied to the output head) and the first half of the layers
            for p in [*self.model.model.embed_tokens.parameters(), *self.model.model.layers[0].parameters()]:
                p.requires_grad_(False)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.loader = ResumableDataLoader(TokenDataset(), batch_size=4, shuffle=True, seed=7)
        self.steps = StepScheduler(max_steps=max_steps, ckpt_every_steps=ckpt_every)
        self.counter = Counter()
        self.mgr = CheckpointManager(
            CheckpointConfig(checkpoint_dir=str(ckpt_dir), model_save_format=fmt, is_peft=peft, **config),
            model=self.model, optimizer=self.opt, lr_scheduler=self.sched, dataloader=self.loader,
            step_scheduler=self.steps, extra_states={"counter": self.counter}, base_model_path=base_dir,
        )
        self.losses: dict[int, float] = {}

    def train(self, save_at: tuple[int, ...] = (), stop_at: int | None = None,
              after_step: Callable[[], None] | None = None) -> None:
        """Train to ``stop_at`` (default: the end); after each step, ``after_step()`` if given, else a save at the
        steps of ``save_at`` and at the step scheduler's checkpoint steps."""
        stop = stop_at if stop_at is not None else self.steps.max_steps
        while self.steps.step < stop:
            for batch in self.loader:
                loss = self.model(input_ids=batch, labels=batch).loss
                loss.backward()
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
                self.steps.step += 1
                self.counter.seen += batch.shape[0]
                self.losses[self.steps.step] = loss.item()
                if after_step is not None:
                    after_step()
                elif self.steps.step in save_at or self.steps.is_ckpt_step():
                    self.mgr.save()
                if self.steps.step >= stop:
                    break
            else:
                self.steps.epoch += 1


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, unsharded, on CPU (collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    out = {f"model/{k}": v.clone() for k, v in get_model_state_dict(model, options=opts).items()}
    if opt is not None:
        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True))
        out.update({f"optim/{k}": v.clone() for k, v in osd.items() if isinstance(v, torch.Tensor)})
    return out


def make_tokenizer(vocab_size: int = VOCAB):
    """A character-level tokenizer with exactly ``vocab_size`` tokens, built locally (no hub)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = list(" abcdefghijklmnopqrstuvwxyz.,!?'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-:;\"()")
    vocab = {tok: i for i, tok in enumerate((specials + chars)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def fsdp_mlp(width: int, layers: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of Linear layers, each and the whole sharded with FSDP2 (call under a process group), and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def finish(run: Run, out: Path) -> None:
    """The end of a worker process started by torchrun: wait for the saves, rank 0 writes ``out/final.pt`` (the step
    and the whole state), close, leave the group, and exit with ``os._exit(0)`` (the known interpreter-exit abort
    after ``destroy_process_group``: the work is done and saved)."""
    import os
    import sys

    run.mgr.wait()
    state = full_state(run.model, run.opt)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save({"step": run.steps.step, "state": state}, out / "final.pt")
    run.mgr.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
