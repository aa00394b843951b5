"""One rank of a job that checkpoints to S3, started by ``torchrun`` (see ``test_s3_nodes.py``).

    torchrun ... tests/s3_node_worker.py --ckpt s3://bucket/run --steps 4 --save-every 2 --out DIR
        [--die-at-save 4]     # this node's ranks are SIGKILLed while saving that step (after their files)

Trains the tiny Llama (FSDP2 over all ranks) with the shared test setup (``toy.Run``), resuming from the
newest complete checkpoint in ``--ckpt`` if there is one, and saves every ``--save-every`` steps. Rank 0
writes ``DIR/restored.pt`` (the whole state right after the restore, and its step), ``DIR/state_N.pt``
after each save of step N and ``DIR/final.pt`` (the whole state at the end). ``DIR`` and ``TMPDIR`` (where uploads are spooled) are the node's own.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--die-at-save", type=int, default=None)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    from toy import Run, finish, full_state

    from ckptio import _faults

    run = Run(args.ckpt, max_steps=args.steps, ckpt_every=args.save_every)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.die_at_save is not None:
        def die(point: str) -> None:
            if point == "save.states_written" and run.steps.step == args.die_at_save:
                os.kill(os.getpid(), signal.SIGKILL)  # as a node lost mid-save: no cleanup, nothing flushed

        _faults.set_hook(die)
    save = run.mgr.save

    def save_and_dump(*a, **kw):  # the whole state at every saved step, for the test to compare with
        out = save(*a, **kw)
        state = full_state(run.model, run.opt)
        if rank == 0:
            torch.save(state, Path(args.out) / f"state_{run.steps.step}.pt")
        return out

    run.mgr.save = save_and_dump  # type: ignore[method-assign]
    info = run.mgr.restore()
    state = full_state(run.model, run.opt)
    if rank == 0:
        torch.save({"step": -1 if info is None else info.step, "state": state}, Path(args.out) / "restored.pt")
    run.train()
    finish(run, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
