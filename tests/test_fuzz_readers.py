"""A CI-sized run of the reader fuzzer's families for the frameworks' folders, adopted AutoModel steps, memory
snapshots and chunk indexes (``benchmarks/fuzz_readers.py``): every input must end in a right load or a ckptio
error, within the time limit and the bound on peak memory. The long runs are the fuzzer's own
(``--inputs 100000 --family NAME``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

INPUTS = {"chunk_index": 200, "hf_trainer": 150, "lightning": 150, "memory": 100, "accelerate": 100, "automodel": 60}
"""Inputs per family: what fits in about a minute for all six on a loaded two-core machine (the readers of an
adopted AutoModel step and of a memory snapshot cost tens of milliseconds per input: a full restore each)."""


@pytest.mark.parametrize("family", list(INPUTS))
def test_fuzz_family_smoke(family):
    import fuzz_readers

    n = INPUTS[family]
    tally = fuzz_readers.run([family], inputs=n, seed=11, verbose=True)[family]
    failures = "\n".join(f"input {i}: {detail} <- {'; '.join(notes)}" for i, detail, notes in tally["failures"])
    assert tally["other"] == 0, f"{tally['other']} of {n} inputs failed:\n{failures}"
    assert tally["clean"] > 0, "the mutations reach no reader"  # the attacks are really generated
    assert tally["harness"] == 0, "the fuzzer itself failed (see its HARNESS ERROR lines)"
    assert tally["ok"] + tally["clean"] == n
