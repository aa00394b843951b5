"""One rank of a job with the memory tier, started by ``torchrun`` (see ``test_memory_tier.py``).

    torchrun ... tests/memory_node_worker.py --ckpt DIR --steps 12 --memory-every 2 --persist-every 6 --out OUT
        [--dump]              # rank 0 writes OUT/state_N.pt (the whole state) after every save of step N
        [--die-at 9]          # this node's ranks SIGKILL themselves after step 9 (its snapshot work done)
        [--die-at-point memory.replicating:5]   # ... the 5th time a memory snapshot reaches that point
        [--once-marker FILE]  # die only if FILE does not exist yet (then create it): a torchrun restart lives
        [--replicas K]        # memory_replicas (default: the config's)
        [--natural-exit]      # end as a user's script does: close, destroy the group, return (no os._exit)
        [--no-ckptio]         # the same training without a checkpoint manager (with --natural-exit: the baseline
                              # of tools/exit_aborts.py)

Trains the tiny Llama (FSDP2 over all ranks, ``toy.Run``) with ``maybe_save()`` after every step: a memory
snapshot every ``--memory-every`` steps into this node's ``CKPTIO_MEMORY_DIR``, a durable save into ``--ckpt``
every ``--persist-every``. Resumes from whatever the manager finds first. Rank 0 writes OUT/restored.pt (step,
tier and the whole state right after the restore) and OUT/final.pt (the whole state at the end).
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
    p.add_argument("--memory-every", type=int, required=True)
    p.add_argument("--persist-every", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dump", action="store_true")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-at-point", default=None)
    p.add_argument("--once-marker", default=None)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--natural-exit", action="store_true")
    p.add_argument("--no-ckptio", action="store_true")
    args = p.parse_args()

    import logging

    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun restarts the workers against the same store: each attempt takes keys of its own (with the default
        # keys, gloo's second attempt connects to the first one's dead addresses and times out; torch 2.13)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=60))
    from toy import Run, finish, full_state

    from distributed import kill_at

    rank = dist.get_rank() if dist.is_initialized() else 0
    dying = args.once_marker is None or not Path(args.once_marker).exists()
    if dying and args.once_marker is not None and rank == 0:
        Path(args.once_marker).touch()
    if args.die_at_point and dying:
        kill_at(args.die_at_point)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.no_ckptio:
        return _without_ckptio(args.steps)
    replicas = {} if args.replicas is None else {"memory_replicas": args.replicas}
    run = Run(args.ckpt, max_steps=args.steps, memory_every_steps=args.memory_every,
              persist_every_steps=args.persist_every, **replicas)
    info = run.mgr.restore()
    state = full_state(run.model, run.opt)
    if rank == 0:
        torch.save({"step": -1 if info is None else info.step, "tier": None if info is None else info.tier,
                    "state": state}, out / "restored.pt")

    def after_step() -> None:
        saved = run.mgr.maybe_save()
        if saved is not None and args.dump:
            state = full_state(run.model, run.opt)
            if rank == 0:
                torch.save(state, out / f"state_{run.steps.step}.pt")
        if args.die_at is not None and run.steps.step == args.die_at and dying:
            run.mgr.wait()  # the snapshots before this step are committed
            os.kill(os.getpid(), signal.SIGKILL)  # a node lost: no cleanup, nothing flushed

    run.train(after_step=after_step)
    if args.natural_exit:
        _HELD.append(run)  # as a script's top-level objects: the manager is alive until the interpreter exits
        run.mgr.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0
    finish(run, out)
    return 0


_HELD: list = []


def _without_ckptio(steps: int) -> int:
    """The job's training, model and data without ckptio; ends as a user's script does."""
    import torch
    import torch.distributed as dist
    from toy import TokenDataset, make_model

    torch.manual_seed(300)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=4, shuffle=True)
    done = 0
    while done < steps:
        for batch in loader:
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done >= steps:
                break
    _HELD.append((model, opt))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
