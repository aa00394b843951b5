""".nemo archives: save/restore on 1 and 2 ranks, the system tar round trip, artifacts, CLI, hostile input."""

from __future__ import annotations

import shutil
import subprocess
import tarfile

import pytest
import torch
import yaml

from ckptio import CheckpointError, restore_nemo, save_nemo
from ckptio.formats.nemo import format as nemo
from cli_here import ckptio_here
from distributed import run_ranks



def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_save_and_restore_with_tokenizer_and_artifacts(tmp_path):
    from toy import make_model, make_tokenizer

    model, tok = make_model(seed=3), make_tokenizer()
    notes = tmp_path / "notes.txt"
    notes.write_text("trained on the builtin corpus\n")
    out = save_nemo(tmp_path / "m.nemo", model, tokenizer=tok, artifacts={"notes.txt": notes},
                    config={"trainer": {"max_steps": 5}})
    assert tarfile.is_tarfile(out)
    with tarfile.open(out) as tar:  # plain, uncompressed tar with NeMo's ./ member names
        names = tar.getnames()
    assert "./model_config.yaml" in names and "./model_weights.ckpt" in names and "./tokenizer.json" in names
    work = tmp_path / "work"
    work.mkdir()
    restored = restore_nemo(out, workdir=work)  # the model is built from the archive's own config
    try:
        assert type(restored.model).__name__ == type(model).__name__ and restored.weights_format == "ckpt"
        _same(_weights(restored.model), _weights(model))
        assert restored.config["trainer"] == {"max_steps": 5}
        assert restored.artifacts["notes.txt"].read_text() == "trained on the builtin corpus\n"
        assert restored.tokenizer()("hello").input_ids == tok("hello").input_ids
    finally:
        restored.cleanup()
    assert not restored.folder.exists() and not any(work.iterdir())  # nothing of the unpacking stays


def test_system_tar_round_trip_and_a_hand_swapped_artifact(tmp_path):
    from toy import make_model

    model = make_model(seed=4)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\n")
    save_nemo(tmp_path / "model.nemo", model, artifacts={"vocab.txt": vocab})
    d = tmp_path / "d"
    d.mkdir()
    subprocess.run(["tar", "xf", str(tmp_path / "model.nemo"), "-C", str(d)], check=True)
    (d / "vocab.txt").write_text("x\ny\nz\n")  # swapped by hand
    subprocess.run(f"cd {d} && tar cf ../model2.nemo *", shell=True, check=True)
    fresh = make_model(seed=99)
    restored = restore_nemo(tmp_path / "model2.nemo", fresh)
    try:
        _same(_weights(fresh), _weights(model))
        assert restored.artifacts["vocab.txt"].read_text() == "x\ny\nz\n"
    finally:
        restored.cleanup()
    # gzip is accepted when reading
    subprocess.run(f"cd {d} && tar czf ../model3.nemo *", shell=True, check=True)
    restored = restore_nemo(tmp_path / "model3.nemo", make_model(seed=98))
    _same(_weights(restored.model), _weights(model))
    restored.cleanup()


def test_cli_pack_unpack_inspect(tmp_path):
    from toy import make_model

    model = make_model(seed=5)
    save_nemo(tmp_path / "a.nemo", model, sharded=True)
    out = ckptio_here("nemo", "unpack", str(tmp_path / "a.nemo"), str(tmp_path / "u"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "u" / "model_weights" / ".metadata").is_file()
    out = ckptio_here("nemo", "pack", str(tmp_path / "u"), str(tmp_path / "b.nemo"))
    assert out.returncode == 0, out.stderr
    out = ckptio_here("inspect", str(tmp_path / "b.nemo"))
    assert out.returncode == 0, out.stderr
    assert "model_weights/ (DCP)" in out.stdout and "LlamaForCausalLM" in out.stdout
    restored = restore_nemo(tmp_path / "b.nemo", make_model(seed=0))
    _same(_weights(restored.model), _weights(model))
    restored.cleanup()
    # a folder that is not a .nemo layout is refused by pack, naming what is missing
    (tmp_path / "u" / "model_config.yaml").unlink()
    out = ckptio_here("nemo", "pack", str(tmp_path / "u"), str(tmp_path / "c.nemo"))
    assert out.returncode == 2 and "model_config.yaml is missing" in out.stderr
    assert not (tmp_path / "c.nemo").exists()


def test_bad_archives_are_refused_with_the_file_named(tmp_path):
    from toy import make_model

    model = make_model(seed=6)
    good = save_nemo(tmp_path / "g.nemo", model)
    d = nemo.unpack(good, tmp_path / "d")
    # a config that refers to a missing artifact
    cfg = yaml.safe_load((d / "model_config.yaml").read_text())
    cfg["tokenizer"] = {"files": {"tokenizer.json": "nemo:tokenizer.json"}}
    (d / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        nemo.pack(d, tmp_path / "x.nemo")
    # a reference that climbs out of the archive
    cfg["tokenizer"] = {"files": {"t": "nemo:../../etc/passwd"}}
    (d / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match=r"tokenizer\.files\.t: file path '\.\./\.\./etc/passwd' must not"):
        restore_nemo(d, make_model())
    # weights of another model
    cfg.pop("tokenizer")
    (d / "model_config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CheckpointError, match="does not match"):
        restore_nemo(d, make_model(hidden_size=48, intermediate_size=64))
    # a truncated archive
    data = good.read_bytes()
    (tmp_path / "t.nemo").write_bytes(data[: len(data) // 2])
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(CheckpointError, match="t.nemo"):
        restore_nemo(tmp_path / "t.nemo", make_model(), workdir=work)
    # a hostile member path
    with tarfile.open(tmp_path / "h.nemo", "w") as tar:
        tar.add(d / "model_config.yaml", arcname="../evil.yaml")
    with pytest.raises(CheckpointError, match=r"h\.nemo: member '\.\./evil\.yaml' is refused"):
        restore_nemo(tmp_path / "h.nemo", make_model(), workdir=work)
    assert not (tmp_path.parent / "evil.yaml").exists()
    assert not list(work.iterdir()), "a refused archive left its unpacking folder behind"
    # a pickle that would run code inside model_weights.ckpt
    shutil.rmtree(d / "model_weights", ignore_errors=True)
    (d / "model_weights.ckpt").write_bytes(b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.")
    with pytest.raises(CheckpointError, match="model_weights.ckpt"):
        restore_nemo(d, make_model())


def _save_two_ranks(root: str) -> dict:
    from toy import full_state, make_model

    model = make_model(seed=7)  # FSDP2-sharded on 2 ranks by toy.make_model
    save_nemo(f"{root}/sharded.nemo", model, tokenizer=None)
    save_nemo(f"{root}/gathered.nemo", model, sharded=False)
    return full_state(model)


def _restore_on(root: str, name: str) -> dict:
    from toy import full_state, make_model

    restored = restore_nemo(f"{root}/{name}", make_model(seed=0))
    restored.cleanup()
    return {"state": full_state(restored.model), "format": restored.weights_format}


@pytest.mark.slow
def test_two_ranks_save_and_reshard_on_restore(tmp_path):
    root = str(tmp_path)
    ref = run_ranks(2, _save_two_ranks, root=root)[0]
    for name, fmt, worlds in (("sharded.nemo", "dcp", (1, 2)), ("gathered.nemo", "ckpt", (2,))):
        for world in worlds:
            got = run_ranks(world, _restore_on, root=root, name=name)[0]
            assert got["format"] == fmt
            for key, value in ref.items():
                assert torch.equal(got["state"][key], value), f"{name} on {world} rank(s): {key}"
