"""The bytes ckptio writes stay the same: a checkpoint of a fixed-seed model and optimizer, saved in each
model format (with a consolidated bundle and a PEFT adapter), must match the digests recorded in
``tests/data/ondisk_golden.json``.

This guards the on-disk contract against accidental changes (a refactor, a reordered header). A change
that is meant must update the golden file in the same commit, with the reason in its message:

    .venv/bin/python tests/test_ondisk_stability.py --update

Fields that legitimately differ between two saves are left out of the comparison: the manifest's
``created``, ``versions`` and ``manifest_checksum``, DCP's per-save ids in ``.metadata``, and the
transformers version stamped into the files transformers writes.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).parent / "data" / "ondisk_golden.json"


_STAMPED = ("config.json", "generation_config.json")
"""The ``*config.json`` files transformers writes, some with its own version inside (``transformers_version``): their bytes are
compared without it, and the manifest's sizes and checksums of them are left out, so the test holds on
every supported transformers."""


def _normalised(rel: str, data: bytes, ignore: set[str]) -> bytes:
    if rel.endswith(_STAMPED):
        doc = json.loads(data)
        doc.pop("transformers_version", None)
        return json.dumps(doc, sort_keys=True).encode()
    if rel.endswith("manifest.json"):
        doc = json.loads(data)
        for key in ("created", "versions", "manifest_checksum"):
            doc.pop(key, None)
        for key in ("files", "checksums"):
            # DCP's .metadata holds per-save ids and the folder's path: its size and checksum vary
            doc[key] = {k: v for k, v in doc[key].items()
                        if k not in ignore and not k.endswith(".metadata") and not k.split("/")[-1] in _STAMPED}
        return json.dumps(doc, sort_keys=True).encode()
    if rel.endswith(".metadata"):
        md = pickle.loads(data)  # our own file, written just now
        md.storage_meta = None
        return repr((sorted((k, repr(v)) for k, v in md.state_dict_metadata.items()),
                     sorted((repr(k), repr(v)) for k, v in (md.storage_data or {}).items()),
                     repr(md.planner_data))).encode()
    return data


def _digests(root: Path, ignore: frozenset[str] = frozenset()) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(_normalised(p.name, p.read_bytes(), ignore)).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
            and p.relative_to(root).as_posix() not in ignore}


def _exact(t: torch.Tensor, salt: int) -> torch.Tensor:
    """Values that every CPU computes bit for bit (integer arithmetic, one correctly rounded division), so the
    digests do not depend on the machine's vector unit: a forward, backward and AdamW step do (the golden file
    made on one CPU did not match on another)."""
    n = torch.arange(t.numel(), dtype=torch.int64).reshape(t.shape)
    return ((n * 2654435761 + salt * 40503) % 2003).to(torch.float32).div(2003.0).sub(0.5).to(t.dtype)


@torch.no_grad()
def _pin_values(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Overwrite every parameter (and optimizer moment) with :func:`_exact` values after the state exists."""
    for i, p in enumerate(model.parameters()):
        p.copy_(_exact(p, i))
        for j, (name, v) in enumerate(sorted((opt.state.get(p, {}) if opt else {}).items())):
            if torch.is_tensor(v) and v.dim() > 0:
                v.copy_(_exact(v, 1000 * (j + 1) + i).abs() if name == "exp_avg_sq" else _exact(v, 1000 * (j + 1) + i))


def snapshot(tmp: Path) -> dict[str, dict[str, str]]:
    sys.path.insert(0, str(Path(__file__).parent))
    from toy import Counter, make_model, make_tokenizer

    from ckptio import CheckpointConfig, CheckpointManager

    out = {}
    for fmt in ("safetensors", "torch_save"):
        model = make_model(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ids = torch.arange(32).reshape(2, 16) % 64
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        _pin_values(model, opt)
        root = tmp / fmt
        cfg = CheckpointConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated=True)
        with CheckpointManager(cfg, model=model, optimizer=opt, lr_scheduler=sched, rng=False,
                               extra_states={"counter": Counter()}, tokenizer=make_tokenizer()) as mgr:
            mgr.save(step=7, epoch=1, metrics={"val_loss": 1.5}, counters={"consumed_samples": 14})
        out[fmt] = _digests(root / "epoch_1_step_7")
    model = make_model(seed=0, peft=True, base_dir=str(tmp / "base"))
    _pin_values(model)
    root = tmp / "peft"
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), is_peft=True), model=model, rng=False,
                           base_model_path=str(tmp / "base")) as mgr:
        mgr.save(step=3)
    # the adapter config records the absolute base path, which is this test's temporary folder
    out["peft"] = _digests(root / "epoch_0_step_3", frozenset({"model/adapter_config.json"}))
    return out


def test_bytes_on_disk_match_the_golden_digests(tmp_path):
    want = json.loads(GOLDEN.read_text())
    got = snapshot(tmp_path)
    for name in want:
        assert got[name].keys() == want[name].keys(), f"{name}: files differ"
        changed = [rel for rel in want[name] if got[name][rel] != want[name][rel]]
        assert not changed, f"{name}: bytes changed in {changed} (if meant, rerun with --update; see the docstring)"


if __name__ == "__main__" and "--update" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(snapshot(Path(tmp)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
