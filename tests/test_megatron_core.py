"""Megatron checkpoints against the real megatron-core package, both directions.

``megatron_fixture.py`` runs megatron-core on CPU/gloo (a few CUDA calls stubbed; see there) to build a
tiny Llama-style GPT — GQA, SwiGLU, RMSNorm, RoPE, untied embeddings — with the same weights at every
TP × PP, take one Adam step, and write it in both layouts (Megatron-Core ``torch_dist`` through its
own ``dist_checkpointing.save``; Megatron-LM legacy ``mp_rank`` files laid out as Megatron-LM writes
them) with its own forward's logits. Megatron-LM's training code (``save_checkpoint``) is not on the
package index, so the legacy files are written by the fixture from megatron-core's state dicts.

In: every layout and TP ∈ {1, 2} × PP ∈ {1, 2} converts to a Hugging Face model whose logits in
``transformers`` match Megatron's. Out: what ckptio exports is loaded by megatron-core's strict loader
into models of several layouts, whose forward gives the same logits; the legacy files ckptio writes
hold, rank by rank, the tensors Megatron wrote.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptio.convert.formats import convert
from fixture_cache import built
from megatron_shared import check_fixture_adam, restore_with_adam

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # multi-process megatron-core runs

FIXTURE = Path(__file__).with_name("megatron_fixture.py")
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _megatron(*args: str) -> None:
    run = subprocess.run([sys.executable, str(FIXTURE), *args], capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert run.returncode == 0, f"megatron-core run {args} failed:\n{run.stderr[-3000:]}"


@pytest.fixture(scope="module")
def made() -> dict[tuple[int, int], Path]:
    return {(tp, pp): built("megatron_fixture.py", "--tp", str(tp), "--pp", str(pp)) for tp, pp in LAYOUTS}


def _logits(hf: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("layout", ["torch_dist", "legacy"])
def test_megatron_checkpoints_convert_to_a_model_with_megatrons_logits(made, tmp_path, tp, pp, layout):
    ref = torch.load(made[(tp, pp)] / "reference.pt")
    hf = convert(made[(tp, pp)] / layout, tmp_path / "hf", "hf")
    got = _logits(hf, ref["input_ids"])
    assert got.shape == ref["logits"].shape
    assert torch.allclose(got, ref["logits"], atol=1e-5, rtol=0), (got - ref["logits"]).abs().max()


def test_every_layout_holds_the_same_model(made, tmp_path):
    from ckptio.formats.megatron.format import MegatronSource

    first = None
    for (tp, pp), folder in made.items():
        for layout in ("torch_dist", "legacy"):
            source = MegatronSource(folder / layout)
            assert source.info.get("iteration") == 2 and source.config["vocab_size"] == 128
            state = {k: source.read(k) for k in source.index()}
            if first is None:
                first = state
            assert state.keys() == first.keys()
            for k in state:
                assert torch.equal(state[k], first[k]), f"tp{tp}pp{pp} {layout}: {k}"


@pytest.mark.parametrize("to_tp,to_pp", [(2, 2), (1, 1)])
def test_megatron_core_loads_what_ckptio_exports(made, tmp_path, to_tp, to_pp):
    """HF (from Megatron's own checkpoint) -> ckptio's torch_dist export split for TP=2 PP=2 -> megatron-core's
    strict loader into a model of another or the same layout -> the same logits as the original."""
    ref = torch.load(made[(1, 1)] / "reference.pt")
    hf = convert(made[(1, 1)] / "torch_dist", tmp_path / "hf", "hf")
    out = convert(hf, tmp_path / "export", "megatron", options={"tp": 2, "pp": 2})
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"  # a Hugging Face folder has no step
    _megatron("--tp", str(to_tp), "--pp", str(to_pp), "--load", str(out / "iter_0000000"),
              "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    assert torch.equal(got["input_ids"], ref["input_ids"])
    assert torch.allclose(got["logits"], ref["logits"], atol=1e-5, rtol=0), (got["logits"] - ref["logits"]).abs().max()


def test_ckptio_legacy_files_hold_what_megatron_wrote_rank_by_rank(made, tmp_path):
    """Megatron's TP=2 PP=2 legacy files -> HF -> ckptio's legacy export for TP=2 PP=2: each rank file's
    model tensors are Megatron's, under the same names (stage-local layer numbers, fc1 as [gate_r; up_r])."""
    from ckptio.formats import safe_pickle as megatron_pickle
    from ckptio.storage.confined import Folder

    src = made[(2, 2)] / "legacy"
    hf = convert(src, tmp_path / "hf", "hf")
    out = convert(hf, tmp_path / "export", "megatron", options={"tp": 2, "pp": 2, "layout": "legacy"})
    theirs_root, ours_root = Folder(src / "iter_0000002"), Folder(out / "iter_0000000")
    ranks = sorted(e.name for e in theirs_root.listdir())
    assert ranks == sorted(e.name for e in ours_root.listdir()) == ["mp_rank_00_000", "mp_rank_00_001",
                                                                  "mp_rank_01_000", "mp_rank_01_001"]
    for rank in ranks:
        theirs, _ = megatron_pickle.load(theirs_root, f"{rank}/model_optim_rng.pt", max_size=1 << 30)
        ours, _ = megatron_pickle.load(ours_root, f"{rank}/model_optim_rng.pt", max_size=1 << 30)
        a = {k: v for k, v in theirs["model"].items() if isinstance(v, torch.Tensor)}
        b = {k: v for k, v in ours["model"].items() if isinstance(v, torch.Tensor)}
        assert a.keys() == b.keys(), (rank, sorted(set(a) ^ set(b)))
        assert set(theirs["model"]) == set(ours["model"]), rank  # the _extra_state entries too
        for k in a:
            if k in ("embedding.word_embeddings.weight", "output_layer.weight") and rank.startswith("mp_rank_01"):
                assert a[k].shape == b[k].shape  # TP rank 1 holds only vocabulary padding: ours is zeros
                continue
            assert torch.equal(a[k], b[k]), f"{rank}: {k}"
        assert ours["args"].tensor_model_parallel_size == 2 and ours["args"].num_query_groups == 2




@pytest.mark.parametrize("world", [1, 2])
def test_restore_from_megatron_brings_adams_moments_to_the_right_elements(made, tmp_path, world):
    """Megatron took one Adam step (lr 1e-3, betas 0.9/0.95) with gradient g = 0.5 w0 + 0.25 on every
    element, so every element must satisfy exp_avg = 0.1 g, exp_avg_sq = 0.05 g^2 and
    w = w0 - 1e-3 sign(g) = 2g - 0.5 - 1e-3 sign(g): a moment on the wrong element breaks it."""
    from distributed import run_ranks

    hf = convert(made[(2, 2)] / "torch_dist", tmp_path / "hf", "hf")
    got = run_ranks(world, restore_with_adam, source=str(made[(2, 2)] / "torch_dist"), config=str(hf))[0]
    check_fixture_adam(got)


def test_an_export_like_a_run_padded_for_another_divisor_loads_in_it(tmp_path):
    """A real run on TP=2 with --make-vocab-size-divisible-by 64 holds 128 embedding rows (the default would pad
    to 256): ``--like`` that run gives an export with the run's TP and rows, which megatron-core loads strictly
    into the run's layout with the run's logits."""
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    _megatron("--tp", "2", "--pp", "1", "--divisible-by", "64", "--out", str(run))
    ref = torch.load(run / "reference.pt")
    hf = convert(run / "torch_dist", tmp_path / "hf", "hf")
    out = convert(hf, tmp_path / "export", "megatron", options={"like": str(run / "torch_dist")})

    def rows(iteration: Path) -> int:
        return FileSystemReader(str(iteration)).read_metadata().state_dict_metadata[
            "embedding.word_embeddings.weight"].size[0]

    assert rows(out / "iter_0000000") == rows(run / "torch_dist" / "iter_0000002") == 128
    _megatron("--tp", "2", "--pp", "1", "--load", str(out / "iter_0000000"), "--out", str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    assert torch.allclose(got["logits"], ref["logits"], atol=1e-5, rtol=0), (got["logits"] - ref["logits"]).abs().max()
