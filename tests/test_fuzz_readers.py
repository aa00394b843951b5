"""A CI-sized run of the reader fuzzer's families for the frameworks' folders, adopted AutoModel steps, memory
snapshots and chunk indexes (``benchmarks/fuzz_readers.py``): every input must end in a right load or a ckptio
error, within the time limit and the bound on peak memory. The long runs are the fuzzer's own
(``--inputs 100000 --family NAME``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

INPUTS = 200
FRAMEWORK_FAMILIES = ["hf_trainer", "accelerate", "lightning", "automodel", "memory", "chunk_index"]


@pytest.mark.parametrize("family", FRAMEWORK_FAMILIES)
def test_fuzz_family_smoke(family):
    import fuzz_readers

    tally = fuzz_readers.run([family], inputs=INPUTS, seed=11, verbose=True)[family]
    failures = "\n".join(f"input {i}: {detail} <- {'; '.join(notes)}" for i, detail, notes in tally["failures"])
    assert tally["other"] == 0, f"{tally['other']} of {INPUTS} inputs failed:\n{failures}"
    assert tally["clean"] > 0, "the mutations reach no reader"  # the attacks are really generated
    assert tally["harness"] == 0, "the fuzzer itself failed (see its HARNESS ERROR lines)"
    assert tally["ok"] + tally["clean"] == INPUTS
