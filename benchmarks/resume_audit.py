"""What the resume audit costs a step: a plain training loop, and the same loop calling ``maybe_save(step=...,
metrics={loss, grad_norm, lr})`` after each step with the audit off (``audit_steps=0``) and on (the default), in one
process.

    python benchmarks/resume_audit.py [--steps 600] [--every 50] [--rounds 5]

    python benchmarks/resume_audit.py --accelerate [--steps 600] [--rounds 5]

    python benchmarks/resume_audit.py --memory 1,2 [--steps 60] [--rounds 4]

Each loop trains a small MLP (AdamW) and saves durably every ``--every`` steps (kept: the 2 newest), so the audit
records the 3 steps after each save (one write of the run's record per save, by the record's own thread since
issue 68: before, the training thread's, +13 to +22 ms of the call that made it) and checks nothing else. Rounds
alternate between the three loops (the first is a warm-up); printed: the median time per step of each, its ratio
to the plain loop, the ratio of the loop with the audit to the one without (1.00: it costs nothing measurable) and,
for the noise, the spread of that ratio over the rounds. Then, with no save due, the time of one ``maybe_save`` call
each way.

``--memory K,...``: no durable saves after the first, a memory snapshot every ``K`` steps, the audit on and off
(rounds alternated): the per-step ratio (the median of the rounds'), and how many writes of the record the training
thread made a step (an audit hook on ``os.replace``): with ``K <= 3`` nearly every step ends a window, ~1 write a
step before issue 68, none after.

``--accelerate``: the same step through accelerate (``backward``, ``clip_grad_norm_``, no saves timed), with the
plain ``Accelerator`` and with ``CkptioAccelerator`` after one ``save_state`` (its audit made, the window after the
save passed: what every step outside the windows pays), rounds alternated; then the two hooks' own time a step.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from ckptio import CheckpointConfig, CheckpointManager


def accelerate_main(args: argparse.Namespace) -> None:
    """The per-step cost of the audit's hooks in ``CkptioAccelerator`` (``--accelerate``)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from ckptio.accelerate import CkptioAccelerator

    times: dict[str, list[float]] = {"Accelerator": [], "CkptioAccelerator": []}
    with tempfile.TemporaryDirectory() as tmp:
        loops = {}
        for name, cls in (("Accelerator", Accelerator), ("CkptioAccelerator", CkptioAccelerator)):
            torch.manual_seed(0)
            acc = cls(cpu=True, project_config=ProjectConfiguration(project_dir=f"{tmp}/{name}",
                                                                    automatic_checkpoint_naming=True))
            model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
            model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            loops[name] = (acc, model, opt)
        x = torch.randn(64, 256)

        def step(acc: Any, model: Any, opt: Any) -> None:
            acc.backward(model(x).pow(2).mean())
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()

        ckptio = loops["CkptioAccelerator"]
        ckptio[0].save_state()
        for _ in range(5):  # past the window after the save
            step(*ckptio)
        for r in range(args.rounds + 1):
            for name in (list(loops) if r % 2 else list(reversed(loops))):
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(*loops[name])
                if r:
                    times[name].append((time.perf_counter() - start) / args.steps)
        acc, model, _opt = ckptio
        loss, norm = model(x).pow(2).mean(), torch.tensor(1.0)
        start = time.perf_counter()
        for _ in range(args.calls):
            acc.ckptio_steps.backward(loss, True)
            acc.ckptio_steps.grad_norm(norm)
        hooks = (time.perf_counter() - start) / args.calls
        assert acc.ckptio_audit is not None and not acc.ckptio_audit.wants(acc.ckptio_steps.step + 1)
        acc.end_training()
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(f"{name:20s} {t * 1e3:8.3f} ms/step")
    ratios = sorted(b / a for a, b in zip(times["Accelerator"], times["CkptioAccelerator"]))
    print(f"CkptioAccelerator / Accelerator: x{med['CkptioAccelerator'] / med['Accelerator']:.3f} (rounds: "
          f"x{ratios[0]:.3f} to x{ratios[-1]:.3f})")
    print(f"the audit's hooks (backward, clip_grad_norm_) outside its windows: {hooks * 1e6:.2f} us a step "
          f"({hooks / med['Accelerator']:.3%} of a step)")


def memory_main(args: argparse.Namespace, train_step: Any, model: Any, opt: Any) -> None:
    """The audit's cost a step with the memory tier snapshotting every ``k`` steps (``--memory k,...``): every step
    is in a window, and with ``k <= audit_steps`` nearly every step ends one (the record is written then). Also
    counted: the record's replacements (``os.replace``, seen by an audit hook) made by the training thread."""
    import sys
    import threading

    main_thread, on_loop = threading.get_ident(), {"audit off": 0, "audit on": 0}
    counting: list[str] = []

    def hook(event: str, hook_args: tuple) -> None:
        if counting and event == "os.rename" and str(hook_args[1]).endswith(".ckptio_record.json") \
                and threading.get_ident() == main_thread:
            on_loop[counting[0]] += 1

    sys.addaudithook(hook)
    for k in args.memory:
        on_loop.update({"audit off": 0, "audit on": 0})
        times: dict[str, list[float]] = {"audit off": [], "audit on": []}
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["CKPTIO_MEMORY_DIR"] = f"{tmp}/shm"
            mgrs = {mode: CheckpointManager(CheckpointConfig(
                checkpoint_dir=f"{tmp}/{i}", persist_every_steps=10**9, memory_every_steps=k,
                audit_steps=3 if mode == "audit on" else 0), model=model, optimizer=opt)
                for i, mode in enumerate(times)}
            for mgr in mgrs.values():  # the run's record is written from the first save on: one durable save
                mgr.save(step=0)
            order = list(times)
            for r in range(args.rounds + 1):
                order.reverse()
                for mode in order:
                    mgr, first = mgrs[mode], 1 + r * args.steps
                    counting[:] = [mode] if r else []
                    start = time.perf_counter()
                    for step in range(first, first + args.steps):
                        loss, norm = train_step()
                        mgr.maybe_save(step=step, metrics={"loss": loss, "grad_norm": norm, "lr": 1e-3})
                    if r:
                        times[mode].append((time.perf_counter() - start) / args.steps)
                    counting[:] = []
                    mgr.wait()
            recorded = sum(1 for e in mgrs["audit on"]._goodput.record.events if e["kind"] == "metrics")
            for mgr in mgrs.values():
                mgr.close()
        med = {mode: statistics.median(t) for mode, t in times.items()}
        ratios = sorted(on / off for on, off in zip(times["audit on"], times["audit off"]))
        print(f"memory snapshot every {k} step(s): audit off {med['audit off'] * 1e3:.3f} ms/step, on "
              f"{med['audit on'] * 1e3:.3f} ms/step: on / off x{statistics.median(ratios):.3f} (median of the rounds' "
              f"ratios; rounds x{ratios[0]:.3f} to x{ratios[-1]:.3f}; {recorded} steps recorded for the audit)")
        steps = args.steps * args.rounds
        print(f"  writes of the record by the training thread a step: {on_loop['audit off'] / steps:.3f} audit off, "
              f"{on_loop['audit on'] / steps:.3f} audit on")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--accelerate", action="store_true", help="the audit's per-step cost in CkptioAccelerator")
    parser.add_argument("--memory", type=lambda v: [int(k) for k in v.split(",")], default=None,
                        help="K[,K...]: the audit's per-step cost with a memory snapshot every K steps")
    args = parser.parse_args()
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    if args.accelerate:
        return accelerate_main(args)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)

    def train_step() -> tuple[float, float]:
        loss = model(x).pow(2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item(), norm.item()

    if args.memory:
        return memory_main(args, train_step, model, opt)
    times: dict[str, list[float]] = {"plain": [], "audit off": [], "audit on": []}
    with tempfile.TemporaryDirectory() as tmp:
        mgrs = {mode: CheckpointManager(CheckpointConfig(checkpoint_dir=f"{tmp}/{i}", persist_every_steps=args.every,
                                                         save_top_k=2, audit_steps=3 if mode == "audit on" else 0),
                                model=model, optimizer=opt)
                for i, mode in enumerate(times) if mode != "plain"}
        calls_at: dict[str, dict[int, list[float]]] = {mode: {0: [], 3: []} for mode in mgrs}
        """Per manager, the ``maybe_save`` calls of the steps that save (0) and that write the audit's values (3)."""
        order = list(times)
        for r in range(args.rounds + 1):
            order = order[1:] + order[:1]  # each loop in each place in turn: no order favours one
            for mode in order:
                mgr = mgrs.get(mode)
                first = 1 + r * args.steps
                start = time.perf_counter()
                for step in range(first, first + args.steps):
                    loss, norm = train_step()
                    if mgr is not None:
                        called = time.perf_counter()
                        mgr.maybe_save(step=step, metrics={"loss": loss, "grad_norm": norm, "lr": 1e-3})
                        if r and step % args.every in (0, 3):
                            calls_at[mode][step % args.every].append(time.perf_counter() - called)
                if r:
                    times[mode].append((time.perf_counter() - start) / args.steps)
        recorded = sum(1 for e in mgrs["audit on"]._goodput.record.events if e["kind"] == "metrics")
        calls = {}
        for mode, mgr in mgrs.items():  # nothing due: the call alone
            metrics = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3}
            first = 10**9 + 1
            start = time.perf_counter()
            for step in range(first, first + args.calls):
                mgr.maybe_save(step=step * args.every + 1, metrics=metrics)
            calls[mode] = (time.perf_counter() - start) / args.calls * 1e6
        for mgr in mgrs.values():
            mgr.close()
    med = {mode: statistics.median(t) for mode, t in times.items()}
    plain = med["plain"]
    for mode, t in med.items():
        print(f"{mode:20s} {t * 1e3:8.3f} ms/step   x{t / plain:.3f} the plain loop")
    ratios = sorted(on / off for on, off in zip(times["audit on"], times["audit off"]))
    print(f"audit on / off: x{med['audit on'] / med['audit off']:.3f} (rounds: x{ratios[0]:.3f} to x{ratios[-1]:.3f}; "
          f"{args.steps * (args.rounds + 1) // args.every} saves of each loop, {recorded} steps recorded for the audit)")
    save = statistics.median(calls_at["audit off"][0] + calls_at["audit on"][0])
    write = statistics.median(calls_at["audit on"][3]) - statistics.median(calls_at["audit off"][3])
    print(f"the call 3 steps after a save (it writes the audit's values into the record): {write * 1e3:+.2f} ms with "
          f"the audit, once per save ({write / save:.1%} of the save's {save * 1e3:.0f} ms; "
          f"{write / args.every / plain:.2%} of a step at a save every {args.every} steps of {plain * 1e3:.1f} ms)")
    extra = calls["audit on"] - calls["audit off"]
    print(f"maybe_save(metrics=) with nothing due: {calls['audit off']:.1f} us a call with the audit off, "
          f"{calls['audit on']:.1f} us on ({extra:+.1f} us, {extra * 1e-6 / plain:+.3%} of a plain step)")


if __name__ == "__main__":
    main()
