"""Save on N ranks, load on M (FSDP2 over gloo; one rank runs without FSDP): bitwise-equal state."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

FORMATS = ("safetensors", "torch_save")


def _save(root: str, steps: int) -> dict:
    from toy import Run, full_state

    out = {}
    for fmt in FORMATS:
        run = Run(f"{root}/{fmt}", fmt, max_steps=steps)
        run.train(save_at=(steps,))
        out[fmt] = full_state(run.model, run.opt)
        out[fmt]["counter"] = torch.tensor(run.counter.seen)
    return out


def _load(root: str) -> dict:
    from toy import Run, full_state

    out = {}
    for fmt in FORMATS:
        run = Run(f"{root}/{fmt}", fmt, max_steps=100, seed=1)  # different init: everything must come from disk
        info = run.mgr.restore()
        assert info is not None
        out[fmt] = full_state(run.model, run.opt)
        out[fmt]["counter"] = torch.tensor(run.counter.seen)
        out[fmt]["step"] = torch.tensor(run.steps.step)
    return out


def _assert_same(saved: dict, loaded: dict, fmt: str, where: str) -> None:
    a, b = saved[fmt], loaded[fmt]
    keys = [k for k in a if k != "counter"]
    assert len([k for k in keys if k.startswith("optim/")]) > 20, "optimizer state should be compared too"
    for k in keys:
        assert k in b, f"{where} {fmt}: {k} not restored"
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where} {fmt}: {k} differs after load"
    assert int(b["counter"]) == int(a["counter"]) > 0


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved2"))
    return root, run_ranks(2, _save, root=root, steps=3)[0]


@pytest.mark.parametrize("load_world", [1, 2, 3, 4])
def test_save_on_2_load_on_m(saved_on_two, load_world):
    root, saved = saved_on_two
    loaded = run_ranks(load_world, _load, root=root)[0]
    for fmt in FORMATS:
        _assert_same(saved, loaded, fmt, f"2 -> {load_world} ranks")
        assert int(loaded[fmt]["step"]) == 3


def test_save_on_1_load_on_2(tmp_path):
    saved = run_ranks(1, _save, root=str(tmp_path), steps=2)[0]
    loaded = run_ranks(2, _load, root=str(tmp_path))[0]
    for fmt in FORMATS:
        _assert_same(saved, loaded, fmt, "1 -> 2 ranks")


def test_sharded_files_are_plain_safetensors(saved_on_two):
    """Each rank's file opens with safetensors alone, and the shards tile every tensor exactly."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root, saved = saved_on_two
    step_dir = Path(root) / "safetensors" / "epoch_0_step_3"
    files = sorted((step_dir / "model").glob("*.safetensors"))
    assert [f.name for f in files] == [  # two ranks spawned without LOCAL_WORLD_SIZE: io_threads resolves to 2 files
        "shard-00001-model-00001-of-00002.safetensors",
        "shard-00001-model-00002-of-00002.safetensors",
        "shard-00002-model-00001-of-00002.safetensors",
        "shard-00002-model-00002-of-00002.safetensors",
    ]
    rebuilt: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            shards = json.loads(fh.metadata()["ckptio_shards"])
            for key in fh.keys():
                t = fh.get_tensor(key)
                meta = shards[key]
                full = rebuilt.setdefault(key, torch.full(meta["shape"], float("nan"), dtype=t.dtype))
                index = tuple(slice(o, o + n) for o, n in zip(meta["offsets"], t.shape))
                full[index] = t
    model_keys = {k[len("model/"):] for k in saved["safetensors"] if k.startswith("model/")}
    # the tied lm_head shares storage with the embedding, so it is stored once
    assert set(rebuilt) == model_keys - {"lm_head.weight"}
    for key, tensor in rebuilt.items():
        assert torch.equal(tensor, saved["safetensors"][f"model/{key}"]), key


def test_the_chunk_index_rank_0_writes_for_both_ranks_says_what_their_headers_say(saved_on_two, tmp_path):
    """Rank 0 plans every rank's files from the ownership round and writes one index: a restore on any number of
    ranks (the loads above) plans from it, and it must agree with the four headers chunk by chunk."""
    import shutil
    from pathlib import Path

    from ckptio.formats.safetensors import chunk_index
    from ckptio.formats.safetensors.sharded import _scan

    root, _ = saved_on_two
    model = Path(root) / "safetensors" / "epoch_0_step_3" / "model"
    assert (model / chunk_index.INDEX_NAME).is_file()
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    (plain / chunk_index.INDEX_NAME).unlink()
    indexed, infos = _scan(model)
    headers, header_infos = _scan(plain)
    assert infos == header_infos and set(indexed) == set(headers)
    files = set()
    for key, table in indexed.items():
        assert isinstance(table, chunk_index.ChunkTable)
        pieces = sorted((p.file, p.offsets, p.shape) for p in table)
        assert pieces == sorted((p.file, p.offsets, p.shape) for p in headers[key]), key
        files.update(p[0] for p in pieces)
    assert len(files) == 4  # both ranks' files, two each


def _per_rank_states(root: str, save: bool) -> list[str]:
    """Save (or restore) a model and its per-rank RNG streams; the warnings ckptio logged on this rank."""
    import logging

    from ckptio import CheckpointConfig, CheckpointManager

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    handler.setLevel(logging.WARNING)
    logging.getLogger("ckptio").addHandler(handler)
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=torch.nn.Linear(2, 2))
    mgr.save(step=1) if save else mgr.restore()
    mgr.close()
    return seen


@pytest.mark.parametrize("saved_on,loaded_on,says", [
    (2, 1, "the states of rank 1 are not used"),
    (3, 1, "the states of ranks 1-2 are not used"),
    (2, 3, "rank 2 keeps its own"),
])
def test_a_restore_on_another_number_of_ranks_names_the_ranks(tmp_path, saved_on, loaded_on, says):
    run_ranks(saved_on, _per_rank_states, root=str(tmp_path), save=True)
    seen = run_ranks(loaded_on, _per_rank_states, root=str(tmp_path), save=False)[0]
    text = " ".join(seen)
    assert f"saved per rank on {saved_on} rank(s) and is restored on {loaded_on}" in text and says in text, seen
