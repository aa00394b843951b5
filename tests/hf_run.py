"""Run the tiny Trainer in a process of its own (1 rank) or under torchrun (DDP on CPU ranks).

    python tests/hf_run.py DIR MAX_STEPS OUT [--plain | --async] [--resume] [--sigterm-at STEP] [--kill-at POINT:N]
                           [--sigkill-after-save STEP] [--fail-at POINT:RANK]
    python -m torch.distributed.run --nproc-per-node=2 tests/hf_run.py DIR MAX_STEPS OUT [...]

``--plain``: the plain ``Trainer`` (its own checkpoints); otherwise ``CkptioTrainer`` (``--async``: with
``async_save=True``). ``--sigkill-after-save STEP``: every rank SIGKILLs itself as soon as the save of global step
STEP returns (with ``--async``, its write is still in flight). ``--fail-at POINT:RANK``: global rank RANK raises an
``OSError`` the first time a ckptio save reaches the named point (a disk failing under the background write). ``--resume``:
``train(resume_from_checkpoint=True)``. ``--on-preemption exit|return``: ``CkptioTrainer(on_preemption=...)``;
``--sigterm-in STEP[:RANK]``: SIGTERM as step STEP begins, to every rank or to global rank RANK alone; ``--own-handler``:
a SIGTERM handler of the script's own, installed before the Trainer, prints ``own handler ran on rank R``; with
``"return"`` the rank prints ``preempted at S`` after ``train``. ``--sigterm-at STEP``: every rank receives SIGTERM after global step STEP
(a preemption: the Trainer has no handler, the process ends). ``--kill-at POINT:N``: global rank 0 SIGKILLs itself
the N-th time a ckptio save reaches the named point (``ckptio._faults``). ``--ignore-data-skip``: the Trainer's
``ignore_data_skip`` (a resumed run starts its epoch's data over). ``--bucket URL``: ``ckptio_checkpoint_dir=URL`` (the
checkpoints in object storage; the store's settings come from the environment). Global rank 0 writes the final weights
and optimizer moments to OUT.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from acc_run import fail_at  # noqa: E402
from distributed import kill_at  # noqa: E402
from hf_tiny import state, trainer  # noqa: E402


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


class KillAfterSave(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kw) -> None:  # noqa: ANN001
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Preempt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kw) -> None:  # noqa: ANN001
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class PreemptIn(TrainerCallback):
    """SIGTERM to this process as step ``step`` begins (mid-step: it is seen at that step's end)."""

    def __init__(self, at: str) -> None:
        step, _, rank = at.partition(":")
        self.step, self.rank = int(step), int(rank) if rank else None

    def on_step_begin(self, args, state, control, **kw) -> None:  # noqa: ANN001
        if state.global_step == self.step - 1 and self.rank in (None, int(os.environ.get("RANK", "0"))):
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    root, steps, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    if "--plain" in sys.argv:
        cls = Trainer
    else:
        from ckptio.hf_trainer import CkptioTrainer as cls

        if "--async" in sys.argv:
            cls = functools.partial(cls, async_save=True)
    if _arg("--bucket"):
        cls = functools.partial(cls, ckptio_checkpoint_dir=_arg("--bucket"))
    if _arg("--on-preemption"):
        cls = functools.partial(cls, on_preemption=_arg("--on-preemption"))
    if "--own-handler" in sys.argv:
        rank = os.environ.get("RANK", "0")
        signal.signal(signal.SIGTERM, lambda *_: print(f"own handler ran on rank {rank}", flush=True))
    if _arg("--kill-at") and int(os.environ.get("RANK", "0")) == 0:
        kill_at(_arg("--kill-at"))
    if _arg("--fail-at"):
        fail_at(_arg("--fail-at"))
    tr = trainer(cls, root, steps, **({"ignore_data_skip": True} if "--ignore-data-skip" in sys.argv else {}))
    if _arg("--sigterm-at"):
        tr.add_callback(Preempt(int(_arg("--sigterm-at"))))
    if _arg("--sigterm-in"):
        tr.add_callback(PreemptIn(_arg("--sigterm-in")))
    if _arg("--sigkill-after-save"):
        tr.add_callback(KillAfterSave(int(_arg("--sigkill-after-save"))))
    tr.train(resume_from_checkpoint=True if "--resume" in sys.argv else None)
    if getattr(tr, "ckptio_preemption", None) is not None and tr.ckptio_preemption.preempted:
        print(f"rank {os.environ.get('RANK', '0')} preempted at {tr.state.global_step}", flush=True)
        return
    if tr.is_world_process_zero():
        torch.save(state(tr), out)
    tr.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run
