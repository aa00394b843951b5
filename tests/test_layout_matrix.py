"""Save on one parallel layout, restore bitwise on another: TP, FSDP, FSDP × TP on a 2-D mesh, pipeline stages.

Each save writes the same training state (same seed, the same made-up gradients, one AdamW step) in
both model formats, and each load starts from another initialisation, so everything compared must
come from disk. The states are compared whole (DTensors gathered), model and optimizer, key by key.
The consolidated Hugging Face bundle written from every layout must be the same bytes.

Layouts (see ``layouts.py``): ``1``, ``tp2``, ``fsdp3`` (3 ranks over dimensions of 32 and 64: uneven
shards), ``fsdp4``, ``pp2`` and ``fsdp2xtp2`` (4 ranks; parameters TP leaves whole are FSDP shards held
by both TP replicas, which used to be written twice and then refused as overlapping).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import layouts
from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

FORMATS = ("safetensors", "torch_save")
# saved on -> restored on
MATRIX = {
    "1": ("tp2", "fsdp3", "fsdp2xtp2"),
    "tp2": ("1", "fsdp3"),
    "fsdp2xtp2": ("fsdp2xtp2", "fsdp2", "1"),
    "fsdp3": ("fsdp4", "tp2", "pp2"),
    "pp2": ("tp2",),
}


def _config(root: str, fmt: str):
    from ckptio import CheckpointConfig

    return CheckpointConfig(checkpoint_dir=f"{root}/{fmt}", model_save_format=fmt,
                            save_consolidated=fmt == "safetensors")


def _save(root: str, layout: str) -> dict:
    from ckptio import CheckpointManager

    model, opt = layouts.build(layout, seed=0)
    for fmt in FORMATS:
        with CheckpointManager(_config(root, fmt), model=model, optimizer=opt, rng=False) as mgr:
            mgr.save(step=1)
    return layouts.full_state(model, opt)


def _load(root: str, layout: str) -> dict:
    from ckptio import CheckpointManager

    out = {}
    for fmt in FORMATS:
        model, opt = layouts.build(layout, seed=1)  # another init: everything must come from disk
        with CheckpointManager(_config(root, fmt), model=model, optimizer=opt, rng=False) as mgr:
            assert mgr.restore() is not None
        out[fmt] = layouts.full_state(model, opt)
    return out


def _bundle_digests(root: Path) -> dict[str, str]:
    (step,) = [p for p in (root / "safetensors").iterdir() if p.name.startswith("epoch")]
    folder = step / "model" / "consolidated"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    out = {}
    for layout in MATRIX:
        root = str(tmp_path_factory.mktemp(f"saved-{layout}"))
        out[layout] = root, layouts.union(run_ranks(layouts.ranks(layout), _save, root=root, layout=layout))
    return out


def test_every_layout_saves_the_same_state_and_the_same_bundle(saved):
    first_layout, (first_root, first_state) = next(iter(saved.items()))
    first_bundle = _bundle_digests(Path(first_root))
    assert any(name.endswith(".safetensors") for name in first_bundle)
    for layout, (root, state) in saved.items():
        layouts.assert_same(first_state, state, f"live state on {layout} vs {first_layout}")
        assert _bundle_digests(Path(root)) == first_bundle, f"the consolidated bundle from {layout} differs"


@pytest.mark.parametrize("src,dst", [(s, d) for s, ds in MATRIX.items() for d in ds])
def test_restore_on_another_layout(saved, src, dst):
    root, state = saved[src]
    loaded = run_ranks(layouts.ranks(dst), _load, root=root, layout=dst)
    for fmt in FORMATS:
        layouts.assert_same(state, layouts.union([part[fmt] for part in loaded]), f"{fmt}: {src} -> {dst}")
