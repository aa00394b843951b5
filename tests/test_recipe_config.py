"""The recipe's configuration (examples/llm/recipe_config.py, built on jsonargparse): --help lists every key
with its type and default, --print_config dumps YAML that reads back to the same config, the AutoModel
`checkpoint:` section is accepted as written, and mistakes name the key."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "llm"))

from recipe_config import RecipeConfig, RecipeConfigError, load_config, to_dict  # noqa: E402

from ckptio import CheckpointConfig  # noqa: E402
from ckptio.errors import ConfigError  # noqa: E402

YAML = str(ROOT / "examples" / "llm" / "tiny_llama.yaml")


def _every_key(cls: type, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += _every_key(type(default), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", default))
    return out


def test_help_lists_every_key_with_its_type_and_default(capsys):
    with pytest.raises(SystemExit) as done:
        load_config(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    keys = [key for key, _ in _every_key(RecipeConfig)]
    for key in keys:
        assert f"--{key} " in text, f"--help does not list {key}"
        entry = text.rsplit(f"--{key} ", 1)[1].split(f" --{key}+", 1)[-1]  # the option's entry, after the usage
        entry = entry[:min([entry.find(f" --{k} ") for k in keys if f" --{k} " in entry] + [len(entry)])]
        assert "(type: " in entry and "default: " in entry, f"--help gives no type and default for {key}: {entry!r}"
    assert "(type: Literal['safetensors', 'torch_save'], default: safetensors)" in text  # model_save_format
    assert "--checkpoint.save_top_k SAVE_TOP_K Keep the k best by monitor (the k" in text  # from the field's docstring


def test_print_config_is_the_effective_yaml_and_reads_back(tmp_path, capsys):
    argv = ["--config", YAML, "--checkpoint.save_top_k", "2", "--checkpoint.monitor", "val_loss",
            "--optimizer.lr", "1e-3", "--peft.target_modules", "[q_proj, k_proj]"]
    with pytest.raises(SystemExit) as done:
        load_config(argv + ["--print_config"])
    assert done.value.code == 0
    dumped = capsys.readouterr().out
    assert "save_top_k: 2" in dumped and "monitor: val_loss" in dumped and "save_consolidated: final" in dumped
    (tmp_path / "effective.yaml").write_text(dumped)
    assert to_dict(load_config(["--config", str(tmp_path / "effective.yaml")])) == to_dict(load_config(argv))


@pytest.mark.parametrize("value,expected", [("true", True), ("True", True), ("false", False), ("final", "final"),
                                            ("every", True), ("False", False)])
def test_the_automodel_checkpoint_section_is_accepted_as_written(tmp_path, value, expected):
    (tmp_path / "automodel.yaml").write_text(f"""
checkpoint:
  enabled: true
  checkpoint_dir: checkpoints/
  model_save_format: safetensors # Format for saving (torch_save or safetensors)
  save_consolidated: {value} # Change to false if you want to save sharded checkpoints.
""")
    cfg = load_config(["--config", str(tmp_path / "automodel.yaml")])
    assert isinstance(cfg.checkpoint, CheckpointConfig)
    assert cfg.checkpoint.save_consolidated == expected and cfg.checkpoint.checkpoint_dir == "checkpoints/"
    # and the same value as a command-line override, as the AutoModel docs write it
    over = load_config(["--checkpoint.model_save_format", "torch_save", "--checkpoint.save_consolidated", value])
    assert over.checkpoint.save_consolidated == expected and over.checkpoint.model_save_format == "torch_save"


@pytest.mark.parametrize("argv,messages", [
    (["--checkpoint.save_topk", "3"], ["checkpoint.save_topk", "did you mean 'checkpoint.save_top_k'"]),
    (["--step_scheduler.max_step", "3"], ["did you mean 'step_scheduler.max_steps'"]),  # no prefix matching
    (["--optimizer.lr", "fast"], ['"optimizer.lr"', "float"]),
    (["--checkpoint.model_save_format", "safetensor"], ['"checkpoint.model_save_format"', "safetensor"]),
    (["--checkpoint.verify", "sometimes"], ['"checkpoint.verify"']),
    (["--checkpoint.keep_latest", "0"], ["checkpoint: keep_latest must be a positive integer"]),
    (["--data.batch_size", "8.5"], ['"data.batch_size"']),
])
def test_mistakes_name_the_key(argv, messages):
    with pytest.raises(RecipeConfigError) as err:
        load_config(argv)
    assert all(m in str(err.value) for m in messages), str(err.value)


def test_a_misspelt_key_in_the_yaml_file_is_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("checkpoint:\n  save_topk: 3\n")
    with pytest.raises(RecipeConfigError, match="save_topk.*did you mean 'checkpoint.save_top_k'"):
        load_config(["--config", str(tmp_path / "bad.yaml")])


def test_overrides_apply_in_order_after_the_file():
    cfg = load_config(["--config", YAML, "--step_scheduler.max_steps", "7", "--checkpoint.checkpoint_dir", "/tmp/x",
                       "--checkpoint.restore_from", "null", "--optimizer.lr=2"])
    assert cfg.step_scheduler.max_steps == 7 and cfg.checkpoint.checkpoint_dir == "/tmp/x"
    assert cfg.checkpoint.restore_from is None and cfg.optimizer.lr == 2.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.hidden_size == 64  # from the file


def test_automodels_other_checkpoint_keys_mean_what_they_mean_there(tmp_path):
    """``max_recent_checkpoints``, ``best_metric_key`` and ``is_async`` are AutoModel's names for ckptio's
    ``keep_latest``, ``monitor`` and ``async_save``; keys with no ckptio meaning are refused with the reason."""
    (tmp_path / "am.yaml").write_text("""
checkpoint:
  checkpoint_dir: checkpoints/
  save_consolidated: every
  max_recent_checkpoints: 2
  best_metric_key: val_loss
  is_async: true
""")
    c = load_config(["--config", str(tmp_path / "am.yaml")]).checkpoint
    assert (c.save_consolidated, c.keep_latest, c.monitor, c.mode, c.async_save) == (True, 2, "val_loss", "min", True)
    assert c.retention_policy().keep_latest == 2
    (tmp_path / "hub.yaml").write_text("checkpoint:\n  model_repo_id: meta-llama/Llama-3.2-1B\n")
    with pytest.raises(RecipeConfigError, match="checkpoint.model_repo_id: NeMo AutoModel's key has no meaning in ckptio"):
        load_config(["--config", str(tmp_path / "hub.yaml")])
    with pytest.raises(ConfigError, match="allow_legacy_pickle_restore.*never unpickles"):
        CheckpointConfig(allow_legacy_pickle_restore=True)
    with pytest.raises(ConfigError, match="contradicts keep_latest=3"):
        CheckpointConfig(keep_latest=3, max_recent_checkpoints=2)
    with pytest.raises(ConfigError, match="save_consolidated must be false, 'final', 'every'"):
        CheckpointConfig(save_consolidated="sometimes")


def test_io_threads_default_leaves_each_writing_stream_a_core(monkeypatch):
    """``io_threads: null`` writes with two streams per rank only when the rank has two cores of its own: on a
    node whose cores are all taken by ranks (torchrun's LOCAL_WORLD_SIZE), a second stream only competes."""
    import os

    from ckptio import CheckpointConfig
    from ckptio.errors import ConfigError

    assert CheckpointConfig(checkpoint_dir="c", io_threads=3).io_thread_count() == 3
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # one core per rank
    assert CheckpointConfig(checkpoint_dir="c").io_thread_count() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert CheckpointConfig(checkpoint_dir="c").io_thread_count() == (2 if cores >= 2 else 1)
    with pytest.raises(ConfigError, match="io_threads must be null"):
        CheckpointConfig(checkpoint_dir="c", io_threads=0)


def test_the_recipes_help_is_plain_text_and_imports_neither_torch_nor_transformers():
    """Issue 71, row 13: ``python examples/llm/finetune.py --help`` took 4.5 s and showed reStructuredText
    (````None````, ``:meth:`~ckptio.CheckpointManager.maybe_save```). Run as the user runs it; what it imported
    comes from ``-X importtime`` (timings on a shared machine would be flaky)."""
    import os
    import subprocess

    out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "examples" / "llm" / "finetune.py"), "--help"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "transformers", "numpy"} & imported, sorted(imported & {"torch", "transformers", "numpy"})
    text = " ".join(out.stdout.split())
    assert "`" not in text and ":meth:" not in text and ":class:" not in text, text
    assert "With maybe_save: a durable save (to checkpoint_dir)" in text  # :meth:`~ckptio.CheckpointManager.maybe_save`
    assert "--step_scheduler.ckpt_every_steps" in text and "--checkpoint.save_top_k" in text


@pytest.mark.parametrize("rst,text", [
    ("``None``: never", "None: never"),
    (":meth:`~ckptio.CheckpointManager.maybe_save` saves", "maybe_save saves"),
    (":class:`ckptio.CheckpointManager`", "ckptio.CheckpointManager"),
    (":attr:`the interval <io_threads>`", "the interval"),
    ("`jsonargparse <https://jsonargparse.readthedocs.io>`_ turns", "jsonargparse (https://jsonargparse.readthedocs.io) turns"),
    ("`x` and ``y``", "x and y"),
])
def test_help_texts_lose_their_markup(rst, text):
    from recipe_config import plain

    assert plain(rst) == text
