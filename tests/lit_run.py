"""Run the tiny Lightning module in a process of its own (1 device) or under torchrun (DDP on CPU ranks).

    python tests/lit_run.py DIR EPOCHS OUT [--resume] [--plain] [--async] [--sigterm-at STEP] [--kill-at POINT:N]
    python -m torch.distributed.run --nproc-per-node=2 tests/lit_run.py DIR EPOCHS OUT --ddp [...]

``--resume``: ``fit(ckpt_path="last")``; ``--plain``: Lightning's own checkpoint files (no plugin); ``--async``:
background saves. ``--sigterm-at STEP``: every rank sends itself SIGTERM after global step STEP, as torchrun
forwards a preemption notice (Lightning stops at the next batch). ``--kill-at POINT:N``: global rank 0 SIGKILLs
itself the N-th time a ckptio save reaches the named point (``ckptio._faults``), e.g. ``commit.before_rename:2``
with the files written and not yet in place. Global rank 0 writes the final weights and optimizer moments to OUT.
``--on-preemption MODE[:SIGNAL]``: ``CkptioPreemption(MODE, [SIGNAL])`` (SIGTERM by default); ``--signal-in STEP``:
every rank sends itself that signal as global step STEP begins (mid-step; ``STEP:R``: global rank R alone);
``--own-handler``: a handler of the
script's own on that signal, installed first, prints ``own handler ran on rank R``; a rank whose ``fit`` returned
after a preemption prints ``rank R preempted at S`` and writes no OUT. ``--from NAME``: ``fit(ckpt_path=DIR/NAME)``;
``--other-data``: the same samples in the reverse order.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from distributed import kill_at  # noqa: E402
from lit_tiny import Tiny, loader, state  # noqa: E402

from ckptio.lightning import last_checkpoint  # noqa: E402


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


class Preempt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SignalIn(pl.Callback):
    def __init__(self, at: str, signum: int) -> None:
        step, _, rank = at.partition(":")
        self.step, self.rank, self.signum = int(step), int(rank) if rank else None, signum

    def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == self.step - 1 and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


def _group_at_exit() -> None:
    """Registered first, so run last of the atexit hooks (ckptio's included): a process group still up then is left
    for the interpreter's teardown, where gloo's live threads may abort the process (SIGABRT)."""
    import torch.distributed as dist

    print(f"process group at exit: {'up' if dist.is_available() and dist.is_initialized() else 'gone'}", flush=True)


def main() -> None:
    import atexit

    atexit.register(_group_at_exit)  # reached only when the run ends by an exception (ckptio's SystemExit on "exit")
    root, epochs, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])  # root: a folder or s3://bucket/prefix
    ddp = "--ddp" in sys.argv
    plugins = []
    if "--plain" not in sys.argv:
        from ckptio.lightning import CkptioCheckpointIO

        plugins = [CkptioCheckpointIO(async_save="--async" in sys.argv)]
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, save_last=True)]
    if _arg("--sigterm-at"):
        callbacks.append(Preempt(int(_arg("--sigterm-at"))))
    mode, _, name = (_arg("--on-preemption") or "").partition(":")
    signum = signal.Signals[name or "SIGTERM"]
    preemption = None
    if mode:
        from ckptio.lightning import CkptioPreemption

        preemption = CkptioPreemption(mode, [signum.name])
        callbacks.append(preemption)
    if _arg("--signal-in"):
        callbacks.append(SignalIn(_arg("--signal-in"), signum))
    if "--own-handler" in sys.argv:
        rank = os.environ.get("RANK", "0")
        signal.signal(signum, lambda *_: print(f"own handler ran on rank {rank}", flush=True))
    if _arg("--kill-at") and int(os.environ.get("RANK", "0")) == 0:
        kill_at(_arg("--kill-at"))
    torch.manual_seed(0)
    module = Tiny()
    tr = pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=2 if ddp else 1, strategy="ddp" if ddp else "auto", plugins=plugins,
                    deterministic=True, callbacks=callbacks)
    ckpt_path = None
    if "--resume" in sys.argv:  # Lightning's "last" finds nothing in a bucket: ckptio's helper does
        ckpt_path = last_checkpoint(root) if root.startswith("s3://") else "last"
    if _arg("--from"):
        ckpt_path = os.path.join(root, _arg("--from"))
    data = loader()
    if "--other-data" in sys.argv:  # the same samples in the reverse order
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*(t.flip(0) for t in data.dataset.tensors)),
                                           batch_size=data.batch_size, shuffle=False)
    tr.fit(module, data, ckpt_path=ckpt_path)
    if preemption is not None and preemption.preempted:
        print(f"rank {tr.global_rank} preempted at {tr.global_step}", flush=True)
        return
    if tr.global_rank == 0:
        torch.save(state(module, tr), out)
    if ddp:
        tr.strategy.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run
