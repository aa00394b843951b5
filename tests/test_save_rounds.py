"""What a save's rounds cost the ranks, and that the cheaper rounds still fail together (issue 70).

A round that only has to learn whether any rank failed (``_dist.run_collectively``) is one all-reduce of a flag
when every rank succeeded: an ``all_gather_object`` pickles on every rank and makes two collectives, ~8x the CPU of
an all-reduce on gloo, and a save on several ranks makes several such rounds (~0.05 CPU-s per save summed over 4
ranks, as much as uploading tens of MB). The reports are gathered only when some rank failed. Counted on real gloo
ranks by counting the calls that reach ``torch.distributed`` (every one still runs for real).
"""

from __future__ import annotations

import pytest
import torch
from distributed import counting_collectives, run_ranks

pytestmark = pytest.mark.slow

GATHERS = 3
"""The object gathers of a 2-rank save of a model (sharded safetensors) and its AdamW state (DCP): the settling
round's shapes, what each rank holds of the model (safetensors' file plan) and the files' checksums; every other round
(the start, each format's write, the commit) is a flag's all-reduce (8 gathers before, issue 70). ckptio's own
object gathers are an ``all_gather`` of a framed pickle (``_dist.all_gather_object``); DCP's are torch's."""


def _count_save(root: str) -> tuple[dict[str, int], bool]:
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, rng=False) as mgr:
        mgr.save(step=1)
        with counting_collectives() as counts:
            mgr.save(step=2)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=make_model(seed=1)) as again:
        info = again.restore()
    return dict(counts), info is not None and info.step == 2


def test_a_two_rank_save_gathers_objects_only_where_it_shares_something(tmp_path):
    results = run_ranks(2, _count_save, root=str(tmp_path / "ckpt"))
    for rank, (counts, restored) in enumerate(results):
        assert restored, f"rank {rank}: the save was not restored"
        assert counts.get("all_gather_object", 0) + counts.get("all_gather", 0) <= GATHERS, f"rank {rank}: {counts}"
    assert results[0][0] == results[1][0]  # the same collectives on both ranks, or they would not have matched


def _round(fail_on: int) -> tuple[dict[str, int], str]:
    from ckptio import _dist
    from ckptio.errors import CheckpointError

    def work() -> int:
        if _dist.rank() == fail_on:
            raise ValueError("disk full here")
        return 7

    with counting_collectives() as counts:
        try:
            got = _dist.run_collectively("writing the shard", work)
            outcome = f"ok {got}"
        except CheckpointError as exc:
            outcome = f"CheckpointError {exc}"
        except ValueError as exc:
            outcome = f"ValueError {exc}"
    return dict(counts), outcome


def test_a_round_where_every_rank_succeeded_is_one_all_reduce():
    for counts, outcome in run_ranks(2, _round, fail_on=-1):
        assert outcome == "ok 7"
        assert counts == {"all_reduce": 1}, counts


def test_a_round_where_one_rank_failed_raises_on_every_rank_naming_it():
    (counts0, outcome0), (counts1, outcome1) = run_ranks(2, _round, fail_on=1)
    assert outcome1 == "ValueError disk full here"  # the failing rank: its own error
    assert outcome0 == "CheckpointError writing the shard failed on rank(s) [1]: rank 1: ValueError: disk full here"
    assert counts0 == counts1


def _objects() -> dict:
    from ckptio import _dist

    me = _dist.rank()
    big = "x" * (3 * _dist.OBJECT_ROUND) + str(me)
    out = {}
    for name, fn in (("small gather", lambda: _dist.all_gather_object({"rank": me})),
                     ("large gather", lambda: _dist.all_gather_object(big if me == 1 else me)),
                     ("small broadcast", lambda: _dist.broadcast_object(("step_3", me))),
                     ("large broadcast", lambda: _dist.broadcast_object(big))):
        with counting_collectives() as counts:
            out[name] = (fn(), dict(counts))
    return out


def test_an_object_that_fits_a_round_travels_in_one_collective_a_larger_one_in_two():
    """ckptio's object collectives send a small object (what its rounds send: a flag, a name, shapes, checksums) in
    one collective, where torch's ``all_gather_object``/``broadcast_object_list`` make two (the sizes, then the
    bytes; ~0.5 ms of a rank's CPU each on gloo, a dozen times in a save or a restore on several ranks)."""
    from ckptio import _dist

    big = "x" * (3 * _dist.OBJECT_ROUND)
    for me, got in enumerate(run_ranks(2, _objects)):
        assert got["small gather"] == ([{"rank": 0}, {"rank": 1}], {"all_gather": 1}), me
        assert got["large gather"] == ([0, big + "1"], {"all_gather": 2}), me
        assert got["small broadcast"] == (("step_3", 0), {"broadcast": 1}), me
        assert got["large broadcast"] == (big + "0", {"broadcast": 2}), me
