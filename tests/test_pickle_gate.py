"""Every pickle a reader unpickles is walked by the gate first (``storage.parse.check_pickle``): a memo slot far
ahead, a frame or a string longer than the file, or an unknown opcode is refused naming the file, before the C
unpickler allocates anything for it. Found by the 100,000-input automodel fuzz run: a flipped byte in a DCP
``.metadata`` made a ``LONG_BINPUT`` name slot ~10^9, and the C unpickler zeroed a memo of 7-9 GB."""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ckptio.errors import CheckpointCorruptError

FAR_SLOT = 1 << 25
"""A memo slot the C unpickler would make room for with 2 x 2^25 x 8 bytes = 512 MiB, zeroed."""

HOSTILE = [
    (b"\x80\x04Nr" + struct.pack("<I", FAR_SLOT) + b".", "memo slot"),  # LONG_BINPUT far ahead
    (b"\x80\x04N" + b"p99999999999999999999\n.", "memo slot"),  # a text PUT, far ahead
    (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", "frame"),  # a frame of a terabyte
    (b"\x80\x04B" + struct.pack("<I", 1 << 31) + b"xx.", "bytes4"),  # a string longer than the file
    (b"\x00" * 64, "unknown"),  # zeros
]


def test_the_gate_walks_what_picklers_write_and_refuses_the_rest():
    from ckptio.storage.parse import check_pickle

    for value in ({"a": [1, 2.5, (3, "x" * 70_000)], "b": None}, [{"k": 1}] * 5, b"\x00" * 300):
        for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
            check_pickle(pickle.dumps(value, protocol=protocol), "good")
    for data, words in HOSTILE:
        with pytest.raises(CheckpointCorruptError, match=rf"^bad\.pkl: not a well-formed pickle \(.*{words}"):
            check_pickle(data, "bad.pkl")
    stream = io.BytesIO(b"head" + pickle.dumps([1, 2], protocol=4))
    stream.seek(4)
    check_pickle(stream, "s", size=len(stream.getvalue()) - 4)
    assert stream.tell() == 4  # left where it started, for the unpickler


_PEAK = """
import resource, sys
from pathlib import Path
from ckptio.formats.dcp.metadata import read_metadata
from ckptio.errors import CheckpointError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_metadata(Path(sys.argv[1]))
except CheckpointError as exc:
    print("ERROR", exc)
print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_dcp_metadata_with_a_far_memo_slot_is_refused_before_memory_is_spent(tmp_path):
    """In a fresh process, so the peak of its memory is this read's."""
    (tmp_path / ".metadata").write_bytes(HOSTILE[0][0])
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"ERROR {tmp_path / '.metadata'}: not a well-formed pickle (memo slot {FAR_SLOT}" in out.stdout, out.stdout
    growth = int(out.stdout.split("GROWTH_KB")[1])
    assert growth < 128 * 1024, f"peak RSS grew {growth} KB reading a {len(HOSTILE[0][0])}-byte file"


def _archive(pkl: bytes, storage: bool = True) -> bytes:
    """A ``torch.save``-shaped archive (stored members) whose ``data.pkl`` is ``pkl`` (of a tensor with
    ``storage``, else of a plain value)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        if storage:
            z.writestr("archive/data/0", b"\x00" * 16)
        z.writestr("archive/version", b"3\n")
    return buf.getvalue()


@pytest.mark.parametrize("data,words", HOSTILE[:3])
def test_every_reader_of_a_torch_save_pickle_refuses_it_naming_the_file(tmp_path, data, words):
    """The DCP item reader (tensor and plain-value paths) and the restricted unpickler of Megatron's and NeMo's
    ``.pt`` files: one gate, the same refusal."""
    from ckptio.formats.dcp import items
    from ckptio.formats import safe_pickle
    from ckptio.storage.confined import Folder

    blob, plain = _archive(data), _archive(data, storage=False)
    (tmp_path / "item.distcp").write_bytes(b"\x01" * 100 + blob + plain)
    with Folder(tmp_path).open("item.distcp") as handle:
        with pytest.raises(CheckpointCorruptError, match=rf"item\.distcp: the DCP item at byte 100.*{words}"):
            items.parse(handle, 100, len(blob))
        at = 100 + len(blob)
        # not taken as a plain value (the old path built None from the far slot); torch.load's weights-only
        # unpickler, whose memo is a dict, then reports the damage
        assert items.plain_value(handle, at, len(plain)) == (False, None)
    with pytest.raises(CheckpointCorruptError, match=rf"^model\.pt: archive/data\.pkl: not a well-formed.*{words}"):
        safe_pickle.loads(blob, "model.pt")


def test_the_fuzz_runs_findings_replay_as_right_loads():
    """The ten inputs of the 100,000-input automodel run that hung, grew by gigabytes or raised a bare error."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import fuzz_readers

    found = [12356, 20319, 24775, 38268, 38958, 50366, 65502, 80193, 80245, 99933]
    tally = fuzz_readers.run(["automodel"], inputs=0, seed=100, replay=found, verbose=False)["automodel"]
    assert tally["other"] == 0 and tally["harness"] == 0, tally["failures"]
    assert tally["ok"] + tally["clean"] == len(found)


def test_a_pickle_accepted_once_is_remembered_by_its_very_bytes_and_nothing_else():
    import pickle
    import struct

    from ckptio.errors import CheckpointCorruptError
    from ckptio.storage import parse

    good = pickle.dumps({"lr": 0.1, "betas": (0.9, 0.95)}, protocol=2)
    parse.check_pickle(good, "good")
    assert good in parse._known_good
    parse.check_pickle(bytearray(good), "good again")  # the same bytes, any buffer type
    # the same pickle with a memo slot far ahead (one flipped byte in a LONG_BINPUT): refused, every time
    bad = good[:2] + b"r" + struct.pack("<I", 10**9) + good[2:]
    for _ in range(2):
        with pytest.raises(CheckpointCorruptError, match="bad"):
            parse.check_pickle(bad, "bad")
    assert bad not in parse._known_good


def test_the_gate_bounds_what_a_pickle_would_build_and_accepts_what_picklers_write():
    """Issue 46: nesting, memory and hashing are bounded by the pickle's size (``storage/pickle_walk.py``); real
    shapes pass: cycles, shared references, sets and frozensets, and a DCP ``.metadata``-sized dict of tuples."""
    from ckptio.storage.parse import check_pickle

    shared = (1, 2, "x")
    cyclic: list = []
    cyclic.append(cyclic)
    node: dict = {"parent": None}
    node["self"] = node
    good = [[shared] * 1000, cyclic, node, {frozenset({1, 2}): {3, 4}, (1, (2, (3,))): 5},
            {(i, i + 1): [float(i)] * 3 for i in range(20_000)}, tuple(tuple(range(i)) for i in range(90))]
    for value in good:
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            check_pickle(pickle.dumps(value, protocol=protocol), "good")
    big = (1 << 61) - 1  # ints that hash alike: i * (2^61 - 1) all hash to 0
    colliding = {i * big: None for i in range(1, 40)}
    bad = {
        "hashing its keys": b"\x80\x04}N" + b"2\x86" * 64 + b"Ns.",
        "levels deep": b"\x80\x04}N" + b"\x85" * 5000 + b"Ns.",
        "bytes of objects": b"\x80\x04(" + b"\x8f" * 400_000 + b"l.",
        "share the hash 0": pickle.dumps(colliding, protocol=4),
        # a list taken into the constructor's arguments first, filled with a costly key after
        "hashing its keys ": b"\x80\x04cbuiltins\nset\n]q\x00\x85h\x00N" + b"2\x86" * 64 + b"a0R.",
    }
    for words, data in bad.items():
        with pytest.raises(CheckpointCorruptError, match=rf"^bad: refused as a pickle: .*{words.strip()}"):
            check_pickle(data, "bad")


def test_a_seek_before_the_start_a_file_claims_is_named_bad_input(tmp_path):
    """Fuzz (lightning, seed 400, input 58158): a flipped offset in a torch.save archive's zip records made the
    reader seek before the file's start; the OSError it raised escaped the gate as a bare error. It is both what
    zipfile's probing expects (OSError) and bad input the gate names (ValueError)."""
    from ckptio.storage.confined import Folder, HandleStream
    from ckptio.storage.parse import parsing

    (tmp_path / "f.pt").write_bytes(b"x" * 10)
    with Folder(tmp_path).open("f.pt") as handle:
        stream = HandleStream(handle)
        with pytest.raises(OSError):
            stream.seek(-1)
        with pytest.raises(CheckpointCorruptError, match=r"f\.pt: .*negative seek position"):
            with parsing(tmp_path / "f.pt"):
                stream.seek(-20, 2)
