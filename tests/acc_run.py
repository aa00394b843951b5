"""Run the tiny accelerate loop (``acc_tiny.train``) in a process of its own or under torchrun (DDP on CPU ranks).

    python tests/acc_run.py DIR OUT [--plain | --async] [--resume] [--sigterm-at STEP | --sigkill-at STEP]
                            [--kill-at POINT:N] [--fail-at POINT:RANK] [--bucket URL]
    python -m torch.distributed.run --nproc-per-node=2 tests/acc_run.py DIR OUT [...]

``--plain``: the plain ``Accelerator``; otherwise ``CkptioAccelerator`` (``--async``: ``async_save=True``).
``--sigkill-at STEP``: every rank SIGKILLs itself after step STEP and its save (a background write still in flight).
``--fail-at POINT:RANK``: global rank RANK raises an ``OSError`` the first time a ckptio save reaches the point. ``--resume``: ``load_state()`` first.
``--sigterm-at STEP``: every rank receives SIGTERM after step STEP (a preemption: accelerate has no handler, the
process ends). ``--kill-at POINT:N``: global rank 0 SIGKILLs itself the N-th time a ckptio save reaches the named
point (``ckptio._faults``). ``--on-preemption exit|return``: ``CkptioAccelerator(on_preemption=...)``, the loop calling
``save_on_preemption`` after each step; ``--sigterm-at STEP:RANK``: SIGTERM to global rank RANK alone;
``--own-handler``: a SIGTERM handler of the script's own, installed first, prints ``own handler ran on rank R``; with
``"return"`` each rank prints ``rank R preempted at S``. ``--clip``: ``clip_grad_norm_`` each step; ``--no-skip``: a
resumed run does not skip the batches already seen (another data order). ``--bucket URL``:
``ckptio_checkpoint_dir=URL`` (the checkpoints in object storage; the store's settings come from the environment).
The main process writes the final state to OUT (not after a preemption).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from acc_tiny import train  # noqa: E402
from distributed import kill_at  # noqa: E402


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def fail_at(spec: str) -> None:
    """``POINT:RANK``: global rank RANK raises an ``OSError`` (a disk full) the first time a ckptio save reaches the
    fault point POINT."""
    from ckptio import _faults

    point, rank = spec.split(":")
    seen = [0]

    def hook(name: str) -> None:
        if name == point and int(os.environ.get("RANK", "0")) == int(rank) and not seen[0]:
            seen[0] = 1
            raise OSError(28, f"No space left on device (injected at {point} on rank {rank})")

    _faults.set_hook(hook)


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    if "--plain" in sys.argv:
        cls = Accelerator
    else:
        from ckptio.accelerate import CkptioAccelerator as cls
    if _arg("--kill-at") and int(os.environ.get("RANK", "0")) == 0:
        kill_at(_arg("--kill-at"))
    if _arg("--fail-at"):
        fail_at(_arg("--fail-at"))
    at, _, whom = (_arg("--sigterm-at") or _arg("--sigkill-at") or "0").partition(":")
    how = signal.SIGKILL if _arg("--sigkill-at") else signal.SIGTERM
    rank = os.environ.get("RANK", "0")

    def on_step(done: int) -> None:
        if done == int(at) and whom in ("", rank):
            os.kill(os.getpid(), how)

    kw: dict = {"async_save": True} if "--async" in sys.argv else {}
    if _arg("--bucket"):
        kw["ckptio_checkpoint_dir"] = _arg("--bucket")
    if _arg("--on-preemption"):
        kw["on_preemption"] = _arg("--on-preemption")
    if "--own-handler" in sys.argv:
        signal.signal(signal.SIGTERM, lambda *_: print(f"own handler ran on rank {rank}", flush=True))
    result = train(root, cls, resume="--resume" in sys.argv, on_step=on_step, skip="--no-skip" not in sys.argv,
                   clip="--clip" in sys.argv, **kw)
    stopped = int(result.pop("preempted", 0))
    if stopped:
        print(f"rank {rank} preempted at {stopped}", flush=True)
        return
    if result.pop("main"):
        torch.save(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run
