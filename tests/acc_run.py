"""Run the tiny accelerate loop (``acc_tiny.train``) in a process of its own or under torchrun (DDP on CPU ranks).

    python tests/acc_run.py DIR OUT [--plain] [--resume] [--sigterm-at STEP] [--kill-at POINT:N]
    python -m torch.distributed.run --nproc-per-node=2 tests/acc_run.py DIR OUT [...]

``--plain``: the plain ``Accelerator``; otherwise ``CkptioAccelerator``. ``--resume``: ``load_state()`` first.
``--sigterm-at STEP``: every rank receives SIGTERM after step STEP (a preemption: accelerate has no handler, the
process ends). ``--kill-at POINT:N``: global rank 0 SIGKILLs itself the N-th time a ckptio save reaches the named
point (``ckptio._faults``). The main process writes the final state to OUT.
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


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    if "--plain" in sys.argv:
        cls = Accelerator
    else:
        from ckptio.accelerate import CkptioAccelerator as cls
    if _arg("--kill-at") and int(os.environ.get("RANK", "0")) == 0:
        kill_at(_arg("--kill-at"))
    at = int(_arg("--sigterm-at") or 0)

    def on_step(done: int) -> None:
        if done == at:
            os.kill(os.getpid(), signal.SIGTERM)

    result = train(root, cls, resume="--resume" in sys.argv, on_step=on_step)
    if result.pop("main"):
        torch.save(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run
