"""What the reader fuzzer's pieces share: an input's random source and notes (:class:`Case`), folders held in
memory (an image: relative path -> bytes, or a :class:`Special` entry), writing them out, and re-signing a
ckptio manifest.

A family builds a valid folder once with ckptio's own writers, then for each input copies its image, damages it
structurally (``fuzz_mutations``), re-signs what seals it (:func:`resign`) so that the reader itself is reached
and not only the checksum gate, writes it into a fresh folder on tmpfs (:func:`materialize`) and calls the
reader. Every mutation is noted on the input's :class:`Case`, so a failure prints a one-line reproducer. The
runner is ``fuzz_runner``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


CANARY = b"CANARY-outside-the-checkpoint"
MARKER = "PWNED"
"""A hostile pickle in an input tries to create this folder beside the input: if it exists after the read, the
reader ran code from the checkpoint."""


class WrongResult(Exception):
    """The reader returned, but what it returned (or did) is wrong."""


class Case(random.Random):
    """The random source of one input, with the notes of what was done to it (its reproducer)."""

    def __init__(self, seed: Any, pristine: bool = False) -> None:
        super().__init__(seed)
        self.notes: list[str] = []
        self.pristine = pristine
        self.reading: bool | None = None
        """Set by a family once its input is made and the readers run (``False`` before): an exception before
        that is the harness's own, reported apart."""
        """The warm-up input: no damage at all; the family must load it right (a check of the harness)."""

        self.conn: Any = None
        """The worker's pipe: each note is sent at once, so that the input that hangs or kills its worker has its
        reproducer too."""

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.conn is not None:
            self.conn.send(("note", text))


# ---------------------------------------------------------------------------------------------- folders
class Special(tuple):
    """A non-regular entry of an :class:`Image`: ``("link", target)``, ``("fifo",)``, ``("dir",)`` or
    ``("sparse", size)`` (a file of that size with no bytes stored)."""


Image = dict  # relative path -> bytes | Special


def adam_tensors(fmt: Any, root: Path) -> dict[str, Any]:
    """What a format's ``open_adam`` gives for ``root`` as one flat dict (``<moment>/<key>`` and ``step``; empty
    without Adam's state), every source it opened closed."""
    import torch

    adam = fmt.open_adam(root)
    if adam is None:
        return {}
    step, moments = adam
    got: dict[str, Any] = {}
    try:
        for m, source in moments.items():
            got.update({f"{m}/{k}": source.read(k) for k in source.index()})
    finally:
        for source in moments.values():
            source.close()
    got["step"] = torch.tensor(step)
    return got


def load_image(folder: Path) -> dict[str, Any]:
    """The regular files under ``folder`` (recursively) as an image."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def materialize(image: dict[str, Any], dest: Path) -> Path:
    """Write ``image`` as the folder ``dest`` (created)."""
    dest.mkdir(parents=True, exist_ok=True)
    for rel, value in image.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, Special):
            kind = value[0]
            if kind == "link":
                os.symlink(value[1], path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                path.mkdir(exist_ok=True)
            else:
                with open(path, "wb") as fh:
                    fh.truncate(value[1])
        else:
            path.write_bytes(value)
    return dest


def resign(image: dict[str, Any], manifest_rel: str = "manifest.json") -> None:
    """Rewrite the ckptio manifest in ``image`` so that it records the current size and CRC-32C of every regular
    file it lists and re-seals itself (``manifest_checksum``); a manifest that is no JSON object is left alone."""
    from ckptio.engine.manifest import _self_checksum
    from ckptio.storage.checksum import bytes_checksum

    raw = image.get(manifest_rel)
    if not isinstance(raw, bytes):
        return
    try:
        data = json.loads(raw)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    prefix = manifest_rel.rpartition("/")[0]
    files, sums = data.get("files"), data.get("checksums")
    if isinstance(files, dict):
        for rel in list(files):
            value = image.get(f"{prefix}/{rel}" if prefix else rel)
            if isinstance(value, bytes):
                files[rel] = len(value)
                if isinstance(sums, dict):
                    sums[rel] = bytes_checksum(value)
    data.pop("manifest_checksum", None)
    data["manifest_checksum"] = _self_checksum(data)
    image[manifest_rel] = json.dumps(data, allow_nan=True).encode()


# ---------------------------------------------------------------------------------------------- bytes
def flip(rng: Case, data: bytes) -> bytes:
    """Random damage: flipped bits, a cut, overwritten or inserted bytes."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not buf:
            break
        kind = rng.choice(["flip", "truncate", "set", "insert"])
        i = rng.randrange(len(buf))
        if kind == "flip":
            buf[i] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del buf[i:]
        elif kind == "set":
            buf[i:i + 4] = rng.randbytes(rng.randint(1, 4))
        else:
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
    return bytes(buf)


def outside_dir(tmp: Path) -> Path:
    """A folder beside the input holding a canary no reader may read."""
    out = tmp / "outside"
    out.mkdir(exist_ok=True)
    (out / "canary.bin").write_bytes(CANARY * 64)
    return out


def check_no_code_ran(tmp: Path) -> None:
    if (tmp / MARKER).exists():
        raise WrongResult("a pickle in the checkpoint ran code (the marker folder it creates exists)")


# ---------------------------------------------------------------------------------------------- running
def scratch_root() -> Path:
    """A private folder for the inputs: on tmpfs (``/dev/shm``) when there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="ckptio-fuzz-", dir=base))


def case_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + i
