"""A CI-sized run of the reader fuzzer's families for the frameworks' folders, adopted AutoModel steps, memory
snapshots, chunk indexes and the run's record (``tools/fuzz_readers.py``): every input must end in a right load or a ckptio
error, within the time limit and the bound on peak memory. The long runs are the fuzzer's own
(``--inputs 100000 --family NAME``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

INPUTS = {"chunk_index": 200, "hf_trainer": 150, "lightning": 150, "memory": 100, "accelerate": 100, "automodel": 60,
          "record": 300, "hf_config": 200}
"""Inputs per family: what fits in about a minute for all six on a loaded two-core machine (the readers of an
adopted AutoModel step and of a memory snapshot cost tens of milliseconds per input: a full restore each)."""


PREFETCHED = ("automodel", "memory")
"""The families that restore through ``CheckpointManager.restore``, run with its prefetch of each rank's own files
forced (``--prefetch``: cached or not), so that every damaged step meets that thread too. Checked with
``fuzz_runner.debug`` in one process and ``reading.STATS``."""


@pytest.mark.parametrize("family", list(INPUTS))
def test_fuzz_family_smoke(family, monkeypatch):
    import fuzz_readers

    if family in PREFETCHED:
        monkeypatch.setenv("CKPTIO_PREFETCH", "force")  # the forked workers inherit it
    n = INPUTS[family]
    tally = fuzz_readers.run([family], inputs=n, seed=11, verbose=True)[family]
    failures = "\n".join(f"input {i}: {detail} <- {'; '.join(notes)}" for i, detail, notes in tally["failures"])
    assert tally["other"] == 0, f"{tally['other']} of {n} inputs failed:\n{failures}"
    assert tally["clean"] > 0, "the mutations reach no reader"  # the attacks are really generated
    assert tally["harness"] == 0, "the fuzzer itself failed (see its HARNESS ERROR lines)"
    assert tally["ok"] + tally["clean"] == n


DIRECT = {"dcp": 80, "automodel": 30, "hf_trainer": 40, "lightning": 40, "accelerate": 40}
"""The families whose readers reach the direct reads of cold files (they advise the ranges they read: DCP items,
the verifier's reads of safetensors and torch files), run with every advised range read that way
(``--direct-reads``). Checked with ``fuzz_runner.debug`` in one process and ``reading.STATS``: 12 inputs of each
family opened 12-134 files that way. The safetensors shard loader, the manifest, pointer, DeepSpeed and record
readers advise nothing, so they never read directly."""


@pytest.mark.slow  # the quick loop keeps its 5 minutes; test_direct_reads.py covers the path there
@pytest.mark.parametrize("family", list(DIRECT))
def test_fuzz_family_through_direct_reads(family, monkeypatch):
    import fuzz_readers

    from ckptio.storage import reading

    monkeypatch.setenv("CKPTIO_DIRECT_READS", "force")  # what --direct-reads sets; the forked workers inherit it
    assert reading.mode() == "force"
    n = DIRECT[family]
    tally = fuzz_readers.run([family], inputs=n, seed=23, verbose=True)[family]
    failures = "\n".join(f"input {i}: {detail} <- {'; '.join(notes)}" for i, detail, notes in tally["failures"])
    assert tally["other"] == 0 and tally["harness"] == 0, f"{tally['other']} of {n} inputs failed:\n{failures}"
    assert tally["ok"] + tally["clean"] == n  # (that the attacks are generated: test_fuzz_family_smoke)


# ---------------------------------------------------------------------------------------------- the runner itself
def _family(kind: str):
    """A stand-in family for checks of the runner: ``leak`` keeps a descriptor open per input, ``slow`` sleeps,
    ``even`` raises a ckptio error on even-numbered inputs."""
    import os
    import time

    from ckptio import CheckpointError

    held = []

    def fn(rng, tmp):
        if kind == "leak":
            held.append(os.open(os.devnull, os.O_RDONLY))
        elif kind == "slow":
            time.sleep(0.05)
        elif rng.random() < 0.5:
            raise CheckpointError("refused")

    return fn


def test_runner_counts_a_descriptor_leak_as_a_failure():
    from fuzz_runner import run_family

    tally = run_family("leak", _family("leak"), list(range(40)), 0, verbose=False, fd_bound=16)
    assert tally["other"] >= 1 and all("descriptor leak" in d for _, d, _ in tally["failures"])
    assert tally["ok"] + tally["other"] == 40  # a fresh worker after each leak that passes the bound


def test_runner_jobs_split_the_inputs_and_minutes_stop_the_run():
    from fuzz_runner import run_family

    one = run_family("even", _family("even"), list(range(60)), 3, verbose=False)
    two = run_family("even", _family("even"), list(range(60)), 3, verbose=False, jobs=2)
    assert (one["ok"], one["clean"], one["other"]) == (two["ok"], two["clean"], two["other"])  # an input's own seed
    assert one["clean"] > 0 and one["ok"] > 0
    budget = run_family("slow", _family("slow"), list(range(10_000)), 0, verbose=False, jobs=2, minutes=0.02)
    assert 0 < budget["ok"] < 10_000 and budget["other"] == 0 and budget["seconds"] < 10
