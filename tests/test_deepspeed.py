"""DeepSpeed checkpoints in and out, against the real DeepSpeed (0.19, CPU, gloo, under torchrun).

The fixtures train tiny models with DeepSpeed (``tests/ds_run.py``) and convert their checkpoints with DeepSpeed's own
``ds_to_universal``: its per-parameter files are the reference every value ckptio reads is compared with, bitwise.
ckptio reads without DeepSpeed (a subprocess that cannot import it), resumes on 1 and 2 ranks (FSDP2), converts to
Hugging Face (``transformers`` loads it, logits equal) and writes universal folders that DeepSpeed loads and trains
on."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("deepspeed", reason="test-only dependency: pip install --no-build-isolation deepspeed")

from distributed import launch, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ENV = {"DS_ACCELERATOR": "cpu"}


def _ds(out: Path, *args: str, ranks: int = 2) -> None:
    r = launch(str(HERE / "ds_run.py"), str(out), *args, ranks=ranks, real=True, env=ENV, timeout=300)
    assert r.returncode == 0, f"DeepSpeed run failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _universal(tag_dir: Path) -> Path:
    out = tag_dir.with_name(tag_dir.name + "_universal")
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
                        "--output_folder", str(out), "--inject_missing_state"], capture_output=True, text=True,
                       env={**os.environ, **ENV}, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def _atomic(universal: Path, name: str, what: str) -> torch.Tensor:
    """DeepSpeed's own value of ``what`` for parameter ``name`` (its universal folder's file)."""
    obj = torch.load(universal / "zero" / name / f"{what}.pt", weights_only=False)
    return obj["param"] if isinstance(obj, dict) else obj


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """zero2: ZeRO-2 on 2 ranks (fp32), saved at steps 3 and 4; zero3: ZeRO-3 on 2 ranks in bf16, a Llama saved as
    the HF Trainer does (``checkpoint-3/``); zero1: ZeRO-1 on 1 rank in bf16; fp16: ZeRO-2 on 1 rank in fp16 with its
    dynamic loss scaler (DeepSpeed's CPU accelerator is told it may: ``ds_run.py``). Each with DeepSpeed's universal
    folder of step 3."""
    from fixture_cache import ds_run

    root = tmp_path_factory.mktemp("ds")
    out = {kind: Path(shutil.copytree(ds_run(*args, ranks=ranks), root / kind, symlinks=True))  # a copy: the tests
           for kind, args, ranks in [("zero2", ("--stage", "2", "--more", "1"), 2),  # below write into it
                                     ("zero3", ("--stage", "3", "--bf16", "--model", "llama", "--hf"), 2),
                                     ("zero1", ("--stage", "1", "--bf16"), 1), ("fp16", ("--stage", "2", "--fp16"), 1)]}
    tags = {"zero2": out["zero2"] / "global_step3", "zero3": out["zero3"] / "checkpoint-3" / "global_step3",
            "zero1": out["zero1"] / "global_step3", "fp16": out["fp16"] / "global_step3"}
    return {k: (out[k], tags[k], _universal(tags[k])) for k in out}


MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("kind", ["zero1", "zero2", "zero3", "fp16"])
def test_masters_and_moments_equal_deepspeeds_own_bitwise(runs, kind):
    from ckptio.formats.deepspeed.zero import ZeroCheckpoint

    _, tag, universal = runs[kind]
    ck, back = ZeroCheckpoint(tag), ZeroCheckpoint(universal)
    try:
        assert ck.stage == {"zero1": 1, "zero2": 2, "zero3": 3, "fp16": 2}[kind] and back.universal and ck.has_moments()
        assert ck.adam_step() == back.adam_step() == 3.0
        for name in ck.shapes:
            for what in MOMENTS:
                got, want = ck.read(name, what), _atomic(universal, name, what)
                assert got.dtype == torch.float32 and torch.equal(got.flatten(), want.flatten()), (name, what)
                assert torch.equal(back.read(name, what), got)  # ckptio reads the universal folder alike
    finally:
        ck.close()
        back.close()


def test_read_without_deepspeed_installed(runs):
    """A process in which ``import deepspeed`` fails reads every kind; no DeepSpeed module is ever imported."""
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "from ckptio.formats import registry\n"
            "for path in sys.argv[1:]:\n"
            "    o = registry.detect(path).open(__import__('pathlib').Path(path))\n"
            "    [o.source.read(k) for k in o.source.index()]; o.close()\n"
            "assert not [m for m in sys.modules if m.startswith('deepspeed') and sys.modules[m] is not None]\n"
            "print('ok')")
    paths = [str(runs[k][0]) for k in runs] + [str(runs["zero2"][2])]
    r = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def _toy_manager(checkpoint_dir, hidden: int = 32, **kw):
    from toy import TinyLM

    from ckptio import CheckpointConfig, CheckpointManager

    torch.manual_seed(5)
    model = TinyLM(hidden=hidden)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    manager = CheckpointManager(CheckpointConfig(checkpoint_dir=str(checkpoint_dir), **kw), model=model,
                                optimizer=opt, lr_scheduler=sched)
    return manager, model, opt, sched


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _equal_to_deepspeed(model, opt, sched, u: Path, step: int) -> None:
    """Every parameter, its Adam moments and step equal DeepSpeed's own (its universal folder ``u``), and the scheduler
    and learning rate are where DeepSpeed's were at ``step``."""
    bad = []
    for name, p in model.named_parameters():
        state = opt.state[p]
        for what, value in (("fp32", p), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            if not torch.equal(_full(value.detach()).flatten(), _atomic(u, name, what).flatten()):
                bad.append((name, what))
        step_pt = u / "zero" / name / "step.pt"  # stage 3's universal folder keeps one step, in optimizer_state.pt
        want = torch.load(step_pt) if step_pt.is_file() else torch.load(
            u / "zero" / "optimizer_state.pt", weights_only=False)["optimizer_state_dict"]["state"][0]["step"]
        assert float(state["step"]) == float(want)
    assert not bad, bad
    assert sched.last_epoch == step
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5 ** (step // 2)  # StepLR(2, 0.5), as DeepSpeed had it


def _resume_and_compare(run_dir: str, universal: str, restore_from: str | None, train_step: bool, next_tag: str | None,
                        hidden: int = 32):
    """On every rank: resume a plain model and AdamW from a DeepSpeed folder; compare with DeepSpeed's values; with
    ``train_step``, take the step DeepSpeed took next (its batches, per rank) and compare with DeepSpeed's next save."""
    import tempfile

    from ds_run import batch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    manager, model, opt, sched = _toy_manager(run_dir if restore_from is None else tempfile.mkdtemp(), hidden=hidden)
    info = manager.restore(restore_from)
    assert info.counters["source_format"] == "deepspeed" and info.counters["optimizer_restored"]
    assert info.counters["scheduler_restored"]
    _equal_to_deepspeed(model, opt, sched, Path(universal), info.step)
    if train_step:
        x = batch(rank, info.step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        from ckptio.formats.deepspeed.zero import ZeroCheckpoint

        ck = ZeroCheckpoint(Path(next_tag))
        worst = max(float((_full(p.detach()) - ck.read(n)).abs().max()) for n, p in model.named_parameters())
        ck.close()
        assert worst < 1e-6, worst
    manager.close()
    return info.step


def test_auto_resume_finds_latest_and_continues_on_one_process(runs):
    """2 -> 1: the folder DeepSpeed saved into is the checkpoint_dir; ``latest`` names global_step4."""
    run_dir, tag, _ = runs["zero2"]
    four = _universal(run_dir / "global_step4")
    assert run_ranks(1, _resume_and_compare, run_dir=str(run_dir), universal=str(four), restore_from=None,
                     train_step=False, next_tag=None) == [4]


def test_resume_on_two_ranks_continues_as_deepspeed_did(runs):
    """2 -> 2 under FSDP2, from global_step3: the values equal DeepSpeed's, and the next step lands where DeepSpeed's
    own step 4 did."""
    run_dir, tag, universal = runs["zero2"]
    assert run_ranks(2, _resume_and_compare, run_dir=str(run_dir), universal=str(universal), restore_from=str(tag),
                     train_step=True, next_tag=str(run_dir / "global_step4")) == [3, 3]


def test_one_rank_run_resumes_on_two_ranks(runs):
    """1 -> 2: ZeRO-1 on one rank in bf16, its fp32 masters resumed under FSDP2 on two."""
    run_dir, tag, universal = runs["zero1"]
    assert run_ranks(2, _resume_and_compare, run_dir=str(run_dir), universal=str(universal), restore_from=None,
                     train_step=False, next_tag=None) == [3, 3]


def test_hf_trainer_folder_converts_to_a_bundle_transformers_loads(runs, tmp_path):
    """ZeRO-3 in bf16 inside ``checkpoint-3/``: the bundle holds the fp32 masters cast to bf16; logits equal."""
    from transformers import AutoModelForCausalLM

    from ckptio.cli import main

    run_dir, tag, _ = runs["zero3"]
    assert main(["convert", str(run_dir), str(tmp_path / "hf"), "--to", "hf", "--dtype", "bf16"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                                   "model.safetensors.index.json"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).view(1, 16) % 64).logits.float()
    assert torch.equal(logits, torch.load(run_dir / "logits.pt"))


def _restore_converted(step_dir: str, universal: str) -> int:
    import tempfile

    manager, model, opt, sched = _toy_manager(tempfile.mkdtemp())
    info = manager.restore(step_dir)
    assert "source_format" not in info.counters  # a ckptio checkpoint, restored as one
    _equal_to_deepspeed(model, opt, sched, Path(universal), info.step)
    manager.close()
    return info.step


def test_convert_to_a_ckptio_checkpoint_carries_the_whole_training_state(runs, tmp_path):
    """``ckptio convert`` of a DeepSpeed run to a step directory: weights, Adam and the scheduler, resumed (resharded)
    on 1 and 2 ranks as any ckptio checkpoint."""
    from ckptio.cli import main

    run_dir, tag, universal = runs["zero2"]
    out = tmp_path / "ckpt" / "step_3"
    out.parent.mkdir()
    assert main(["convert", str(tag), str(out), "--to", "step_dir"]) == 0
    assert main(["verify", str(out)]) == 0
    for ranks in (1, 2):
        assert run_ranks(ranks, _restore_converted, step_dir=str(out), universal=str(universal)) == [3] * ranks


def _restore_llama(run_dir: str, universal: str):
    from toy import make_model

    from ckptio import CheckpointConfig, CheckpointManager

    model = make_model(attention_dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    import tempfile

    manager = CheckpointManager(CheckpointConfig(checkpoint_dir=tempfile.mkdtemp()), model=model, optimizer=opt)
    info = manager.restore(run_dir)
    u = Path(universal)
    for name, p in model.named_parameters():
        assert torch.equal(_full(p.detach()).flatten(), _atomic(u, name, "fp32").flatten()), name
        assert torch.equal(_full(opt.state[p]["exp_avg_sq"]).flatten(), _atomic(u, name, "exp_avg_sq").flatten())
    manager.close()
    return info.step


@pytest.mark.parametrize("ranks", [1, 2])
def test_zero3_bf16_masters_resume_on_one_and_two_ranks(runs, ranks):
    """ZeRO-3 on 2 ranks in bf16, an HF Trainer's output folder: 2 -> 1 and 2 -> 2 (FSDP2)."""
    run_dir, _, universal = runs["zero3"]
    assert run_ranks(ranks, _restore_llama, run_dir=str(run_dir), universal=str(universal)) == [3] * ranks


def _to_ckptio(run_dir: str, out: str) -> float:
    """Resume from DeepSpeed and save a ckptio checkpoint; the loss of the next batch, for DeepSpeed to match."""
    from ds_run import batch

    manager, model, opt, sched = _toy_manager(out)
    info = manager.restore(run_dir)
    manager.save(step=info.step)
    manager.close()
    x = batch(0, info.step)
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss)


@pytest.mark.parametrize("ranks,stage", [(1, 2), (2, 3)])
def test_a_ckptio_checkpoint_goes_back_to_deepspeed_and_trains_on(runs, tmp_path, ranks, stage):
    from ckptio.cli import main
    from ckptio.formats.deepspeed.zero import ZeroCheckpoint

    run_dir, tag, universal = runs["zero2"]
    loss = run_ranks(1, _to_ckptio, run_dir=str(tag), out=str(tmp_path / "ck"))[0]
    step = next(p for p in (tmp_path / "ck").iterdir() if p.name.startswith("epoch"))
    assert main(["convert", str(step), str(tmp_path / "uni"), "--to", "deepspeed-universal"]) == 0
    back = ZeroCheckpoint(tmp_path / "uni" / "global_step3_universal")
    try:  # what was written is DeepSpeed's state of step 3, read back bitwise
        for name in back.shapes:
            for what in MOMENTS:
                assert torch.equal(back.read(name, what).flatten(), _atomic(universal, name, what).flatten())
    finally:
        back.close()
    _ds(tmp_path / "run", "--stage", str(stage), "--load", str(tmp_path / "uni"), "--steps", "2", ranks=ranks)
    loaded = torch.load(tmp_path / "run" / "loaded.pt")
    assert loaded["first"] == 3 and loaded["lr"] == 0.0025  # the step and scheduler went through
    assert abs(loaded["losses"][0] - loss) < 1e-5 and loaded["losses"][1] < loaded["losses"][0]


# ---------------------------------------------------------------------------------------------- bad input
def _copy(runs, kind, tmp_path) -> Path:
    import shutil

    out = tmp_path / kind
    shutil.copytree(runs[kind][0], out)
    return out


def _open_all(path: Path) -> None:
    from ckptio.formats import registry

    fmt = registry.detect(path)
    opened = fmt.open(path)
    try:
        for key in opened.source.index():
            opened.source.read(key)
    finally:
        opened.close()
    _, moments = fmt.open_adam(path)
    try:
        for source in moments.values():
            for key in source.index():
                source.read(key)
    finally:
        for source in moments.values():
            source.close()


def test_a_missing_rank_file_is_named(runs, tmp_path):
    from ckptio import CheckpointCorruptError

    run = _copy(runs, "zero2", tmp_path)
    (run / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: missing"):
        _open_all(run)


def test_partitions_that_disagree_with_param_shapes_are_refused(runs, tmp_path):
    from ckptio import CheckpointCorruptError

    run = _copy(runs, "zero2", tmp_path)
    rel = run / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    obj = torch.load(rel, weights_only=False)  # the test's own fixture, written by DeepSpeed just now
    flat = obj["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    flat[0] = flat[0][:-8].clone()
    torch.save(obj, rel)
    with pytest.raises(CheckpointCorruptError, match=r"optim_states\.pt: the fp32 partitions of group 0 hold"):
        _open_all(run)


def test_a_pickle_naming_an_unknown_class_is_refused_by_name(runs, tmp_path):
    import zipfile

    from ckptio import CheckpointCorruptError

    run = _copy(runs, "zero2", tmp_path)
    rel = run / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(rel) as z:
        members = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in members if n.endswith("/data.pkl"))
    marker = tmp_path / "ran"
    members[name] = b"\x80\x02cdeepspeed.runtime.engine\nDeepSpeedEngine\n(V" + str(marker).encode() + b"\ntR."
    with zipfile.ZipFile(rel, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.raises(CheckpointCorruptError, match=r"optim_states\.pt.*deepspeed\.runtime\.engine\.DeepSpeedEngine"):
        _open_all(run)
    assert not marker.exists()  # the refusal comes from the gate, before anything is built


def test_a_truncated_file_and_a_flipped_tensor_byte_are_named(runs, tmp_path):
    from ckptio import CheckpointCorruptError

    run = _copy(runs, "zero2", tmp_path)
    rel = run / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = rel.read_bytes()
    rel.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt"):
        _open_all(run)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:  # inside the largest storage's bytes
        info = max(z.infolist(), key=lambda i: i.file_size)
    head = info.header_offset
    at = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
        int.from_bytes(data[head + 28:head + 30], "little") + info.file_size // 2
    rel.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    with pytest.raises(CheckpointCorruptError, match=r"optim_states\.pt: member .* CRC-32"):
        _open_all(run)


def test_a_latest_naming_no_checkpoint_and_unreadable_kinds_are_named(runs, tmp_path):
    from ckptio import CheckpointCorruptError, NoUsableCheckpointError

    run = _copy(runs, "zero2", tmp_path)
    (run / "latest").write_text("global_step9")
    with pytest.raises(CheckpointCorruptError, match=r"latest: names 'global_step9'"):
        _toy_manager(run)[0].restore()
    (run / "latest").write_text("x" * 300)  # no file can have that name: refused by the gate, not by the OS
    with pytest.raises(CheckpointCorruptError, match=r"longer than 255 bytes"):
        _toy_manager(run)[0].restore()
    other = tmp_path / "orbax"
    (other / "step_100").mkdir(parents=True)
    (other / "step_100" / "_CHECKPOINT_METADATA").write_text("{}")
    with pytest.raises(NoUsableCheckpointError, match=r"Orbax.*does not start from scratch"):
        _toy_manager(other)[0].restore()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _toy_manager(empty)[0].restore() is None  # an empty folder still starts fresh


def test_fuzz_family_smoke(runs):
    """A CI-sized run of the DeepSpeed fuzz family (the long run: ``fuzz_readers.py --family deepspeed``)."""
    sys.path.insert(0, str(HERE.parent / "tools"))
    import fuzz_readers

    tally = fuzz_readers.run(["deepspeed"], inputs=60, seed=3, verbose=True)["deepspeed"]
    failures = "\n".join(f"input {i}: {d} <- {'; '.join(n)}" for i, d, n in tally["failures"])
    assert tally["other"] == 0 and tally["harness"] == 0, failures
    assert tally["clean"] > 0 and tally["ok"] + tally["clean"] == 60


# ---------------------------------------------------------------------------------------------- issue 67
def test_a_checkpoint_folder_that_is_a_link_outside_is_refused_and_the_next_taken(runs, tmp_path, caplog):
    """Row 9: no ``latest``, the highest ``global_stepN`` (or an HF Trainer's ``checkpoint-N``) a link to a folder
    outside: refused by name, the newest real checkpoint taken; with nothing else, an error naming it."""
    import shutil

    from ckptio import NoUsableCheckpointError
    from ckptio.formats.deepspeed import layout

    run = _copy(runs, "zero2", tmp_path)
    for pointer in ("latest", "latest_universal"):  # ds_to_universal's pointer too: the highest global_stepN is taken
        (run / pointer).unlink(missing_ok=True)
    for universal in run.glob("global_step*_universal"):  # other tests' ds_to_universal copies: real tags too
        shutil.rmtree(universal)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(run / "global_step4", outside / "global_step4")  # step 4: what the link would resume
    (run / "global_step9").symlink_to(outside / "global_step4")
    with caplog.at_level("WARNING", logger="ckptio"):
        info = _toy_manager(run)[0].restore()
    assert info.step == 3 and info.counters["source_format"] == "deepspeed"
    assert any("global_step9: a symbolic link, refused" in r.getMessage() for r in caplog.records)

    hf = _copy(runs, "zero3", tmp_path)  # checkpoint-3/global_step3 and a config.json: an HF Trainer's output
    shutil.copytree(hf / "checkpoint-3", outside / "checkpoint-3")
    (hf / "checkpoint-9").symlink_to(outside / "checkpoint-3")
    assert layout.find_tag_dir(hf) == hf / "checkpoint-3" / "global_step3"

    only = tmp_path / "only"
    only.mkdir()
    (only / "global_step9").symlink_to(outside / "global_step4")
    with pytest.raises(NoUsableCheckpointError, match=r"global_step9.*symbolic link"):
        _toy_manager(only)[0].restore()


def test_rank_files_swapped_by_name_are_refused_by_name(runs, tmp_path):
    """Row 10: the two ranks' partition files of a ZeRO-2 run swapped: each file's ``param_slice_mappings`` says it
    holds the other rank's partition (before, the resume took them end to end in the wrong order, silently)."""
    from ckptio import CheckpointCorruptError

    run = _copy(runs, "zero2", tmp_path)
    tag = run / "global_step4"
    a, b = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    a.rename(tag / "swap")
    b.rename(a)
    (tag / "swap").rename(b)
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt: holds the "
                                                     r"partition of rank 1 .*swapped"):
        _toy_manager(run)[0].restore()


@pytest.fixture(scope="module")
def odd3(tmp_path_factory):
    """ZeRO-3 on 2 ranks (fp32) of the toy model 33 wide: its LayerNorms and second biases hold 33 elements, so each
    rank holds 17 of them and rank 1's last one is padding. With DeepSpeed's universal folder of step 3."""
    from fixture_cache import ds_run

    out = Path(shutil.copytree(ds_run("--stage", "3", "--hidden", "33"), tmp_path_factory.mktemp("ds-odd") / "zero3",
                               symlinks=True))  # the deepspeed fuzz family's ZeRO-3 run; copied: the universal folder
    return out, _universal(out / "global_step3")  # goes beside it


def _swap(tag: Path, kind: str) -> None:
    a, b = tag / f"zero_pp_rank_0_mp_rank_00_{kind}.pt", tag / f"zero_pp_rank_1_mp_rank_00_{kind}.pt"
    a.rename(tag / "swap")
    b.rename(a)
    (tag / "swap").rename(b)


def test_zero3_rank_files_swapped_by_name_are_refused_by_name(odd3, tmp_path):
    """Row 10 at stage 3: the two ranks' files (optimizer and model states) of a ZeRO-3 run swapped. Nothing a ZeRO-3
    file's pickle holds says its rank; what does is the padding: a parameter of ``numel`` elements is split in
    ``ceil(numel / N)`` per rank, and DeepSpeed keeps the gradients of the elements past its end zero, so Adam's
    ``exp_avg`` and ``exp_avg_sq`` are zero there in the files of the ranks that hold such padding. Rank 0's moments
    moved under rank 1's name are not zero where rank 1 pads: refused, by the file's name.

    What this cannot catch (docs/migrate-deepspeed.md): a run whose every trainable parameter divides evenly by the
    number of ranks (the tiny Llama on 2 ranks), a swap between ranks that hold no padding (ranks 0 and 1 of 4 when only
    rank 3 pads), a checkpoint without Adam's moments, and the model-states files alone (they differ only in
    ``frozen_param_fragments``, whose padding DeepSpeed does not zero). The unswapped folder resumes bitwise."""
    from ckptio import CheckpointCorruptError

    import shutil

    run_dir, universal = odd3
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for kind in ("optim_states", "model_states"):
        _swap(run / "global_step3", kind)
    with pytest.raises(CheckpointCorruptError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: .*not rank 1's "
                                                     r"partition.*swapped or renamed"):
        _toy_manager(run, hidden=33)[0].restore()
    assert run_ranks(1, _resume_and_compare, run_dir=str(run_dir), universal=str(universal), restore_from=None,
                     train_step=False, next_tag=None, hidden=33) == [3]


def _edit_run(run: Path, edit_meta=None, edit_groups=None) -> None:
    """Rewrite global_step4's files (the test's own fixture, written by DeepSpeed: a full load is fine here)."""
    tag = run / "global_step4"
    if edit_meta is not None:
        obj = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
        edit_meta(obj)
        torch.save(obj, tag / "mp_rank_00_model_states.pt")
    if edit_groups is not None:
        for rank in (0, 1):
            path = tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            obj = torch.load(path, weights_only=False)
            edit_groups(obj["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0])
            torch.save(obj, path)


DS_STATES = {
    "DeepSpeed's WarmupLR state": (dict(edit_meta=lambda o: o.__setitem__("lr_scheduler", {"last_batch_iteration": 4})),
                                   r"not the state of this run's StepLR"),
    "a scheduler state naming an optimizer": (
        dict(edit_meta=lambda o: o["lr_scheduler"].__setitem__("optimizer", "hijacked")), r"StepLR does not have"),
    "a step size of 0": (dict(edit_meta=lambda o: o["lr_scheduler"].__setitem__("step_size", 0)), r"ZeroDivisionError"),
    "an lr as text": (dict(edit_groups=lambda g: g.__setitem__("lr", "0.01")), r"'lr' is '0.01' \(a str"),
    "betas with a NaN": (dict(edit_groups=lambda g: g.__setitem__("betas", (float("nan"), 0.999))), r"not finite"),
}


@pytest.mark.parametrize("case", list(DS_STATES))
def test_deepspeed_scheduler_and_group_states_that_do_not_fit_are_refused(runs, tmp_path, case):
    """Row 11: refused by name before anything is applied (the WarmupLR state reported scheduler_restored=True with
    last_epoch left at 0; the others made the next step raise or the weights NaN)."""
    from ckptio import CheckpointError

    edits, message = DS_STATES[case]
    run = _copy(runs, "zero2", tmp_path)
    _edit_run(run, **edits)
    manager, model, opt, sched = _toy_manager(run)
    with pytest.raises(CheckpointError, match=message):
        manager.restore()
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.01 and not opt.state
