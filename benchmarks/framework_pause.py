"""How long a framework's training loop stands still for a checkpoint: its own checkpointing against ckptio's
integration, in one run.

    .venv/bin/python benchmarks/framework_pause.py --framework lightning --size 300MB --repeats 5
    .venv/bin/python benchmarks/framework_pause.py --framework hf --size 300MB --repeats 5
    .venv/bin/python benchmarks/framework_pause.py --framework accelerate --size 300MB --repeats 5

``lightning``: ``trainer.save_checkpoint(path)`` after a fit of one step, with the checkpoint IO swapped between
contenders on the same trainer: Lightning's default (``TorchCheckpointIO``: one ``torch.save`` pickle, not
fsynced), Lightning's ``AsyncCheckpointIO`` around it, ``CkptioCheckpointIO()`` (a committed folder, every file
fsynced) and ``CkptioCheckpointIO(async_save=True)``. ``hf``: the Trainer's ``_save_checkpoint`` (what a ``save_steps`` step
runs: ``checkpoint-N/`` with weights, optimizer, scheduler, RNG and trainer state) of a ``Trainer`` against a
``CkptioTrainer`` sharing its model and optimizer (the same files, fsynced, committed, with a manifest) and a
``CkptioTrainer(async_save=True)``. ``accelerate``: ``Accelerator.save_state(dir)`` against
``CkptioAccelerator.save_state(dir)`` and ``CkptioAccelerator(async_save=True).save_state(dir)`` on the same prepared
model and optimizer. The *pause* is the time the call blocks the training thread; *total* also waits for a background write to be durable. Baselines of the same run: ``torch.save`` of the
same dict, with and without fsync, and a raw write + fsync of as many bytes. One untimed warm-up round, then
every round runs every contender in a shuffled order (seeded); medians, min-max and ratios to the baselines are
printed, because this machine's disk speed varies ±2x between runs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch


def _size(text: str) -> int:
    from ckptio.formats.safetensors.hf_bundle import parse_size

    return parse_size(text)


def _fsync_tree(path: Path) -> None:
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _raw_write(path: Path, nbytes: int, block: bytearray) -> None:
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(block)[: min(left, len(block))])
        os.fsync(fh.fileno())


def lightning_contenders(size: int, root: Path) -> tuple[dict[str, Callable[[Path], Any]], int]:
    """The contenders on one Lightning trainer holding a model + AdamW state of about ``size`` bytes."""
    import logging

    import pytorch_lightning as pl
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from ckptio.lightning import CkptioCheckpointIO

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    width = 1024
    layers = max(1, round(size / 3 / (width * width * 4)))

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8))
    state_bytes = 3 * sum(p.numel() * 4 for p in trainer.lightning_module.parameters())
    ios = {"lightning": TorchCheckpointIO(), "lightning async": AsyncCheckpointIO(TorchCheckpointIO()),
           "ckptio": CkptioCheckpointIO(), "ckptio async": CkptioCheckpointIO(async_save=True)}

    def contender(io: Any) -> Callable[[Path], Any]:
        def save(path: Path) -> Any:
            trainer.strategy.checkpoint_io = io
            trainer.save_checkpoint(path)
            return io

        return save

    out = {name: contender(io) for name, io in ios.items()}
    dump = trainer._checkpoint_connector.dump_checkpoint
    out["torch.save"] = lambda path: torch.save(dump(), path)
    out["torch.save + fsync"] = lambda path: (torch.save(dump(), path), _fsync_tree(path))
    block = bytearray(os.urandom(1 << 20)) * 64
    out["raw write + fsync"] = lambda path: _raw_write(path, state_bytes, block)
    return out, state_bytes


def hf_contenders(size: int, root: Path) -> tuple[dict[str, Callable[[Path], Any]], int]:
    """The Trainer's checkpoint save against CkptioTrainer's, on one Llama + AdamW state of about ``size`` bytes."""
    import itertools

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from ckptio.hf_trainer import CkptioTrainer

    hf_logging.set_verbosity_error()
    hidden, inter, vocab = 1024, 2816, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    layers = max(1, round((size / 3 - 2 * vocab * hidden * 4) / per_layer))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8))
    ids = torch.randint(0, vocab, (2, 16))
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(2)]

    def args(out: Path) -> Any:
        return TrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no")

    plain = Trainer(model=model, args=args(root / "hf"), train_dataset=data)
    plain.train()
    ours = CkptioTrainer(model=model, args=args(root / "ckptio"), train_dataset=data)
    ours.optimizer, ours.lr_scheduler, ours.state = plain.optimizer, plain.lr_scheduler, plain.state
    background = CkptioTrainer(model=model, args=args(root / "async"), train_dataset=data, async_save=True)
    background.optimizer, background.lr_scheduler, background.state = plain.optimizer, plain.lr_scheduler, plain.state
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    steps = itertools.count(1)

    def contender(tr: Any) -> Callable[[Path], Any]:
        def save(path: Path) -> Any:
            tr.args.output_dir = str(path)
            tr.state.global_step = next(steps)
            tr._save_checkpoint(tr.model, None)
            return _Waiter(tr.ckptio_wait) if hasattr(tr, "ckptio_wait") else None

        return save

    out = {"hf": contender(plain), "ckptio": contender(ours), "ckptio async": contender(background)}
    block = bytearray(os.urandom(1 << 20)) * 64
    out["torch.save"] = lambda path: torch.save({"model": model.state_dict(), "optim": plain.optimizer.state_dict()},
                                                path)
    out["torch.save + fsync"] = lambda path: (out["torch.save"](path), _fsync_tree(path))
    out["raw write + fsync"] = lambda path: _raw_write(path, state_bytes, block)
    return out, state_bytes


def accelerate_contenders(size: int, root: Path) -> tuple[dict[str, Callable[[Path], Any]], int]:
    """``Accelerator.save_state`` against ``CkptioAccelerator.save_state`` on one MLP + AdamW state of about
    ``size`` bytes, each accelerator preparing the same model and optimizer."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from ckptio.accelerate import CkptioAccelerator

    width = 1024
    layers = max(1, round(size / 3 / (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()
    state_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())

    def contender(cls: type, **kw: Any) -> Callable[[Path], Any]:
        acc = cls(cpu=True, project_config=ProjectConfiguration(project_dir=str(root / f"{cls.__name__}{len(kw)}")),
                  **kw)
        acc.prepare(model, opt)
        waiter = _Waiter(acc.wait_for_save) if kw else None
        return lambda path: (acc.save_state(str(path)), waiter)[1]

    out = {"accelerate": contender(Accelerator), "ckptio": contender(CkptioAccelerator),
           "ckptio async": contender(CkptioAccelerator, async_save=True)}
    block = bytearray(os.urandom(1 << 20)) * 64
    out["torch.save"] = lambda path: torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    out["torch.save + fsync"] = lambda path: (out["torch.save"](path), _fsync_tree(path))
    out["raw write + fsync"] = lambda path: _raw_write(path, state_bytes, block)
    return out, state_bytes


class _Waiter:
    """What a background contender hands back: ``wait`` blocks until its save is durable."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        self.wait = wait


def _finish(io: Any) -> None:
    if io is None:
        return
    if hasattr(io, "wait"):
        io.wait()
    elif hasattr(io, "_executor"):  # Lightning's AsyncCheckpointIO: teardown waits for its thread
        io.teardown()
        io._executor = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["lightning", "hf", "accelerate"], default="lightning")
    p.add_argument("--size", default="300MB", help="model + optimizer state, about (default 300MB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckptio-pause-", dir=args.dir))
    try:
        build = {"lightning": lightning_contenders, "hf": hf_contenders,
                 "accelerate": accelerate_contenders}[args.framework]
        contenders, nbytes = build(_size(args.size), root)
        ref = args.framework
        pause: dict[str, list[float]] = {n: [] for n in contenders}
        total: dict[str, list[float]] = {n: [] for n in contenders}
        rng = random.Random(0)
        for r in range(args.repeats + 1):  # round 0 is the warm-up
            order = list(contenders)
            rng.shuffle(order)
            for name in order:
                path = root / f"{name.replace(' ', '_')}-{r}.ckpt"
                t0 = time.perf_counter()
                handle = contenders[name](path)
                t1 = time.perf_counter()
                _finish(handle)
                t2 = time.perf_counter()
                if r:
                    pause[name].append(t1 - t0)
                    total[name].append(t2 - t0)
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                print(f"  round {r} {name:20s} pause {t1 - t0:7.3f} s  total {t2 - t0:7.3f} s", file=sys.stderr)
        med = {n: statistics.median(v) for n, v in pause.items()}
        tot = {n: statistics.median(v) for n, v in total.items()}
        print(f"\n{args.framework}: a state of {nbytes / 1e6:.0f} MB, {args.repeats} rounds, medians (min-max); "
              f"{torch.get_num_threads()} torch threads (a background save's pause is a host copy, which uses them)")
        print(f"{'contender':22s} {'pause s':>22s} {'total s':>9s} {'÷ ' + ref:>12s} {'÷ torch.save':>13s}"
              f" {'÷ raw+fsync':>12s}")
        for n in contenders:
            lo, hi = min(pause[n]), max(pause[n])
            print(f"{n:22s} {med[n]:8.3f} ({lo:5.3f}-{hi:5.3f}) {tot[n]:9.3f} {med[n] / med[ref]:12.2f}"
                  f" {med[n] / med['torch.save']:13.2f} {med[n] / med['raw write + fsync']:12.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
