"""A real run on 2 ranks, killed at random, under ``persist_every_steps="auto"`` and under fixed intervals: what each
loses, measured on the clock and as the run's record tells it (``ckptio report``).

    .venv/bin/python benchmarks/goodput_run.py [--steps 400] [--step-s 0.05] [--mtbf 20] [--mb 96] [--reps 3]

Each configuration trains the same model (``--mb`` MB of weights and AdamW moments over 2 gloo ranks under
``torchrun``) for ``--steps`` steps of ``--step-s`` seconds each (a small computation padded to the step time), and
saves durably (synchronously) at its interval. A driver starts the job and SIGKILLs the whole job (every rank and
``torchrun``) after a running time drawn from an exponential law of mean ``--mtbf`` seconds, then starts it again,
until the job writes its last step. Every configuration meets the same draws in the same order; ``--reps`` rounds,
each with its own draws, the configurations interleaved. Configurations:

* ``auto``: ``persist_every_steps="auto"`` with ``mtbf`` given (the law's mean);
* ``auto, both tiers``: the same with ``memory_every_steps="auto"`` (``/dev/shm`` survives the kill of a job's
  processes, as it survives a process crash on a real node);
* fixed ``every 10`` and ``every 100`` steps: the habits of saving often and saving rarely.

Prints, per configuration and round: the wall time, the kills, the goodput measured (``steps x step time`` over the
wall time, restarts included) and the one the record estimates; then the medians over the rounds and the time
lost next to ``auto``'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

_JOB = '''
import os, sys, time, torch, torch.distributed as dist
from ckptio import CheckpointConfig, CheckpointManager
dist.init_process_group("gloo")
root, steps, step_s, mb, every, memory, mtbf = sys.argv[1:8]
steps, step_s, mb = int(steps), float(step_s), int(mb)
every = every if every == "auto" else int(every)
torch.manual_seed(dist.get_rank())
side = int((mb * 1e6 / 4 / 3 / 4 / dist.get_world_size()) ** 0.5)
model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters())
config = CheckpointConfig(checkpoint_dir=root, persist_every_steps=every, mtbf=mtbf if every == "auto" else None,
                          memory_every_steps="auto" if memory == "1" else None, keep_latest=2)
mgr = CheckpointManager(config, model=model, optimizer=opt)
info = mgr.restore()
x = torch.randn(8, side)
for step in range((info.step if info else 0) + 1, steps + 1):
    deadline = time.perf_counter() + step_s
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(max(0.0, deadline - time.perf_counter()))
    mgr.maybe_save(step=step)
mgr.close()
if dist.get_rank() == 0:
    open(os.path.join(root, "DONE"), "w").close()
dist.destroy_process_group()
'''


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it at once (a job's failure: every rank and its launcher)."""
    tree, todo, found = _children(), [pid], []
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    for victim in found:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(config: tuple[str, str, str], args: argparse.Namespace, draws: list[float], where: Path) -> dict[str, Any]:
    """One configuration to the end, killed after each of ``draws`` seconds of running (in order) that ends before
    the job does."""
    name, every, memory = config
    root = where / name.replace(" ", "_").replace(",", "")
    script = where / "job.py"
    script.write_text(_JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPTIO_MEMORY_DIR=str(Path("/dev/shm") / f"ckptio-bench-{os.getpid()}"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(root),
           str(args.steps), str(args.step_s), str(args.mb), every, memory, f"{args.mtbf}s"]
    start, kills, draw = time.perf_counter(), 0, iter(draws)
    while not (root / "DONE").exists():
        job = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        try:
            _out, err = job.communicate(timeout=next(draw))
            if job.returncode != 0:
                raise SystemExit(f"{name}: the job failed ({job.returncode}):\n{err[-3000:]}")
        except subprocess.TimeoutExpired:
            kill_tree(job.pid)  # torchrun's workers are not in its process group
            job.communicate()
            kills += 1
    wall = time.perf_counter() - start
    from ckptio.goodput.record import RECORD_NAME
    from ckptio.goodput.summary import load

    summary = load((root / RECORD_NAME).read_bytes(), root / RECORD_NAME)
    return {"name": name, "wall": wall, "kills": kills, "measured": args.steps * args.step_s / wall,
            "recorded": summary.goodput, "saves": len(summary.saves["durable"]), "snapshots": len(summary.saves["memory"]),
            "blocked": summary.blocked_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--mtbf", type=float, default=20.0)
    p.add_argument("--mb", type=int, default=96)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    configs = [("auto", "auto", "0"), ("auto, both tiers", "auto", "1"), ("every 10", "10", "0"),
               ("every 100", "100", "0")]
    ideal = args.steps * args.step_s
    print(f"{args.steps} steps of {args.step_s} s ({ideal:.0f} s of training) on 2 ranks, {args.mb} MB of state, "
          f"killed after exponential running times of mean {args.mtbf} s\n", flush=True)
    print(f"{'round':>5} {'config':>18} | {'wall s':>7} {'kills':>5} {'saves':>5} {'snaps':>5} {'blocked s':>9} | "
          f"{'goodput':>7} {'recorded':>8}", flush=True)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _e, _m in configs}
    for rep in range(args.reps):
        draws = np.random.default_rng(args.seed + rep).exponential(args.mtbf, 1000).tolist()
        with tempfile.TemporaryDirectory(prefix="ckptio-goodput-") as tmp:
            for config in configs:
                row = run(config, args, draws, Path(tmp))
                rows[config[0]].append(row)
                print(f"{rep:>5} {row['name']:>18} | {row['wall']:>7.1f} {row['kills']:>5} {row['saves']:>5} "
                      f"{row['snapshots']:>5} {row['blocked']:>9.2f} | {100 * row['measured']:>6.1f}% "
                      f"{100 * (row['recorded'] or 0):>7.1f}%", flush=True)
    print(f"\nmedians over {args.reps} rounds\n{'config':>18} | {'wall s':>7} {'goodput':>7} {'recorded':>8} | "
          f"{'lost s':>7} {'÷ auto':>6}")
    base = statistics.median(r["wall"] for r in rows["auto"]) - ideal
    for name, got in rows.items():
        wall = statistics.median(r["wall"] for r in got)
        print(f"{name:>18} | {wall:>7.1f} {100 * statistics.median(r['measured'] for r in got):>6.1f}% "
              f"{100 * statistics.median(r['recorded'] or 0 for r in got):>7.1f}% | {wall - ideal:>7.1f} "
              f"{(wall - ideal) / base:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
