"""What only a GPU can check, in one command: ckptio's paths with the state on a CUDA device.

    .venv/bin/python tools/device_check.py              # on the first CUDA device; one line and exit 0 without
    .venv/bin/python tools/device_check.py --device cpu # the same checks on the CPU (how the tests run it here)

Options: ``--mb`` (state size, default 256: weights and AdamW's two moments), ``--saves`` (default 10). Under five
minutes on one GPU. Checks, each a row of one table (exit status 1 when one fails):

1. **bitwise**: a model and AdamW on the device, saved and restored in every model format (``safetensors``,
   ``torch_save``), synchronously and in the background (training steps at once after ``save()``, while the
   parameters' and optimizer state's copies are still being made on their own stream), and through the memory tier;
   the restore goes straight onto the device (every restored tensor is on it) and equals the state of the save call
   bit for bit;
2. **staging**: a background save's host buffers are pinned (on CUDA) and the same buffers from save to save;
3. **pause**: what a background ``save()`` blocks, against a device-to-host copy of the same bytes into pinned
   memory (medians; the ratio is the row's number; goal ≤ ×1.2, judged on a device only: on the CPU the guard's row
   and ``../shared/bench/`` measure it at full size);
4. **memory**: device memory allocated, and pinned host memory, back to their level after ``--saves`` saves;
5. **process group**: the same save and restore with a process group of one rank on ``nccl`` (``gloo`` on the
   CPU): the collectives, the background writer's own group and the shared-reads path run on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

Row = tuple[str, bool, str]


def _model(device: torch.device, mb: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    side = max(8, int((mb * 1e6 / 4 / 3 / 4) ** 0.5))
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side) for _ in range(4)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 2)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    side = model[0].in_features
    device = model[0].weight.device
    for _ in range(steps):
        model(torch.randn(4, side, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], device: torch.device) -> str | None:
    """``None`` when ``b`` holds ``a``'s tensors bit for bit, each on ``a``'s device; else what differs."""
    if a.keys() != b.keys():
        return f"keys differ: {sorted(set(a) ^ set(b))[:3]}"
    for k in a:
        if b[k].device != a[k].device:
            return f"{k} restored on {b[k].device}, saved from {a[k].device}"
        if a[k].dtype != b[k].dtype or not torch.equal(a[k].cpu(), b[k].cpu()):
            return f"{k} differs"
    return None


def check_bitwise(device: torch.device, mb: int, root: Path) -> list[Row]:
    from ckptio import CheckpointConfig, CheckpointManager

    rows: list[Row] = []
    for fmt in ("safetensors", "torch_save"):
        for background in (False, True):
            model, opt = _model(device, mb, 0)
            where = root / f"{fmt}-{background}"
            saved = {k: v.clone() for k, v in _state(model, opt).items()}
            with CheckpointManager(CheckpointConfig(checkpoint_dir=str(where), model_save_format=fmt,
                                                    async_save=background), model=model, optimizer=opt) as mgr:
                mgr.save(step=1)
                # in the background the parameters' and optimizer state's copies are made on a stream of their own
                # after save() returned: the next steps' optimizer waits for them (its step pre-hook)
                _train(model, opt, 3)
            model2, opt2 = _model(device, mb, 1)
            with CheckpointManager(CheckpointConfig(checkpoint_dir=str(where)), model=model2, optimizer=opt2) as mgr:
                mgr.restore()
            problem = _same(saved, _state(model2, opt2), device)
            rows.append((f"bitwise: {fmt}, {'background' if background else 'synchronous'}", problem is None,
                         problem or f"restored on {device}"))
    model, opt = _model(device, mb, 0)
    memory = root / "memory-shm"
    config = CheckpointConfig(checkpoint_dir=str(root / "memory"), memory_every_steps=1, memory_dir=str(memory))
    mgr = CheckpointManager(config, model=model, optimizer=opt)
    mgr.save_memory(step=1)
    mgr.close(free_memory=False)  # as a process that died would: the snapshot stays in memory
    saved = {k: v.clone() for k, v in _state(model, opt).items()}
    model2, opt2 = _model(device, mb, 1)
    with CheckpointManager(config, model=model2, optimizer=opt2) as again:
        info = again.restore()
        problem = _same(saved, _state(model2, opt2), device) if info is not None else "nothing restored"
        if info is not None and info.tier != "memory":
            problem = f"restored from the {info.tier} tier"
    rows.append(("bitwise: memory tier", problem is None, problem or f"restored on {device}"))
    return rows


def check_staging_and_memory(device: torch.device, mb: int, saves: int, root: Path) -> list[Row]:
    from ckptio import CheckpointConfig, CheckpointManager

    cuda = device.type == "cuda"
    model, opt = _model(device, mb, 0)
    rows: list[Row] = []
    levels: list[tuple[int, int]] = []
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root / "staging"), async_save=True, keep_latest=1),
                           model=model, optimizer=opt) as mgr:
        pointers = []
        for step in range(1, saves + 1):
            mgr.save(step=step)
            mgr.wait()
            buffers = mgr._saver.stager._buffers
            pointers.append({k: (b.data_ptr(), b.is_pinned() if cuda else False) for k, b in buffers.items()})
            levels.append((torch.cuda.memory_allocated(device) if cuda else 0, _pinned_bytes() if cuda else 0))
    reused = all(p == pointers[0] for p in pointers[1:])
    pinned = all(pin for _ptr, pin in pointers[0].values()) if cuda else True
    rows.append(("staging: the same buffers from save to save", reused,
                 f"{len(pointers[0])} buffers, {mgr.staging_bytes / 1e6:.0f} MB"))
    rows.append(("staging: pinned host buffers", pinned, "pinned" if cuda else "n/a on the CPU"))
    device_growth = levels[-1][0] - levels[1][0]
    host_growth = levels[-1][1] - levels[1][1]
    rows.append((f"memory: device allocated after {saves} saves", abs(device_growth) < 1 << 20,
                 f"{device_growth / 1e6:+.1f} MB since the 2nd save" if cuda else "n/a on the CPU"))
    rows.append((f"memory: pinned host after {saves} saves", abs(host_growth) < 1 << 20,
                 f"{host_growth / 1e6:+.1f} MB since the 2nd save" if cuda else "n/a on the CPU"))
    return rows


def _pinned_bytes() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return 0
    values = stats()
    return int(values.get("allocated_bytes.current", values.get("allocations.current", 0)))


def check_pause(device: torch.device, mb: int, root: Path, rounds: int = 5) -> list[Row]:
    from ckptio import CheckpointConfig, CheckpointManager

    model, opt = _model(device, mb, 0)
    tensors = list(_state(model, opt).values())
    pin = device.type == "cuda"
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]

    def copy() -> None:
        for src, dst in zip(tensors, targets):
            dst.copy_(src, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)

    rows: list[Row] = []
    what = "pinned device-to-host copy" if pin else "host copy"
    for wait in (False, True):  # the default (copies after save() returns), then every copy inside save()
        blocked, copies = [], []
        config = CheckpointConfig(checkpoint_dir=str(root / f"pause-{wait}"), async_save=True, wait_for_staging=wait,
                                  keep_latest=1)
        with CheckpointManager(config, model=model, optimizer=opt) as mgr:
            for step in range(rounds + 1):  # interleaved; the first of each warms its buffers
                copies.append(_timed(copy))
                blocked.append(_timed(lambda: mgr.save(step=step + 1)))
                mgr.wait()
        ratio = statistics.median(blocked[1:]) / statistics.median(copies[1:])
        rows.append((f"pause: save() blocked ÷ {what}{', wait_for_staging' if wait else ''}",
                     ratio <= 1.2 or not pin,  # judged on a device (benchmarks/guard.py: CPU)
                     f"×{ratio:.2f} ({statistics.median(blocked[1:]) * 1e3:.1f} ms ÷ "
                     f"{statistics.median(copies[1:]) * 1e3:.1f} ms; goal ≤ ×1.2)"))
    return rows


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check_group(device: torch.device, mb: int, root: Path) -> list[Row]:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(str(root / "store"), 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        rows = check_bitwise(device, mb, root / "group")[:2]
        return [(f"process group ({backend}): {name.split(': ', 1)[1]}", ok, note) for name, ok, note in rows]
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--saves", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check; "
              "--device cpu runs the same checks on the CPU")
        return 0
    logging.getLogger("ckptio").setLevel(logging.WARNING)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device_check on {device} ({name}), torch {torch.__version__}, {args.mb} MB of state\n", flush=True)
    start = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="ckptio-device-") as tmp:
        root = Path(tmp)
        for check in (lambda: check_bitwise(device, args.mb, root / "bitwise"),
                      lambda: check_staging_and_memory(device, args.mb, args.saves, root),
                      lambda: check_pause(device, args.mb, root),
                      lambda: check_group(device, args.mb, root)):
            for row in check():
                rows.append(row)
                print(f"{'ok  ' if row[1] else 'FAIL'}  {row[0]:<52} {row[2]}", flush=True)
    failed = [r for r in rows if not r[1]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
