"""What a user meets when ckptio goes into their environment: light imports, a fast ``--help``, a clear
error naming the extra when an optional dependency is missing, a typed configuration that catches
misspellings, and managers that only restore staying light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import CheckpointConfig, CheckpointManager
from ckptio.errors import ConfigError

CKPTIO = str(Path(sys.executable).parent / "ckptio")
HEAVY = ("torch", "transformers", "peft", "safetensors", "numpy", "yaml")


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120)


def imported_modules(stderr: str) -> set[str]:
    """Top-level modules named in ``python -X importtime`` output."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_public_names_resolve_and_all_matches_the_exports():
    assert set(ckptio.__all__) == set(ckptio._EXPORTS) | {"__version__"}
    for name in ckptio.__all__:
        assert getattr(ckptio, name) is not None, name
    assert set(ckptio.__all__) <= set(dir(ckptio))
    with pytest.raises(AttributeError, match="no attribute 'Checkpointmanager'"):
        ckptio.Checkpointmanager  # noqa: B018


def test_import_ckptio_loads_no_heavy_dependency():
    out = python(f"""
        import sys, ckptio
        from ckptio import CheckpointConfig
        CheckpointConfig(checkpoint_dir="x", save_top_k=2, monitor="val_loss")
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import ckptio pulled in {out.stdout.strip()}"


@pytest.mark.parametrize("args", [["--help"], ["convert", "--help"], ["prune", "--help"], ["inspect"],
                                  ["prune", "/nonexistent", "--keep-latest", "0"], ["convert", "--to"]])
def test_help_and_argument_errors_do_not_import_torch(args):
    out = subprocess.run([sys.executable, "-X", "importtime", CKPTIO, *args], capture_output=True, text=True,
                         timeout=120)
    heavy = imported_modules(out.stderr) & set(HEAVY)
    assert not heavy, f"ckptio {' '.join(args)} imported {sorted(heavy)}"
    if args != ["--help"] and args[-1] != "--help":
        assert out.returncode == 2 and "error" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_optional_dependency_names_the_extra(tmp_path):
    # transformers made unimportable in a real interpreter, as in an environment without ckptio[hf]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = python(f"""
        import sys
        sys.modules["transformers"] = None
        from ckptio.errors import MissingDependencyError
        from ckptio.formats.training_state import parameter_order
        try:
            parameter_order(__import__("pathlib").Path({str(tmp_path / "config.json")!r}))
        except MissingDependencyError as exc:
            print("MDE", exc)
        except ModuleNotFoundError as exc:
            print("RAW", exc)""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MDE"), out.stdout
    assert "pip install 'ckptio[hf]'" in out.stdout and "transformers" in out.stdout


def test_a_gs_location_without_the_gcs_client_names_the_extra():
    out = python("""
        import sys
        sys.modules["google.cloud.storage"] = None
        from ckptio import CheckpointConfig
        from ckptio.errors import MissingDependencyError
        try:
            CheckpointConfig(checkpoint_dir="gs://bucket/run")
        except MissingDependencyError as exc:
            print("MDE", exc)
        except ImportError as exc:
            print("RAW", exc)""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MDE") and "pip install 'ckptio[gcs]'" in out.stdout, out.stdout
    assert "'google-cloud-storage'" in out.stdout, out.stdout


@pytest.mark.parametrize("module, hidden, extra", [("ckptio.accelerate", "accelerate", "ckptio[accelerate]"),
                                                  ("ckptio.hf_trainer", "accelerate", "ckptio[hf]"),
                                                  ("ckptio.hf_trainer", "transformers", "ckptio[hf]"),
                                                  ("ckptio.lightning", "pytorch_lightning", "ckptio[lightning]")])
def test_an_integration_without_its_framework_names_the_extra(module, hidden, extra):
    out = python(f"""
        import sys
        sys.modules[{hidden!r}] = None
        from ckptio.errors import MissingDependencyError
        try:
            __import__({module!r})
        except MissingDependencyError as exc:
            print("MDE", exc)
        except ImportError as exc:
            print("RAW", exc)""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MDE") and f"pip install '{extra}'" in out.stdout, out.stdout


def test_quantize_without_transformers_is_a_clear_cli_error(tmp_path):
    out = python(f"""
        import sys
        sys.modules["transformers"] = None
        from ckptio.cli import main
        sys.exit(main(["quantize", {str(tmp_path)!r}, {str(tmp_path / 'out.qnemo')!r}]))""")
    assert out.returncode == 2, out.stderr
    assert "ckptio[hf]" in out.stderr and "Traceback" not in out.stderr


def test_config_catches_misspelt_fields_and_values(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'save_top_k'"):
        CheckpointConfig(save_topk=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="did you mean 'model_save_format'"):
        CheckpointConfig(model_save_fromat="safetensors")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="model_save_format='safetensor'"):
        CheckpointConfig(model_save_format="safetensor")  # type: ignore[arg-type]
    cfg = CheckpointConfig(checkpoint_dir=tmp_path / "ckpts", restore_from=tmp_path / "ckpts" / "epoch_0_step_1")
    assert cfg.checkpoint_dir == str(tmp_path / "ckpts") and isinstance(cfg.restore_from, str)
    assert CheckpointConfig(save_consolidated="True").save_consolidated is True  # as the documents write it


def test_a_url_is_not_taken_for_a_local_folder(tmp_path, monkeypatch):
    """pathlib reads 'hdfs://bucket/run' as the relative folder 'hdfs:/bucket/run'; a location ckptio has no
    backend for must be refused, not written to (s3://, gs:// and az:// have one: tests/test_s3.py runs on each)."""
    monkeypatch.chdir(tmp_path)
    for key in ("checkpoint_dir", "restore_from"):
        with pytest.raises(ConfigError, match=rf"{key}='hdfs://bucket/run'.*hdfs:// locations are not supported"):
            CheckpointConfig(**{key: "hdfs://bucket/run"})
    with pytest.raises(ConfigError, match=r"restore_from='s3:///run'.*no bucket name"):
        CheckpointConfig(restore_from="s3:///run")  # an s3:// location is parsed (and restored: test_s3.py)
    with pytest.raises(ConfigError, match=r"checkpoint_dir='gs://b/a/\.\./c'.*plain names"):
        CheckpointConfig(checkpoint_dir="gs://b/a/../c")  # so is a gs:// one
    with pytest.raises(ConfigError, match=r"checkpoint_dir='az://c/a/\.\./c'.*plain names"):
        CheckpointConfig(checkpoint_dir="az://c/a/../c")  # and an az:// (abfs://) one
    with pytest.raises(ConfigError, match=r"restore_from='abfs://c@acct.example.com/run'.*<account>.dfs.core"):
        CheckpointConfig(restore_from="abfs://c@acct.example.com/run")  # as fsspec: the account's host, or none
    for form in ("abfs://c@acct.dfs.core.windows.net/run", "az://c@acct.blob.core.windows.net/run"):
        assert CheckpointConfig(restore_from=form).restore_from == form
    assert CheckpointConfig(checkpoint_dir="abfs://c/run").checkpoint_dir == "abfs://c/run"
    assert not any((tmp_path / scheme).exists() for scheme in ("hdfs:", "gs:", "az:", "abfs:"))


def test_an_az_location_without_the_azure_client_names_the_extra():
    out = python("""
        import sys
        sys.modules["azure.storage.blob"] = None
        from ckptio import CheckpointConfig
        from ckptio.errors import MissingDependencyError
        try:
            CheckpointConfig(checkpoint_dir="az://container/run")
        except MissingDependencyError as exc:
            print("MDE", exc)
        except ImportError as exc:
            print("RAW", exc)""")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MDE") and "pip install 'ckptio[azure]'" in out.stdout, out.stdout
    assert "'azure-storage-blob'" in out.stdout, out.stdout


def test_a_restore_only_manager_starts_no_thread_and_no_process_group(tmp_path):
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path, async_save=True), model=model) as mgr:
        mgr.save(step=1)
        mgr.wait()
    before = {t.ident for t in threading.enumerate()}
    with CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path, async_save=True), model=model) as mgr:
        assert mgr.restore() is not None
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not started, f"restoring started threads {started}"
        assert not torch.distributed.is_initialized()


def test_a_second_manager_in_the_same_process_works_and_another_process_is_refused(tmp_path):
    model = torch.nn.Linear(4, 4)
    first = CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path), model=model)
    first.save(step=1)
    second = CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path), model=model)  # a notebook cell re-run
    second.save(step=2)
    out = python(f"""
        import torch
        from ckptio import CheckpointConfig, CheckpointManager
        from ckptio.storage.lock import CheckpointDirLocked
        mgr = CheckpointManager(CheckpointConfig(checkpoint_dir={str(tmp_path)!r}), model=torch.nn.Linear(4, 4))
        try:
            mgr.save(step=3)
        except CheckpointDirLocked as exc:
            print("refused:", exc)""")
    assert "refused:" in out.stdout and "in use by pid" in out.stdout, out.stdout + out.stderr
    first.close()
    second.save(step=4)  # still held by the second manager
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("epoch")) == [
        "epoch_0_step_1", "epoch_0_step_2", "epoch_0_step_4"]


MYPY = Path(sys.executable).parent / "mypy"


@pytest.mark.slow  # mypy over the whole package and what it imports (torch): minutes, the first time
@pytest.mark.timeout(1800)  # a cold cache on a loaded machine: over 10 minutes for the two runs
@pytest.mark.skipif(not MYPY.exists(), reason="mypy is not installed (it is part of ckptio[test])")
def test_sources_type_check_and_users_get_the_option_types(tmp_path):
    # mypy's own incremental cache, kept beside the other caches of the suite (~/.cache, CKPTIO_MYPY_CACHE moves it)
    # so that a fresh clone reuses it: mypy re-checks what changed (by content) and what depends on it, and the next
    # run of the suite does not analyse torch again (~100 s -> ~6 s here)
    root = Path(__file__).resolve().parents[1]
    cache = Path(os.environ.get("CKPTIO_MYPY_CACHE", Path.home() / ".cache" / "ckptio-mypy"))
    out = subprocess.run([str(MYPY), "--cache-dir", str(cache)], cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:]
    # a user's script: ckptio ships py.typed, so a misspelt option value is caught before anything runs
    user = tmp_path / "train.py"
    user.write_text(textwrap.dedent("""
        from pathlib import Path
        from ckptio import CheckpointConfig
        good = CheckpointConfig(checkpoint_dir=Path("ckpts"), model_save_format="torch_save", verify="size")
        bad = CheckpointConfig(model_save_format="safetensor")
        """))
    out = subprocess.run([str(MYPY), "--cache-dir", str(cache / "user-script"), str(user)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "train.py:5" in errors[0] and "safetensor" in errors[0], out.stdout
    assert (Path(ckptio.__file__).parent / "py.typed").is_file()
