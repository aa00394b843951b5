"""Converting a DeepSpeed checkpoint: ckptio against DeepSpeed's own ``zero_to_fp32`` on the same checkpoint (issue 48).

    .venv/bin/python benchmarks/deepspeed_convert.py                 # medium state: 268M parameters (1.07 GB fp32)
    .venv/bin/python benchmarks/deepspeed_convert.py --layers 4      # a smaller one

The model is the Llama-shaped fp32 stack of ``frozen_finetune.py`` (embeddings, ``--layers`` blocks of four d×d and
two d×4d matrices, an output head), nothing frozen. The real DeepSpeed (CPU, ``DS_ACCELERATOR=cpu``) trains it one
step under ZeRO-2 on 2 ranks (torchrun) and saves: fp32 weights, masters and both Adam moments, about 4 times the
weights on disk. Then, each in a fresh process, in turns (``--rounds``, interleaved), timed and with its peak RSS (the
kernel's high-water mark of that process):

* **zero_to_fp32**: the script DeepSpeed writes beside the checkpoint, to safetensors (weights only);
* **ckptio → hf**: ``ckptio convert RUN OUT --to hf`` (weights, one parameter at a time);
* **ckptio → universal**: ``--to deepspeed-universal`` of a ckptio step directory made from it (weights and Adam);
* **ckptio → step_dir**: ``--to step_dir``, the whole training state (the optimizer is written in one piece: its
  bound is the optimizer state, not one parameter's).

The goal for streaming: peak RSS ≤ 4 × the largest parameter's fp32 state + 300 MiB. Printed: medians, the ratio
of each time to zero_to_fp32's, and each peak against the goal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _model(dim: int, layers: int, vocab: int):
    import torch

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, dim)
            self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict(
                {n: torch.nn.Linear(dim, dim, bias=False) for n in ("q", "k", "v", "o")}
                | {"up": torch.nn.Linear(dim, 4 * dim, bias=False), "down": torch.nn.Linear(4 * dim, dim, bias=False)})
                for _ in range(layers))
            self.head = torch.nn.Linear(dim, vocab, bias=False)

        def forward(self, x):
            h = self.embed(x)
            for b in self.blocks:
                h = h + b["o"](b["q"](h) + b["k"](h) + b["v"](h)) + b["down"](torch.relu(b["up"](h)))
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())

    torch.manual_seed(0)
    return Stack()


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: one ZeRO-2 step of the stack, saved into ``args.out``."""
    import deepspeed
    import torch

    deepspeed.init_distributed("gloo")
    model = _model(args.dim, args.layers, args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 6})
    x = torch.randint(0, args.vocab, (1, 8))
    engine.backward(engine(x))
    engine.step()
    engine.save_checkpoint(args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


_MEASURE = """
import resource, runpy, sys, time
start = time.perf_counter()
sys.argv = sys.argv[1:]
if sys.argv[0] == "ckptio":
    from ckptio.cli import main
    assert main(sys.argv[1:]) == 0
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
print("MEASURED", time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _measure(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    r = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, env=env)
    line = [x for x in r.stdout.splitlines() if x.startswith("MEASURED")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"{argv[:2]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    _, seconds, rss = line[-1].split()
    return float(seconds), int(rss)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    root = Path(tempfile.mkdtemp(prefix="ckptio-ds-bench-", dir=args.dir))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    try:
        run = root / "run"
        print(f"[bench] training one ZeRO-2 step on 2 ranks and saving into {run}", flush=True)
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(HERE), "--worker", "--out", str(run), "--dim", str(args.dim), "--layers",
                            str(args.layers), "--vocab", str(args.vocab)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"the DeepSpeed run failed:\n{r.stderr[-4000:]}")
        on_disk = sum(f.stat().st_size for f in run.rglob("*.pt"))
        largest = 4 * max(args.vocab * args.dim, 4 * args.dim * args.dim)
        goal = 4 * largest + (300 << 20)
        step = root / "ckpt" / "step_1"
        step.parent.mkdir()
        ckptio = ["ckptio"]
        _measure([*ckptio, "convert", str(run), str(step), "--to", "step_dir"], env)  # the universal source
        contenders = {
            "zero_to_fp32": lambda out: [str(run / "zero_to_fp32.py"), str(run), str(out), "--safe_serialization"],
            "ckptio -> hf": lambda out: [*ckptio, "convert", str(run), str(out), "--to", "hf"],
            "ckptio -> universal": lambda out: [*ckptio, "convert", str(step), str(out), "--to", "deepspeed-universal"],
            "ckptio -> step_dir": lambda out: [*ckptio, "convert", str(run), str(out), "--to", "step_dir"],
        }
        samples: dict[str, list[tuple[float, int]]] = {k: [] for k in contenders}
        for i in range(args.rounds):
            for name, argv in contenders.items():
                out = root / f"out-{i}"
                samples[name].append(_measure(argv(out), env))
                shutil.rmtree(out, ignore_errors=True)
                print(f"[bench] round {i + 1}: {name}: {samples[name][-1][0]:.1f} s, "
                      f"{samples[name][-1][1] / 2 ** 20:.0f} MiB peak", flush=True)
        print(f"\nDeepSpeed ZeRO-2 checkpoint, 2 ranks: {on_disk / 1e9:.2f} GB of .pt files; largest parameter "
              f"{largest / 2 ** 20:.0f} MiB fp32; goal for streaming: peak RSS <= {goal / 2 ** 20:.0f} MiB\n")
        base = statistics.median(s for s, _ in samples["zero_to_fp32"])
        print(f"{'':22}{'median s':>10}{'x zero_to_fp32':>16}{'peak MiB':>10}{'x goal':>8}")
        for name, got in samples.items():
            t, rss = statistics.median(s for s, _ in got), max(m for _, m in got)
            print(f"{name:22}{t:10.1f}{t / base:16.2f}{rss / 2 ** 20:10.0f}{rss / goal:8.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
