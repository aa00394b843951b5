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
from distributed import counting_collectives, real_collectives, run_ranks

pytestmark = pytest.mark.slow

GATHERS = 3
"""The object gathers of a 2-rank save of a model (sharded safetensors) and its AdamW state (DCP): the settling
round's shapes, what each rank holds of the model (safetensors' file plan) and the files' checksums; every other round
(the start, each format's write, the commit) is a flag's all-reduce (8 gathers before, issue 70). ckptio's own
object gathers are an ``all_gather`` of a framed pickle (``_dist.all_gather_object``); the DCP folder's gathers go to
rank 0 alone (a ``gather``: :func:`ckptio._dist.decide_on_gathered`), counted with every other collective in
:data:`ROUNDS`."""


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


ROUNDS = 10
"""The collectives a 2-rank save makes of a model (sharded safetensors, with its config), its AdamW state (DCP), an
LR scheduler and the RNG (small states), on the wire (torch's object collectives count two: the sizes, then the
bytes): the settling round (shapes, errors, the small states' digests), the start, the safetensors file plan and the
shards' round, the DCP folder's two rounds (the plans gathered and the final plans broadcast; the write results
gathered and rank 0's finish broadcast: :mod:`ckptio.formats.dcp.rounds`), the checksums (which also carry a failure
of rank 0's config files or of a small state's write), the commit. 15 before the DCP rounds (DCP's own four object
collectives and ckptio's round after them: 9 of them), 17 counted as calls before issue 70's folding (an all-reduce
and a broadcast to start, a round for the config files, two rounds per small state, an all-reduce to commit)."""


def _count_rounds(root: str) -> tuple[int, dict[str, int], bool]:
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    ids = torch.arange(32).reshape(2, 16) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt,
                           lr_scheduler=sched) as mgr:
        mgr.save(step=1)
        with counting_collectives() as counts:
            mgr.save(step=2)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=make_model(seed=1)) as again:
        info = again.restore()
    return real_collectives(counts), dict(counts), info is not None and info.step == 2


def test_a_two_rank_save_folds_its_rounds(tmp_path):
    """Each round costs every rank ~0.5-1 ms of CPU on gloo (more the more ranks): a save makes only the rounds
    its order needs (see :data:`ROUNDS`), and its failures still fail it on every rank (the tests below and
    tests/test_objstore_faults.py)."""
    results = run_ranks(2, _count_rounds, root=str(tmp_path / "ckpt"))
    for rank, (total, counts, restored) in enumerate(results):
        assert restored, f"rank {rank}: the save was not restored"
        assert total <= ROUNDS, f"rank {rank}: {total} collectives: {counts}"
    assert results[0][1] == results[1][1]


class _FailingTokenizer:
    """A tokenizer whose files cannot be written (a full disk)."""

    def save_pretrained(self, out_dir):  # noqa: ANN001
        raise OSError(f"no space left writing the tokenizer into {out_dir}")


class _FailingState:
    """A registered state whose bytes are fine on every rank but whose file cannot be written on rank 1 (its
    ``state_dict`` names a path the writer refuses there)."""

    def state_dict(self):  # noqa: ANN201
        return {"x": 1}

    def load_state_dict(self, state):  # noqa: ANN001, ANN201
        pass


def _failing_save(root: str, what: str) -> dict:
    import os

    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager, _dist
    from ckptio.errors import CheckpointError

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokenizer = _FailingTokenizer() if what == "tokenizer" and _dist.rank() == 0 else None
    extra = {"state": _FailingState()}
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model, optimizer=opt, tokenizer=tokenizer,
                           extra_states=extra, rng=what == "rng") as mgr:
        if what == "rng" and _dist.rank() == 1:  # rank 1's per-rank file cannot be written
            real = mgr.storage.attach_step

            def attach(token, name):  # noqa: ANN001, ANN202
                writer = real(token, name)
                write_bytes = writer.write_bytes

                def refuse(rel, data):  # noqa: ANN001, ANN202
                    if rel.startswith("rng/"):
                        raise OSError(f"no space left writing {rel}")
                    return write_bytes(rel, data)

                writer.write_bytes = refuse
                return writer

            mgr.storage.attach_step = attach
        try:
            mgr.save(step=1)
            error = None
        except (CheckpointError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "left": sorted(os.listdir(root)) if os.path.isdir(root) else []}


@pytest.mark.parametrize("what", ["tokenizer", "rng"])
def test_a_write_whose_failure_waits_for_the_checksums_round_still_fails_the_save_on_every_rank(tmp_path, what):
    """Rank 0's config files and the small states are written without a round of their own: a failure there (rank 0's
    tokenizer, rank 1's RNG file) is raised on every rank at the round of the checksums, and nothing is committed."""
    results = run_ranks(2, _failing_save, root=str(tmp_path / "ckpt"), what=what)
    failing = 0 if what == "tokenizer" else 1
    for rank, got in enumerate(results):
        assert got["error"] is not None, f"rank {rank} saved"
        assert "no space left" in got["error"], got["error"]
        if rank != failing:
            assert f"failed on rank(s) [{failing}]" in got["error"], got["error"]
    assert not [n for n in results[0]["left"] if n.startswith("epoch_")], results[0]["left"]


def _rounds_alone() -> tuple[dict[str, int], list]:
    import tempfile

    import torch.distributed as dist

    from ckptio import _dist

    def fail() -> None:
        raise ValueError("disk full here")

    with tempfile.TemporaryDirectory() as tmp:  # what torchrun gives a job of one process
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            return _rounds_of_one(_dist, fail)
        finally:
            dist.destroy_process_group()


def _rounds_of_one(_dist, fail) -> tuple[dict[str, int], list]:
    with counting_collectives() as counts:
        got = [_dist.run_collectively("writing", lambda: 7), _dist.all_gather_object({"a": 1}),
               _dist.broadcast_object("name"), _dist.decide_on_rank0("beginning", lambda: 3),
               _dist.agree("sharing", lambda: 2, share=lambda v: v + 1)]
        try:
            _dist.run_collectively("writing the shard", fail)
        except ValueError as exc:
            got.append(str(exc))
    return dict(counts), got


def test_a_job_of_one_rank_in_a_process_group_makes_no_round_of_ckptios_own():
    """``torchrun`` with one process starts a process group of one rank: ckptio's rounds there (a flag's all-reduce,
    an object's gather or broadcast: ~2.4 ms of CPU in a 1-rank save) would only hand the rank its own values. They
    are skipped, with the same results and the same errors."""
    (counts, got), = run_ranks(1, _rounds_alone)
    assert counts == {}, counts
    assert got == [7, [{"a": 1}], "name", 3, (2, [3]), "disk full here"], got


def _gathered_alone() -> tuple[dict[str, int], list]:
    import tempfile

    import torch.distributed as dist

    from ckptio import _dist

    with tempfile.TemporaryDirectory() as tmp:  # what torchrun gives a job of one process
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            with counting_collectives() as counts:
                got = _dist.decide_on_gathered({"plan": [1, 2]}, lambda parts: parts, key="alone")
            return dict(counts), got
        finally:
            dist.destroy_process_group()


def test_a_dcp_round_in_a_group_of_one_rank_makes_no_collective():
    """DCP's rounds (:func:`ckptio._dist.decide_on_gathered`) in a group of one rank: rank 0 decides on its own
    object (a copy, as on several ranks) without a gather or a broadcast."""
    (counts, got), = run_ranks(1, _gathered_alone)
    assert counts == {}, counts
    assert got == [{"plan": [1, 2]}]
