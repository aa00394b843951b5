"""A tiny causal LM and the Trainer runs the HF Trainer integration tests share (importable by spawned ranks)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

RECORD = ".ckptio_record.json"
"""The run's record (``ckptio.goodput.record.RECORD_NAME``, spelled out: this module imports nothing of ckptio)."""


def run_names(root: Path) -> list[str]:
    """What a run left in ``root``, checkpoints by step and hidden ones last, without the runners' ``.pt`` outputs,
    the run's record and what a killed write of it left (a SIGKILL, or a SIGTERM without a handler, can cut the
    record's background write short; the next run sweeps it)."""
    names = (p.name for p in root.iterdir() if p.suffix != ".pt" and not p.name.startswith((RECORD, f".{RECORD}.")))
    return sorted(names, key=lambda n: (n.startswith("."), len(n), n))


def same_tensors(a: dict, b: dict, what: str) -> None:
    """``a`` and ``b`` hold the same names, and under each a tensor of the same dtype and values, bit for bit."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


SCORES = (0.5, 0.9, 0.3, 0.8, 0.6, 0.95, 0.2, 0.4)
"""What the fake metric ``eval_score`` says at the 1st, 2nd, … evaluation: the best is not the latest."""


def model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 8, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(out: Path, max_steps: int = 16, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
                lr_scheduler_type="constant_with_warmup", warmup_steps=6, weight_decay=0.01, save_strategy="steps", save_steps=4,
                logging_steps=1, use_cpu=True, report_to=[], seed=0, disable_tqdm=True, dataloader_num_workers=0,
                ddp_find_unused_parameters=False)
    base.update(kw)
    return TrainingArguments(**base)


def scorer() -> Any:
    """A ``compute_metrics`` whose ``score`` follows :data:`SCORES`, evaluation after evaluation."""
    counter = itertools.count()

    def compute(_: Any) -> dict[str, float]:
        return {"score": SCORES[next(counter) % len(SCORES)]}

    return compute


def trainer(cls: Any, out: Path, max_steps: int = 16, *, evaluate: bool = False, **kw: Any) -> Any:
    extra: dict[str, Any] = {}
    if evaluate:
        kw.setdefault("eval_strategy", "steps")
        kw.setdefault("eval_steps", 4)
        extra = dict(eval_dataset=Tokens(8, seed=4), compute_metrics=scorer())
    return cls(model=model(), args=arguments(out, max_steps, **kw), train_dataset=Tokens(), **extra)


def state(tr: Any) -> dict[str, torch.Tensor]:
    """Weights and every optimizer moment, by name, for bitwise comparison."""
    out = {f"w/{k}": v.detach().clone() for k, v in tr.model.state_dict().items()}
    for i, st in enumerate(tr.optimizer.state.values()):
        out.update({f"o/{i}/{k}": v.detach().clone() for k, v in st.items()})
    out["lr"] = torch.tensor(tr.optimizer.param_groups[0]["lr"])
    out["step"] = torch.tensor(tr.state.global_step)
    return out
