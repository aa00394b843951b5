"""Unchanged tensors stored once (issue 47): a frozen fine-tune's saves hard-link the files of frozen tensors whose
bytes did not change, and every step directory stays whole for every reader.

Real saves of the tiny Llama with its embeddings (tied to the head) and first layer frozen: what is shared and what
is written, every kept step resumed bitwise (also saved on 2 ranks and resumed on 1 and 2), a frozen tensor edited
in place saved anew, tensors swapping their bytes, a damaged shared file named in every step that uses it with the
resume falling back past all of them, the real ``transformers`` on a consolidated bundle of a step whose weights
are all shared, plain DCP on a shared step's ``optim/``, and hostile manifest fields refused.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptio import CheckpointConfig, CheckpointManager
from ckptio.cli import main
from ckptio.engine.manifest import MANIFEST_NAME, Manifest, read_manifest
from ckptio.engine.sharing import max_holders
from ckptio.errors import CheckpointCorruptError
from ckptio.storage import LocalStorage
from toy import Run, full_state, make_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _steps(root: Path) -> dict[int, Path]:
    return {read_manifest(p).step: p for p in sorted(root.iterdir()) if (p / MANIFEST_NAME).is_file()}


def _model_files(step: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in (step / "model").glob("*.safetensors")}


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _frozen_run(root: Path, steps: int, **config: object) -> tuple[Run, dict[int, dict]]:
    run = Run(root, max_steps=steps, freeze=True, **config)
    saved: dict[int, dict] = {}

    def save() -> None:
        run.mgr.save(metrics={"loss": float(abs(run.steps.step - 2))})  # best: steps 1-3
        saved[run.steps.step] = full_state(run.model, run.opt)

    run.train(after_step=save)
    run.mgr.close()
    return run, saved


def _restored(step: Path) -> dict:
    other = Run(step.parent, max_steps=100, seed=1, freeze=True)  # another init: everything comes from disk
    other.mgr.restore(step)
    state = full_state(other.model, other.opt)
    other.mgr.close()
    return state


def test_a_frozen_fine_tune_writes_what_changed_and_every_kept_step_resumes_bitwise(tmp_path, capsys):
    run, saved = _frozen_run(tmp_path, 12, keep_latest=5, save_top_k=3, monitor="loss")
    steps = _steps(tmp_path)
    assert len(steps) == 8, sorted(steps)  # the 5 newest and the 3 best: eight kept
    first = steps[min(steps)]
    frozen = {rel for rel in read_manifest(first).contents}
    assert frozen and all(rel.startswith("model/") for rel in frozen)
    files = [_model_files(p) for p in steps.values()]
    copies = {}
    for rel in frozen:  # each frozen file linked from several kept steps, but no copy held by all of them
        name = rel.removeprefix("model/")
        inodes = {f[name].st_ino: f[name].st_nlink for f in files}
        assert 2 <= len(inodes) < len(steps) and max(inodes.values()) <= max_holders(run.mgr.config), inodes
        copies[rel] = len(inodes)
    trainable = set(files[0]) - {rel.removeprefix("model/") for rel in frozen}
    assert trainable and all(len({f[n].st_ino for f in files}) == len(steps) for n in trainable)
    # the folder holds one full checkpoint and, for every other step, what changed (du counts a linked file once)
    full = read_manifest(first).total_bytes
    shared = sum(read_manifest(first).files[rel] for rel in frozen)
    inodes = {p.stat().st_ino: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    used = sum(inodes.values())
    extra = sum((copies[rel] - 1) * read_manifest(first).files[rel] for rel in frozen)  # the second copies
    assert used <= full + (len(steps) - 1) * (full - shared) * 1.05 + extra + 64 * 1024, (used, full, shared)
    du = int(subprocess.run(["du", "-sb", str(tmp_path)], capture_output=True, text=True, check=True).stdout.split()[0])
    dirs = sum(1 for p in tmp_path.rglob("*") if p.is_dir())
    assert used <= du <= used + (dirs + 1) * 4096  # du counts a linked file once too
    # the manifests say what they share; list and inspect show what each step owns and shares
    for step, path in steps.items():
        m = read_manifest(path)
        assert set(m.contents) == frozen and not m.shared  # locally a shared file is a link, not a reference
        owned, shares = m.ownership(LocalStorage(tmp_path).folder(path.name))
        assert shares in (0, shared) and owned == m.total_bytes - shares  # a copy held by this step alone is owned
        _same(saved[step], _restored(path), f"step {step}")
    capsys.readouterr()
    assert main(["list", "--json", str(tmp_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {r["shared_bytes"] for r in info["checkpoints"]} <= {0, shared} and shared in {r["shared_bytes"] for r in info["checkpoints"]}
    assert main(["inspect", str(steps[max(steps)])]) == 0
    # plain DCP reads a shared step's optimizer, and AutoModel-style readers see whole folders
    md = dcp.FileSystemReader(str(steps[max(steps)] / "optim")).read_metadata()
    assert any(k.endswith("exp_avg") for k in md.state_dict_metadata)


def test_a_frozen_tensor_edited_in_place_is_saved_anew_and_swapped_bytes_stay_right(tmp_path):
    run = Run(tmp_path, max_steps=100, freeze=True)
    layer = run.model.model.layers[0].mlp
    with torch.no_grad():  # two frozen tensors of one shape
        layer.up_proj.weight.copy_(torch.randn_like(layer.up_proj.weight))
    saved = {}

    def save(step: int) -> None:
        saved[step] = full_state(run.model, run.opt)
        run.mgr.save(step=step)

    save(1)
    save(2)  # a second copy: two steps never share their only one
    save(3)
    with torch.no_grad():  # a frozen tensor edited in place: requires_grad says nothing, its bytes differ
        run.model.model.embed_tokens.weight[3, 5] += 1.0
    save(4)
    with torch.no_grad():  # two frozen tensors swap their bytes: every name must still get its own
        a, b = layer.gate_proj.weight.clone(), layer.up_proj.weight.clone()
        layer.gate_proj.weight.copy_(b)
        layer.up_proj.weight.copy_(a)
    save(5)
    with torch.no_grad():  # and the same bytes under two names
        layer.gate_proj.weight.copy_(layer.up_proj.weight)
    save(6)
    save(7)
    run.mgr.close()
    steps = _steps(tmp_path)
    files = {s: _model_files(p) for s, p in steps.items()}
    frozen = sorted(rel.removeprefix("model/") for rel in read_manifest(steps[1]).contents)
    linked = lambda s, t: [n for n in frozen if files[s][n].st_ino == files[t][n].st_ino]  # noqa: E731
    assert linked(1, 2) == [] and linked(2, 3) == frozen  # nothing changed (step 2: the second copy)
    assert 0 < len(linked(3, 4)) < len(frozen)  # the embeddings' file is new, the layer's is shared
    assert len(linked(4, 5)) < len(frozen) and len(linked(5, 6)) < len(frozen)
    assert linked(6, 7) == frozen
    for step, path in steps.items():
        _same(saved[step], _restored(path), f"step {step}")
    restored4 = _restored(steps[4])
    key = "model/model.embed_tokens.weight"
    assert torch.equal(restored4[key][3, 5], saved[3][key][3, 5] + 1)


def test_a_damaged_shared_file_is_named_in_every_step_using_it_and_resume_falls_back_past_them(tmp_path, capsys):
    run = Run(tmp_path, max_steps=100, freeze=True)
    saved = {}
    for step in (1, 2, 3, 4):
        if step == 2:
            with torch.no_grad():
                run.model.model.embed_tokens.weight[0, 0] += 1.0
        saved[step] = full_state(run.model, run.opt)
        run.mgr.save(step=step)
    run.mgr.close()
    steps = _steps(tmp_path)
    before, after = _model_files(steps[1]), _model_files(steps[2])
    new = [n for n in after if n in before and after[n].st_ino != before[n].st_ino and after[n].st_nlink == 3]
    assert new, (before, after)  # written at step 2 (the edited one; the others as a second copy), shared by 3 and 4
    damaged = steps[2] / "model" / new[0]
    with open(damaged, "r+b") as fh:  # a bit flips on the disk: one inode, three steps
        fh.seek(damaged.stat().st_size - 7)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    capsys.readouterr()
    for step, path in steps.items():
        assert main(["verify", str(path)]) == (0 if step == 1 else 1)
        out = capsys.readouterr()
        assert (new[0] in out.out + out.err) == (step != 1), out
    assert main(["verify", str(tmp_path), "--json"]) == 1  # the whole folder: every step that holds the copy, named
    report = json.loads(capsys.readouterr().out)
    bad = {Path(path).name: problems for path, problems in report["checkpoints"].items() if problems}
    assert set(bad) == {steps[s].name for s in (2, 3, 4)}, report
    assert all(new[0] in " ".join(problems) for problems in bad.values()), report
    other = Run(tmp_path, max_steps=100, seed=1, freeze=True)
    info = other.mgr.restore()
    assert info is not None and info.step == 1  # past 4, 3 and 2: each uses the damaged file
    _same(saved[1], full_state(other.model, other.opt), "fallback to step 1")
    other.mgr.close()
    os.remove(steps[1] / MANIFEST_NAME)
    other = Run(tmp_path, max_steps=100, seed=1, freeze=True)
    with pytest.raises(CheckpointCorruptError, match=new[0]):  # the last candidate's damage, named
        other.mgr.restore()
    other.mgr.close()


def test_transformers_loads_the_consolidated_bundle_of_a_step_whose_weights_are_all_shared(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model(seed=3)
    for p in model.parameters():
        p.requires_grad_(False)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt")), model=model) as mgr:
        for step in (1, 2, 3):  # step 2 holds a second copy, step 3 links it
            mgr.save(step=step)
    steps = _steps(tmp_path / "ckpt")
    m3 = read_manifest(steps[3])
    weights = [rel for rel in m3.files if rel.endswith(".safetensors")]
    assert weights and set(weights) == set(m3.contents)  # every weight file is frozen, hence shared
    assert all((steps[3] / rel).stat().st_nlink == 2 for rel in weights)
    assert main(["consolidate", str(steps[3]), "--out", str(tmp_path / "hf"), "--no-progress"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_nothing_is_shared_when_turned_off_or_without_frozen_tensors(tmp_path):
    for name, freeze, share in (("off", True, False), ("none_frozen", False, True)):
        run = Run(tmp_path / name, max_steps=100, freeze=freeze, share_unchanged=share)
        run.mgr.save(step=1)
        run.mgr.save(step=2)
        run.mgr.close()
        steps = _steps(tmp_path / name)
        assert all(s.st_nlink == 1 for p in steps.values() for s in _model_files(p).values()), name
        assert bool(read_manifest(steps[2]).contents) == (freeze and share), name


def test_a_link_is_made_only_to_a_regular_committed_file_of_the_expected_size(tmp_path):
    storage = LocalStorage(tmp_path)
    (tmp_path / "a" / "model").mkdir(parents=True)
    (tmp_path / "a" / "model" / "f.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "outside").write_bytes(b"y" * 10)
    (tmp_path / "a" / "model" / "link.safetensors").symlink_to(tmp_path / "outside")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    writer = storage.begin_step("c")
    assert writer.link("model/f.safetensors", "a/model/f.safetensors", 10)
    assert not writer.link("model/g.safetensors", "a/model/f.safetensors", 11)  # not the size the manifest says
    assert not writer.link("model/h.safetensors", "a/model/link.safetensors", 10)  # a link is never followed
    assert not writer.link("model/i.safetensors", "b/model/f.safetensors", 10)  # nor a linked folder
    assert not writer.link("model/j.safetensors", "a/model/missing.safetensors", 10)
    with pytest.raises(CheckpointCorruptError):
        writer.link("model/k.safetensors", "../outside", 10)
    writer.abort()


@pytest.mark.parametrize("field, value, message", [
    ("contents", {"model/a.safetensors": "sha256:" + "0" * 63}, "sha256 digest"),
    ("contents", {"model/missing.safetensors": "sha256:" + "0" * 64}, "not among the step's files"),
    ("shared", {"model/a.safetensors": "../other/model/a.safetensors"}, "'..'"),
    ("shared", {"model/a.safetensors": "step/model/a.safetensors"}, "another step"),
    ("shared", {"model/a.safetensors": "a.safetensors"}, "another step"),
    ("shared", {"model/a.safetensors": ".tmp-x/model/a.safetensors"}, "another step"),
    ("shared", {"model/a.safetensors": 3}, "a file of another step"),
])
def test_hostile_sharing_fields_are_refused_by_name(tmp_path, field, value, message):
    m = Manifest(name="step", step=1, epoch=0, world_size=1, model_save_format="safetensors", states={},
                 files={"model/a.safetensors": 10})
    setattr(m, field, value)
    with pytest.raises(CheckpointCorruptError, match=field) as caught:
        Manifest.from_json(m.to_json(), tmp_path / MANIFEST_NAME)
    assert message in str(caught.value)


def _save_frozen(root: str) -> dict:
    run = Run(root, max_steps=4, freeze=True)
    states = {}

    def save() -> None:
        run.mgr.save()
        states[run.steps.step] = full_state(run.model, run.opt)

    run.train(after_step=save)
    run.mgr.close()
    return states


def _restore_each(root: str, steps: list[int], then_train: int = 0) -> dict:
    """Restore each of ``steps`` into a fresh run; then resume the newest and train (saving) ``then_train`` steps."""
    out = {}
    by_step = _steps(Path(root))
    for step in steps:
        other = Run(root, max_steps=100, seed=1, freeze=True)
        other.mgr.restore(by_step[step])
        out[step] = full_state(other.model, other.opt)
        other.mgr.close()
    if then_train:
        run = Run(root, max_steps=max(steps) + then_train, seed=1, freeze=True)
        run.mgr.restore()
        run.train(after_step=run.mgr.save)
        run.mgr.close()
    return out


@pytest.mark.slow
def test_saved_on_two_ranks_resumed_bitwise_on_two_and_one_and_shared_again_after_the_change(tmp_path):
    from distributed import run_ranks

    root = str(tmp_path)
    saved = run_ranks(2, _save_frozen, root=root)[0]
    steps = _steps(tmp_path)
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (3, 4):  # every rank's frozen files shared with step 2 (step 2: the second copy)
        m = read_manifest(steps[step])
        assert len(m.contents) >= 2 and any(rel.startswith("model/shard-00002-") for rel in m.contents)
        assert all((steps[step] / rel).stat().st_ino == (steps[2] / rel).stat().st_ino for rel in m.contents)
        assert all((steps[step] / rel).stat().st_ino != (steps[1] / rel).stat().st_ino for rel in m.contents)
    for step, state in run_ranks(2, _restore_each, root=root, steps=[4])[0].items():
        _same(saved[step], state, f"2 -> 2 ranks, step {step}")
    resumed = run_ranks(1, _restore_each, root=root, steps=[1, 2, 3, 4], then_train=2)[0]
    for step, state in resumed.items():
        _same(saved[step], state, f"2 -> 1 rank, step {step}")
    steps = _steps(tmp_path)
    five, six = read_manifest(steps[5]), read_manifest(steps[6])
    assert not any(rel.startswith("model/shard-00002-") for rel in five.files)  # saved on one rank now
    assert set(six.contents) == set(five.contents)
    assert all((steps[6] / rel).stat().st_ino == (steps[5] / rel).stat().st_ino for rel in six.contents)


def test_tar_carries_a_step_whose_frozen_files_are_links_and_it_resumes_from_the_copy(tmp_path):
    run = Run(tmp_path / "ckpt", max_steps=100, freeze=True)
    run.mgr.save(step=1)
    saved = full_state(run.model, run.opt)
    run.mgr.save(step=2)  # the second copy, linked by step 3
    run.mgr.save(step=3)
    run.mgr.close()
    step = _steps(tmp_path / "ckpt")[3]
    assert any(s.st_nlink == 2 for s in _model_files(step).values())
    (tmp_path / "copy").mkdir()
    subprocess.run(["tar", "-cf", str(tmp_path / "step.tar"), "-C", str(step.parent), step.name], check=True)
    subprocess.run(["tar", "-xf", str(tmp_path / "step.tar"), "-C", str(tmp_path / "copy")], check=True)
    assert main(["verify", str(tmp_path / "copy" / step.name)]) == 0
    _same(saved, _restored(tmp_path / "copy" / step.name), "a tar copy of a step with linked files")
