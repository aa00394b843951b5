"""Fine-tune a causal LM with ckptio checkpointing: one process, or torchrun with FSDP2.

    python examples/llm/finetune.py --config examples/llm/tiny_llama.yaml
    torchrun --nproc-per-node=2 examples/llm/finetune.py --config examples/llm/tiny_llama.yaml \\
        --step_scheduler.ckpt_every_steps 20 --checkpoint.model_save_format torch_save

Every config value can be overridden as ``--section.key value``. Rerunning the same command resumes
from the newest complete checkpoint. SIGTERM (preemption) saves a checkpoint at the end of the current
step and exits cleanly.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_config import RecipeConfig, RecipeConfigError, load_config, to_dict  # noqa: E402


def parse_config(argv: list[str]) -> RecipeConfig:
    """The run's configuration; a bad key or value exits with status 2 naming it (``--help`` and
    ``--print_config`` print and exit 0)."""
    try:
        return load_config(argv)
    except RecipeConfigError as exc:
        print(f"finetune.py: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    # first, before torch and transformers are imported (seconds): --help, --print_config and a mistake answer at once
    CONFIG = parse_config(sys.argv[1:])

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ckptio import CheckpointError, CheckpointManager, ResumableDataLoader, StepScheduler, load_pretrained, read_manifest  # noqa: E402
from data import build_tokenizer, load_corpus, make_splits  # noqa: E402

from ckptio.storage import open_storage, url_scheme  # noqa: E402

# Run assets (the tokenizer the run built, a PEFT run's randomly initialised base model), inside assets_dir
BASE_MODEL_DIR = "base_model"
TOKENIZER_DIR = "tokenizer"


def assets_dir(cfg: RecipeConfig) -> Path:
    """The local folder of the run's assets: ``cfg.assets_dir``, else hidden beside the step directories
    (``<checkpoint_dir>/.recipe``, so `ckptio list` shows checkpoints only), else, for a checkpoint_dir in
    object storage, a local cache folder named after it. A URL never becomes a local path."""
    if cfg.assets_dir:  # load_config refused a URL
        return Path(cfg.assets_dir)
    where = str(cfg.checkpoint.checkpoint_dir)
    if url_scheme(where) is None:
        return Path(where) / ".recipe"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ckptio" / "recipe" / re.sub(r"[^A-Za-z0-9._-]+", "_", where).strip("_")


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class FinetuneRecipe:
    """Builds everything from a :class:`RecipeConfig`; every attribute with ``state_dict`` is checkpointed."""

    def __init__(self, cfg: RecipeConfig) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        random.seed(cfg.seed + self.rank)
        np.random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed + self.rank)
        if cfg.checkpoint.enabled:  # a folder the run could not save into (nor keep its assets in): said before building
            open_storage(cfg.checkpoint.checkpoint_dir).check_writable()
        assets = assets_dir(cfg)

        text = load_corpus(cfg.data.corpus, cfg.data.num_sentences, cfg.data.seed)
        self.tokenizer = self._tokenizer(text, assets / TOKENIZER_DIR)
        train, val = make_splits(text, self.tokenizer, cfg.data.seq_len, cfg.data.val_fraction)
        self.model, base_dir = self._build_model(assets)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)
        self.dataloader = ResumableDataLoader(train, cfg.data.batch_size, shuffle=True, seed=cfg.data.seed)
        self.val_data = val
        s = cfg.step_scheduler
        self.step_scheduler = StepScheduler(max_steps=s.max_steps, num_epochs=s.num_epochs,
                                            ckpt_every_steps=s.ckpt_every_steps, val_every_steps=s.val_every_steps)
        self.best = BestMetric()
        self.stats = RunStats()
        if cfg.checkpoint.on_preemption is None:  # SIGTERM: save at the end of the step, then stop (docs/preemption.md)
            cfg.checkpoint.on_preemption = "return"
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader, step_scheduler=self.step_scheduler, tokenizer=self.tokenizer,
            base_model_path=base_dir, extra_states=self._extra_states(),
        )

    # -------------------------------------------------------------- building
    def _tokenizer(self, text: str, saved: Path):
        from transformers import AutoTokenizer

        if self.cfg.model.pretrained_path and (Path(self.cfg.model.pretrained_path) / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(self.cfg.model.pretrained_path)
        if (saved / "tokenizer.json").is_file():  # a resumed run keeps the tokenizer it started with
            return AutoTokenizer.from_pretrained(saved)
        tok = build_tokenizer(text, self.cfg.model.vocab_size)
        if self.rank == 0:
            tok.save_pretrained(saved)
        return tok

    def _build_model(self, assets: Path):
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

        m = self.cfg.model
        base_dir = None
        if m.pretrained_path:
            config = AutoConfig.from_pretrained(m.pretrained_path)
            base_dir = str(Path(m.pretrained_path).resolve())
        else:
            config = LlamaConfig(
                vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
                tie_word_embeddings=m.tie_word_embeddings, attention_dropout=m.attention_dropout,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
            )
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every rank
        # on meta, no rank allocates random weights that would be overwritten at once; LoRA adapters,
        # though, need real initial values, so a PEFT base is built on the CPU
        on_meta = bool(m.pretrained_path) and not self.cfg.peft.enabled
        with torch.device("meta") if on_meta else torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(config)
        if self.cfg.peft.enabled and not m.pretrained_path:
            # a PEFT adapter refers to its base model by path: keep the randomly initialised base on disk
            base_dir = str((assets / BASE_MODEL_DIR).resolve())
            if self.rank == 0 and not (Path(base_dir) / "config.json").is_file():
                model.save_pretrained(base_dir)
                self.tokenizer.save_pretrained(base_dir)
        layers = model.model.layers
        if self.cfg.peft.enabled:
            from peft import LoraConfig, get_peft_model

            p = self.cfg.peft
            model = get_peft_model(model, LoraConfig(r=p.r, lora_alpha=p.lora_alpha, lora_dropout=p.lora_dropout,
                                                     target_modules=list(p.target_modules), task_type="CAUSAL_LM"))
        if self.world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in layers:
                fully_shard(layer)
            fully_shard(model)
        if m.pretrained_path:
            load_pretrained(model, m.pretrained_path)
        return model, base_dir

    def _extra_states(self) -> dict:
        handled = {"model", "optimizer", "lr_scheduler", "dataloader", "step_scheduler", "checkpointer"}
        return {name: value for name, value in vars(self).items()
                if name not in handled and not isinstance(value, torch.nn.Module)
                and callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))}

    def _lr_lambda(self, step: int) -> float:
        o, total = self.cfg.optimizer, self.cfg.step_scheduler.max_steps or 1000
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    # -------------------------------------------------------------- running
    def validate(self) -> float:
        self.model.eval()
        total, count = torch.zeros(()), torch.zeros(())
        with torch.no_grad():
            for i in range(self.rank, len(self.val_data), self.world):
                batch = self.val_data[i:i + 1]
                total += self.model(input_ids=batch, labels=batch).loss
                count += 1
            if dist.is_initialized():
                both = torch.stack([total, count])
                dist.all_reduce(both)
                total, count = both[0], both[1]
        self.model.train()
        return (total / count.clamp(min=1)).item()

    def run(self) -> None:
        try:
            preempted = self._train()
        finally:
            # waits for a background save in flight (async_save) and raises its error, if any
            self.checkpointer.close()
        if not preempted:
            if self.cfg.export_lightning:
                from ckptio.formats.lightning import save_lightning

                steps = self.step_scheduler
                save_lightning(self.cfg.export_lightning, self.model, self.optimizer, self.lr_scheduler,
                               step=steps.step, epoch=steps.epoch)
                log(f"Exported the final state as a Lightning checkpoint: {self.cfg.export_lightning}")
            self.summary()

    def _train(self) -> bool:
        """The training loop; whether it stopped because of a preemption signal."""
        info = self.checkpointer.restore()
        steps = self.step_scheduler
        if info is None and self.cfg.init_from_lightning:
            self._init_from_lightning(self.cfg.init_from_lightning)
        elif info is None:
            log(f"Starting fresh: {self.world} rank(s), max_steps={steps.max_steps}")
        else:
            log(f"Resumed at step {steps.step} (epoch {steps.epoch}); continuing to step {steps.max_steps}")
        log_file = open(self.cfg.log_file, "a") if self.cfg.log_file and self.rank == 0 else None
        self.model.train()
        t0, tokens = time.perf_counter(), 0
        while not steps.done:
            for batch in self.dataloader:
                loss = self.model(input_ids=batch, labels=batch).loss
                loss.backward()
                self.optimizer.step()
                self.lr_scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                steps.step += 1
                self.stats.steps_run += 1
                tokens += batch.numel() * self.world
                loss_value, lr = loss.item(), self.lr_scheduler.get_last_lr()[0]
                if log_file is not None:
                    log_file.write(json.dumps({"step": steps.step, "loss": loss_value, "lr": lr}) + "\n")
                    log_file.flush()
                if steps.step % self.cfg.step_scheduler.log_every_steps == 0 or steps.step == 1:
                    rate = tokens / max(1e-9, time.perf_counter() - t0)
                    log(f"step {steps.step:>5}/{steps.max_steps} | loss {loss_value:.4f} | "
                        f"lr {lr:.2e} | {rate:,.0f} tok/s")
                metrics = {"loss": loss_value, "lr": lr}  # the resume audit's (docs/goodput.md), kept in each manifest
                # the last step and, with checkpoint.monitor, a preemption save are ranked too
                stop = bool(self.cfg.checkpoint.monitor) and self.checkpointer.preemption_pending()
                if steps.is_val_step() or (steps.done and steps.val_every_steps) or stop:
                    metrics["val_loss"] = self.validate()
                    self.best.update(steps.step, metrics["val_loss"])
                    log(f"step {steps.step:>5} | val_loss {metrics['val_loss']:.4f}")
                consumed = steps.step * self.cfg.data.batch_size * self.world
                # a durable save when the step scheduler says so (and at the end), else a memory-tier snapshot when
                # one is due (docs/memory-tier.md); after SIGTERM on any rank, a durable save here (docs/preemption.md)
                self.checkpointer.maybe_save(metrics=metrics, counters={"consumed_samples": consumed})
                if self.checkpointer.preempted:
                    log(f"SIGTERM received: saved step {steps.step} and stopping; rerun the command to resume")
                    return True
                if steps.done:
                    break
            else:
                steps.epoch += 1
        return False

    def _init_from_lightning(self, path: str) -> None:
        """Weights, optimizer and scheduler state, step and epoch from a Lightning checkpoint."""
        from ckptio.formats.lightning import load_lightning

        if self.world > 1:
            raise SystemExit("init_from_lightning runs on one process; convert first, then resume on several ranks")
        pos = load_lightning(path, self.model, self.optimizer, self.lr_scheduler)
        steps = self.step_scheduler
        steps.step, steps.epoch = pos.step, pos.epoch
        # the loader continues after the batches Lightning consumed in its current epoch
        self.dataloader.load_state_dict({"epoch": pos.epoch, "consumed": pos.batches_in_epoch * self.cfg.data.batch_size,
                                         "seed": self.cfg.data.seed})
        log(f"Initialised from Lightning checkpoint {path}: step {pos.step}, epoch {pos.epoch}; "
            f"continuing to step {steps.max_steps}")

    def summary(self) -> None:
        saved = self.checkpointer.last_saved
        log("")
        log(f"Done: {self.step_scheduler.step} steps ({self.stats.steps_run} in this run).")
        log(f"Checkpoints: {self.cfg.checkpoint.checkpoint_dir} (newest: {saved})")
        if self.best.step is not None:
            log(f"Best val_loss: {self.best.value:.4f} at step {self.best.step}")
        if saved is not None and self.cfg.peft.enabled:
            log(f"Load the adapter: peft.AutoPeftModelForCausalLM.from_pretrained({str(saved / 'model')!r})")
        elif saved is not None and any(f.startswith("model/consolidated/") for f in read_manifest(saved).files):
            log(f"Load the model: transformers.AutoModelForCausalLM.from_pretrained("
                f"{str(saved / 'model' / 'consolidated')!r})")
        elif saved is not None:
            log(f"Export it for transformers: ckptio consolidate {saved}")


class BestMetric:
    """The best validation loss so far; checkpointed like any other recipe attribute."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.value = float("inf")

    def update(self, step: int, value: float) -> None:
        if value < self.value:
            self.step, self.value = step, value

    def state_dict(self) -> dict:
        return {"step": -1 if self.step is None else self.step, "value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.step = None if sd["step"] < 0 else int(sd["step"])
        self.value = float(sd["value"])


class RunStats:
    """Counters of this process only; not checkpointed (no state_dict)."""

    def __init__(self) -> None:
        self.steps_run = 0


def main(cfg: RecipeConfig) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log("Config: " + json.dumps(to_dict(cfg), sort_keys=True))
    try:
        FinetuneRecipe(cfg).run()
    except CheckpointError as exc:  # a checkpoint or its storage refused: the message says which and why
        print(f"finetune.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _exit(code: int) -> None:
    # With transformers imported, a rank sometimes aborts during interpreter teardown after all of its
    # work is durable. Leave through os._exit once the group is torn down and output flushed; any real
    # failure raised before this point still exits non-zero with its traceback.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(CONFIG))
