"""The fine-tuning recipe run as a user runs it, one process or on several ranks, preempted and resumed.

Every run is a process of its own: forked from the tests' preloaded server with the environment ``python`` or
``torchrun`` gives it (``forked_scripts``), and, for the 2-rank background-save case and the bad overrides, a new
interpreter under the real ``torchrun`` (SIGTERM through torchrun's agent included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from distributed import START, launch
from forked_scripts import start as start_script

pytestmark = pytest.mark.slow  # multi-process: left out of the quick loop (-m 'not slow')

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "examples" / "llm" / "finetune.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
MAX = 40


def _config(config: str) -> str:
    return str(ROOT / "examples" / "llm" / config)


def start(world: int, config: str, *overrides: str, real: bool = False, cwd: Path | None = None,
          env: dict | None = None) -> Any:
    """The recipe started as ``python`` (``world == 1``) or ``torchrun`` would start it: forked from the tests'
    preloaded server with torchrun's environment, which skips ~7 s of imports a process, or with ``real`` a new
    interpreter under the real ``torchrun`` (``forked_scripts.start``). Its output: stdout and stderr together."""
    return start_script(RECIPE, "--config", _config(config), *overrides, ranks=world, cwd=str(cwd) if cwd else None,
                        env=env or ENV, merged=True, real=real or START != "forkserver")


def run(world: int, config: str, *overrides: str, real: bool = False, timeout: float = 300, cwd: Path | None = None,
        env: dict | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    """The recipe run to its end (see :func:`start`), its output captured (stdout and stderr apart)."""
    out = launch(RECIPE, "--config", _config(config), *overrides, ranks=world, timeout=timeout,
                 cwd=str(cwd) if cwd else None, env=env or ENV, real=real)
    if ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def run_preempted(world: int, config: str, *overrides: str, after: str, real: bool = False, timeout: float = 300,
                  cwd: Path | None = None) -> str:
    """Start the recipe, send SIGTERM once ``after`` appears in its output, return the whole output."""
    job = start(world, config, *overrides, real=real, cwd=cwd)
    lines = []
    deadline = time.monotonic() + timeout
    sent = False
    for line in job.lines(timeout):
        lines.append(line)
        if not sent and after in line:
            job.signal(signal.SIGTERM)  # the whole job, as a scheduler preempts it
            sent = True
        assert time.monotonic() < deadline, "preempted run took too long"
    done = job.wait(60)
    code, text = done.returncode, "".join(lines) + done.stdout
    # torchrun's own agent turns the SIGTERM it received into an error exit after its workers stopped
    # cleanly; a plain python run must exit 0.
    launcher_only = real and world > 1 and "SignalException" in text and "ChildFailedError" not in text
    assert code == 0 or launcher_only, text[-4000:]
    assert sent, "the run ended before it could be preempted"
    return text


def losses(log_file: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in log_file.read_text().splitlines():
        rec = json.loads(line)
        assert rec["step"] not in out, f"step {rec['step']} ran twice"
        out[rec["step"]] = rec["loss"]
    return out


def final_weights(step_dir: Path, peft: bool) -> dict[str, torch.Tensor]:
    if peft:
        return load_file(step_dir / "model" / "adapter_model.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((step_dir / "model" / "consolidated").glob("model-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


CASES = [
    pytest.param(1, "tiny_llama.yaml", "safetensors", False, id="1rank-safetensors"),
    pytest.param(2, "tiny_llama.yaml", "torch_save", True, id="2ranks-dcp-async"),
    pytest.param(1, "tiny_llama_peft.yaml", "safetensors", False, id="1rank-peft"),
    pytest.param(2, "tiny_llama_peft.yaml", "safetensors", False, id="2ranks-peft"),
]


@pytest.mark.parametrize("world,config,fmt,async_save", CASES)
def test_preempted_and_resumed_run_equals_uninterrupted(tmp_path, world, config, fmt, async_save):
    peft = "peft" in config

    def overrides(name: str) -> list[str]:
        return ["--checkpoint.checkpoint_dir", str(tmp_path / name), "--checkpoint.model_save_format", fmt,
                "--step_scheduler.max_steps", str(MAX), "--step_scheduler.ckpt_every_steps", "4",
                "--step_scheduler.val_every_steps", "8", "--log_file", str(tmp_path / f"{name}.jsonl"),
                "--data.num_sentences", "600", "--checkpoint.save_consolidated", "final",
                "--checkpoint.async_save", str(async_save).lower()]

    real = world == 2 and async_save  # one case under a new interpreter and the real torchrun
    straight = run(world, config, *overrides("straight"), real=real)
    assert "Loading checkpoint" not in straight.stdout
    first = run_preempted(world, config, *overrides("resumed"), after="Saved checkpoint", real=real)
    assert "SIGTERM received: saved step" in first
    second = run(world, config, *overrides("resumed"), real=real)
    assert "Loading checkpoint from" in second.stdout and "Resumed at step" in second.stdout

    want, got = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(got) == list(range(1, MAX + 1)), "a step was skipped or repeated"
    assert got == want, "losses after the resume differ from the uninterrupted run"
    final = (tmp_path / "straight" / "LATEST").resolve().name
    assert final.endswith(f"_step_{MAX}") and (tmp_path / "resumed" / "LATEST").resolve().name == final
    a = final_weights(tmp_path / "straight" / final, peft)
    b = final_weights(tmp_path / "resumed" / final, peft)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    manifest = json.loads((tmp_path / "resumed" / final / "manifest.json").read_text())
    assert "best" in manifest["states"] and "stats" not in manifest["states"]  # attributes with state_dict only
    assert manifest["metrics"]["val_loss"] > 0


def test_overrides_reach_the_config(tmp_path):
    out = run(1, "tiny_llama.yaml", "--step_scheduler.max_steps", "3", "--step_scheduler.ckpt_every_steps",
                      "3", "--checkpoint.checkpoint_dir", str(tmp_path / "c"), "--checkpoint.name_template",
                      "ck_{step}", "--checkpoint.auto_insert_field_names", "false",
                      "--optimizer.lr=0.0005", "--data.num_sentences", "300",
                      "--checkpoint.save_consolidated", "false")
    config = json.loads(out.stdout.split("Config: ", 1)[1].splitlines()[0])
    assert config["optimizer"]["lr"] == 0.0005 and config["step_scheduler"]["max_steps"] == 3
    assert config["checkpoint"]["save_consolidated"] is False
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")) == ["LATEST", "ck_3"]


@pytest.mark.parametrize("override,messages", [
    (["--step_scheduler.max_step", "3"], ["--step_scheduler.max_step", "did you mean 'step_scheduler.max_steps'"]),
    (["--optimizer.lr", "fast"], ['"optimizer.lr"', "float", "fast"]),
    (["--checkpoint.model_save_format", "pickle"], ['"checkpoint.model_save_format"', "pickle"]),
    (["--checkpoint.save_consolidated", "sometimes"], ["save_consolidated", "sometimes"]),
    (["--checkpoint.keep_latest", "0"], ["checkpoint: keep_latest must be a positive integer"]),
    # issue 71, row 8: this trained 20 steps, then died ("the first save() was passed no metrics")
    (["--step_scheduler.ckpt_every_steps", "20", "--checkpoint.save_top_k", "1", "--checkpoint.monitor", "val_loss",
      "--step_scheduler.val_every_steps", "25"],
     ["step_scheduler.ckpt_every_steps=20 is not a multiple of step_scheduler.val_every_steps=25",
      "checkpoint.monitor='val_loss'", "docs/recipe.md"]),
    (["--checkpoint.monitor", "val_loss", "--step_scheduler.val_every_steps", "null"],
     ["checkpoint.monitor='val_loss'", "step_scheduler.val_every_steps is null"]),
    (["--checkpoint.monitor", "val_acc"], ["checkpoint.monitor='val_acc'", "computes val_loss only"]),
])
def test_bad_overrides_are_refused_with_the_key(override, messages):
    out = run(1, "tiny_llama.yaml", *override, real=True, timeout=120, ok=False)
    assert out.returncode == 2 and all(m in out.stderr for m in messages), out.stderr
    assert "Traceback" not in out.stderr


def test_a_run_preempted_before_its_first_validation_saves_a_ranked_checkpoint(tmp_path):
    """Issue 71, row 8: with ``checkpoint.monitor`` set, a SIGTERM before the first validation step made the
    preemption save the run's first, without metrics: refused, nothing saved. It validates, saves and stops."""
    out = run_preempted(1, "tiny_llama.yaml", "--checkpoint.checkpoint_dir", str(tmp_path / "c"),
                        "--checkpoint.save_top_k", "1", "--checkpoint.monitor", "val_loss",
                        "--data.num_sentences", "600", after="step     1/")
    assert "SIGTERM received: saved step" in out and "val_loss" in out, out[-3000:]
    best = json.loads(((tmp_path / "c" / "BEST").resolve() / "manifest.json").read_text())
    assert best["metrics"]["val_loss"] > 0 and best["step"] < 25


@pytest.mark.parametrize("where", ["ck", "ck/run1"])
def test_a_read_only_checkpoint_dir_is_refused_before_training(tmp_path, where):
    """Issue 71, row 10: the recipe said "No checkpoint found … starting from scratch", trained, and its first save
    failed on the lock file. The folder (or the one it would be made in) is named before anything is built."""
    import sys

    from readonly import read_only

    (tmp_path / "ck").mkdir()
    argv = [sys.executable, RECIPE, "--config", _config("tiny_llama.yaml"), "--checkpoint.checkpoint_dir",
            str(tmp_path / where), "--step_scheduler.max_steps", "3", "--data.num_sentences", "300"]
    with read_only(tmp_path / "ck", argv) as argv:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"finetune.py: error: checkpoint_dir={str(tmp_path / where)!r} is not writable" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "step " not in out.stdout and "Starting fresh" not in out.stdout


def test_start_from_a_pretrained_folder_on_two_ranks(tmp_path):
    first = ["--checkpoint.checkpoint_dir", str(tmp_path / "a"), "--step_scheduler.max_steps", "30",
             "--checkpoint.save_consolidated", "final", "--data.num_sentences", "600",
             "--log_file", str(tmp_path / "a.jsonl")]
    run(1, "tiny_llama.yaml", *first)
    bundle = (tmp_path / "a" / "LATEST").resolve() / "model" / "consolidated"
    second = ["--model.pretrained_path", str(bundle), "--checkpoint.checkpoint_dir", str(tmp_path / "b"),
              "--step_scheduler.max_steps", "2", "--data.num_sentences", "600", "--log_file", str(tmp_path / "b.jsonl")]
    out = run(2, "from_pretrained.yaml", *second)
    assert f"Loaded pretrained weights from {bundle}" in out.stdout
    trained, fresh = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    # it continues from the trained weights (built on meta, FSDP2-sharded, each rank reading its slices)
    assert fresh[1] < trained[1] - 1.0 and abs(fresh[1] - trained[30]) < 0.5
    # LoRA on top of the same folder: the frozen base comes from it (peft key names mapped back)
    lora = ["--model.pretrained_path", str(bundle), "--checkpoint.checkpoint_dir", str(tmp_path / "c"),
            "--step_scheduler.max_steps", "2", "--data.num_sentences", "600", "--log_file", str(tmp_path / "c.jsonl")]
    out = run(1, "tiny_llama_peft.yaml", *lora)
    assert f"Loaded pretrained weights from {bundle}" in out.stdout
    assert abs(losses(tmp_path / "c.jsonl")[1] - trained[30]) < 0.5


@pytest.mark.slow
def test_the_recipe_checkpoints_to_a_bucket_and_resumes_from_it(tmp_path):
    """``--checkpoint.checkpoint_dir s3://…``: preempted and resumed through a bucket (the real S3 server on
    127.0.0.1), with the same losses as an uninterrupted run to a local folder."""
    import s3server

    proc, url = s3server.start()
    try:
        ENV.update({"AWS_ENDPOINT_URL": url, **s3server.ENV})
        import boto3

        boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket="recipe")

        def overrides(where: str, name: str) -> list[str]:
            return ["--checkpoint.checkpoint_dir", where, "--step_scheduler.max_steps", "24",
                    "--step_scheduler.ckpt_every_steps", "4", "--step_scheduler.val_every_steps", "8",
                    "--log_file", str(tmp_path / f"{name}.jsonl"), "--data.num_sentences", "600"]

        work = tmp_path / "cwd"  # the runs' working directory: a URL read as a path would show up here
        work.mkdir()
        ENV["XDG_CACHE_HOME"] = str(tmp_path / "cache")
        run(1, "tiny_llama.yaml", *overrides(str(tmp_path / "straight"), "straight"))
        first = run_preempted(1, "tiny_llama.yaml", *overrides("s3://recipe/run", "resumed"), after="Saved checkpoint",
                              cwd=work)
        assert "SIGTERM received: saved step" in first
        second = run(1, "tiny_llama.yaml", *overrides("s3://recipe/run", "resumed"), cwd=work)
        assert "Loading checkpoint from s3://recipe/run/" in second.stdout
        want, got = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "resumed.jsonl")
        assert sorted(got) == list(range(1, 25)) and got == want
        assert list(work.iterdir()) == [] and not (ROOT / "s3:").exists()
        # the run's assets went to the local cache, under a name made from the URL
        assert (tmp_path / "cache" / "ckptio" / "recipe" / "s3_recipe_run" / "tokenizer" / "tokenizer.json").is_file()

        # a store that cannot be reached: a clear error, and still no local folder made from the URL
        ENV["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
        out = run(1, "tiny_llama.yaml", *overrides("s3://recipe/elsewhere", "unreachable"), cwd=work, ok=False)
        assert out.returncode == 1 and "finetune.py: error: listing s3://recipe/elsewhere" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        assert list(work.iterdir()) == [] and not (ROOT / "s3:").exists()
    finally:
        for key in ("AWS_ENDPOINT_URL", "XDG_CACHE_HOME", *s3server.ENV):
            ENV.pop(key, None)
        proc.terminate()


def test_a_run_killed_without_notice_resumes_from_the_memory_tier(tmp_path):
    """SIGKILL (no chance to save) between durable checkpoints: the rerun resumes from the newest memory snapshot,
    re-runs the few steps after it with the same losses, and ends with the uninterrupted run's weights."""
    every, total = 2, 120

    def overrides(name: str) -> list[str]:
        return ["--checkpoint.checkpoint_dir", str(tmp_path / name), "--step_scheduler.max_steps", str(total),
                "--step_scheduler.ckpt_every_steps", "50", "--checkpoint.memory_every_steps", str(every),
                "--log_file", str(tmp_path / f"{name}.jsonl"), "--data.num_sentences", "600",
                "--checkpoint.save_consolidated", "final"]

    env = {**ENV, "CKPTIO_MEMORY_DIR": str(tmp_path / "shm")}
    run(1, "tiny_llama.yaml", *overrides("straight"), env=env)
    job = start(1, "tiny_llama.yaml", *overrides("killed"), env=env)
    for line in job.lines(300):
        if "_step_60 committed" in line:
            job.signal(signal.SIGKILL)
            break
    assert job.wait(60).returncode == -signal.SIGKILL, "the run was to be killed mid-way"
    second = run(1, "tiny_llama.yaml", *overrides("killed"), env=env)
    out = second.stdout + second.stderr
    restored = int(out.split("Restored step ")[1].split()[0])
    assert "from the memory tier" in out and restored >= 60

    want = losses(tmp_path / "straight.jsonl")
    seen: dict[int, list[float]] = {}
    for line in (tmp_path / "killed.jsonl").read_text().splitlines():
        rec = json.loads(line)
        seen.setdefault(rec["step"], []).append(rec["loss"])
    assert sorted(seen) == list(range(1, total + 1))
    assert all(v == [want[s]] * len(v) for s, v in seen.items()), "a step re-run after the resume differs"
    # lost work: the steps logged before the kill and run again after the resume. None when the kill landed right
    # after a snapshot (the run had gone on past step 60 before the signal arrived).
    rerun = [s for s, v in seen.items() if len(v) > 1]
    assert all(s > restored for s in rerun) and max(rerun, default=restored) - restored <= 2 * every
    final = (tmp_path / "straight" / "LATEST").resolve().name
    assert final.endswith(f"_step_{total}")
    a, b = final_weights(tmp_path / "straight" / final, False), final_weights(tmp_path / "killed" / final, False)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any((tmp_path / "shm").iterdir()), "the clean end of the rerun freed the memory tier"


def test_the_recipes_run_is_audited_after_a_resume(tmp_path):
    """The recipe hands its loss and lr to ``maybe_save``: the steps after each save are recorded, and a fresh run
    resumed from the save of step 5 (the one of step 10 gone) is audited exact over steps 6 to 8."""
    import shutil

    from ckptio.goodput.record import RECORD_NAME, parse

    folder = tmp_path / "c"
    args = ["--checkpoint.checkpoint_dir", str(folder), "--step_scheduler.max_steps", "10",
            "--step_scheduler.ckpt_every_steps", "5", "--data.num_sentences", "300",
            "--checkpoint.save_consolidated", "false"]
    run(1, "tiny_llama.yaml", *args)
    events = parse((folder / RECORD_NAME).read_bytes(), folder)
    recorded = [e for e in events if e["kind"] == "metrics"]
    assert [e["step"] for e in recorded] == [6, 7, 8] and all({"loss", "lr"} <= set(e) for e in recorded), recorded
    last = next(p for p in folder.iterdir() if p.name.endswith("_step_10"))
    shutil.rmtree(last)
    (folder / "LATEST").unlink()
    second = run(1, "tiny_llama.yaml", *args)
    assert "Resumed at step 5" in second.stdout, second.stdout[-3000:]
    audits = [e for e in parse((folder / RECORD_NAME).read_bytes(), folder) if e["kind"] == "audit"]
    assert len(audits) == 1 and audits[0]["verdict"] == "exact" and audits[0]["checked"] == 3, audits
    assert "Resume audit from step 5: exact" in second.stdout + second.stderr
