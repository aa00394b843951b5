"""How many times the ranks of a restore wait for each other, and that the merged rounds still agree.

Each collective is a point where every rank waits for the slowest and, at thousands of ranks, a round of
messages; a restore used to make 26 of them on 2 ranks. The count is taken on real gloo ranks by counting the
calls that reach ``torch.distributed`` (every one still runs for real); the rounds it may take are written in
``ROUNDS``. The other tests here check what the merging must not lose: damage that one rank finds makes every
rank fall back together, and a decision rank 0 makes (a folder with no usable checkpoint) reaches every rank
as the same error.
"""

from __future__ import annotations

import pytest
import torch
from distributed import counting_collectives, run_ranks

pytestmark = pytest.mark.slow

ROUNDS = 8
"""A 2-rank restore of model, optimizer, scheduler, RNG and a user object with ``verify: full``: one broadcast
(the checkpoint to restore), one round to open it (manifest, small states, the live model's shapes, the
optimizer's plan), one per format load (the optimizer's DCP folder into new tensors, the model), two to check what
was read before the model is written into (the verifier's ranges, then each file finished by one rank: a failed
restore changes nothing), and two for the model's files, the second of which also applies the optimizer's and
small states once every rank's files matched (issue 67; 6 before, when a damaged file was found after applying)."""

def _objects(seed: int):
    from toy import Counter, make_model

    model = make_model(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return model, opt, sched, Counter()


def _count_restore(root: str, fmt: str) -> tuple[dict[str, int], bool]:
    from toy import full_state

    from ckptio import CheckpointConfig, CheckpointManager

    cfg = CheckpointConfig(checkpoint_dir=root, model_save_format=fmt, verify="full")
    model, opt, sched, counter = _objects(0)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    counter.seen = 5
    with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, extra_states={"c": counter}) as mgr:
        mgr.save(step=1)
    want = full_state(model, opt)

    model2, opt2, sched2, counter2 = _objects(1)
    mgr = CheckpointManager(cfg, model=model2, optimizer=opt2, lr_scheduler=sched2, extra_states={"c": counter2})
    with counting_collectives() as counts:
        info = mgr.restore()
    mgr.close()
    got = full_state(model2, opt2)
    exact = (info is not None and info.step == 1 and counter2.seen == 5 and sched2.state_dict() == sched.state_dict()
             and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want))
    return dict(counts), exact


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_a_two_rank_restore_waits_for_the_other_rank_a_few_times_only(tmp_path, fmt):
    results = run_ranks(2, _count_restore, root=str(tmp_path / "ckpt"), fmt=fmt)
    for rank, (counts, exact) in enumerate(results):
        assert exact, f"rank {rank} did not restore the saved state"
        assert sum(counts.values()) <= ROUNDS, f"rank {rank}: {sum(counts.values())} collectives {counts}"
    assert results[0][0] == results[1][0]  # the same collectives on both ranks, or they would not have matched


def _damaged_on_one_rank(root: str) -> tuple[int, int]:
    """Rank 1's model shard of the newest step is flipped on disk (only rank 1 reads it): both fall back."""
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager

    cfg = CheckpointConfig(checkpoint_dir=root, verify="full")
    model = make_model(seed=0)
    with CheckpointManager(cfg, model=model) as mgr:
        mgr.save(step=1)
        mgr.save(step=2)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        from pathlib import Path

        shard = sorted((Path(root) / "epoch_0_step_2" / "model").glob("shard-00002-*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0x40
        shard.write_bytes(bytes(data))
    dist.barrier()
    info = CheckpointManager(cfg, model=make_model(seed=3)).restore()
    return info.step, dist.get_rank()


def test_damage_one_rank_finds_makes_every_rank_fall_back_together(tmp_path):
    assert sorted(run_ranks(2, _damaged_on_one_rank, root=str(tmp_path / "ckpt"))) == [(1, 0), (1, 1)]


def _nothing_usable(root: str) -> list[str]:
    """Every step directory damaged: every rank raises NoUsableCheckpointError, or starts fresh when asked."""
    from pathlib import Path

    import torch.distributed as dist
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager, NoUsableCheckpointError

    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=make_model(seed=0)) as mgr:
        mgr.save(step=2)
    if dist.get_rank() == 0:
        manifest = Path(root) / "epoch_0_step_2" / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3', 1))
    dist.barrier()
    seen = []
    try:
        CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=make_model(seed=1)).restore()
        seen.append("restored")
    except NoUsableCheckpointError:
        seen.append("NoUsableCheckpointError")
    fresh = CheckpointManager(CheckpointConfig(checkpoint_dir=root, start_fresh_if_damaged=True),
                              model=make_model(seed=1)).restore()
    seen.append("fresh" if fresh is None else "restored")
    return seen


def test_a_folder_with_nothing_usable_is_the_same_error_on_every_rank(tmp_path):
    assert run_ranks(2, _nothing_usable, root=str(tmp_path / "ckpt")) == [["NoUsableCheckpointError", "fresh"]] * 2
