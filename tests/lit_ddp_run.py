"""Run under torchrun: the tiny Lightning module trained with DDP on CPU ranks, checkpointed through ckptio.

    python -m torch.distributed.run --nproc-per-node=2 tests/lit_ddp_run.py DIR EPOCHS OUT [--resume] [--plain]

``--resume``: ``fit(ckpt_path="last")``; ``--plain``: Lightning's own checkpoint files (no plugin). Global rank 0
writes the final weights and optimizer moments to OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402

from lit_tiny import Tiny, loader, state  # noqa: E402


def main() -> None:
    root, epochs, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    plugins = [] if "--plain" in sys.argv else [__import__("ckptio.lightning").lightning.CkptioCheckpointIO()]
    torch.manual_seed(0)
    module = Tiny()
    tr = pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=2, strategy="ddp", plugins=plugins, deterministic=True,
                    callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(root), every_n_epochs=1, save_top_k=-1,
                                                            save_last=True)])
    tr.fit(module, loader(), ckpt_path="last" if "--resume" in sys.argv else None)
    if tr.global_rank == 0:
        torch.save(state(module, tr), out)
    tr.strategy.barrier()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run
