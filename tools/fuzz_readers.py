"""Fuzz ckptio's readers with hostile and damaged inputs; every outcome must be "loaded right" or a clean error.

    .venv/bin/python tools/fuzz_readers.py [--inputs 500] [--seed 0] [--family NAME ...] [--jobs 2]
        [--minutes M] [--timeout 10] [--rss-mb 256] [--direct-reads] [--prefetch] [--replay N ... [--debug]]

Families (each generates structured attacks and random byte damage of valid files):

  safetensors  shard sets with random placements (overlaps, gaps, out-of-range), flipped/truncated bytes
  dcp          .metadata with data paths outside the folder, to links, FIFOs and devices, chunks that
               overlap or leave gaps, wrong offsets and lengths, and random byte damage
  manifest     resealed manifests with random values of random types in every field, bit flips, random JSON;
               pruned states and folders aimed outside the step or at what it keeps, then a pruning pass run
  pointer      LATEST/BEST as links or text naming paths, links, outside folders, huge or binary files
  archive      tar members that are symlinks and hard links in chains, to folders, outside, cycles,
               duplicates, and random byte damage
  yaml         alias bombs, deep nesting and random documents as a .nemo model_config.yaml

and, in ``fuzz_frameworks.py`` and ``fuzz_steps.py`` (their mutations in ``fuzz_mutations.py``), each starting
from valid folders written by the real code on a tiny model, damaged structurally (JSON: other types, deep
nesting, huge and negative numbers, NaN, keys dropped, duplicated or added; pickles and torch files: cut,
flipped, hostile pickles that run code or nest without end, zip bombs, members dropped, the saved object changed; files: missing, renamed, links, FIFOs, folders, huge sparse files),
with the manifest re-signed four times in five so that the reader behind the checksums is reached:

  hf_trainer   checkpoint-N/ of CkptioTrainer: last_checkpoint over a pristine and a damaged folder, then the
               Trainer's load path (optimizer, scheduler, RNG state, trainer_state.json)
  accelerate   checkpoint_N/ of CkptioAccelerator: load_state() with automatic naming
  lightning    folders of CkptioCheckpointIO: load_checkpoint and lightning.last_checkpoint
  automodel    AutoModel step folders (no manifest): layout.scan, `ckptio list`, CheckpointManager.restore
  memory       memory-tier snapshots (memory_tier.json, the snapshot, node-id): CheckpointManager.restore
  chunk_index  .ckptio-chunks of safetensors and DCP folders, damaged and sealed again (size and CRC-32C)

and the run's record (``fuzz_record.py``, ``record``), Megatron's distributed optimizer in the legacy layout
(``fuzz_megatron.py``, ``megatron_distopt``: ``distrib_optim.pt`` beside ``model_optim_rng.pt``, written by
megatron-core; ``megatron_vpp``: legacy rank files with virtual pipeline chunks and their ``distrib_optim.pt``;
``megatron_mixtral``: also an EP=2 run's chained ``distrib_optim.pt``, and a PP=2 x VPP=2 x EP=2 run's legacy files
and torch_dist folders, with and without ``chained_N.`` prefixes; ``megatron_dist_distopt``: the
DistributedOptimizer's torch_dist in its fully_reshardable format), the schedule ``megatron_schedule`` continues
(``fuzz_schedule.py``, ``megatron_schedule``: the legacy rank file's or ``common.pt``'s ``opt_param_scheduler`` and
``args`` damaged, checked against megatron-core's own scheduler), and the ``config.json`` that ``convert --config``
names (``fuzz_config.py``, ``hf_config``).

Each input ends in one of three ways, tallied per family:

  ok          the reader returned, and what it returned is right (the values written, nothing outside)
  clean       the reader raised ckptio's own CheckpointError (with a message naming the file)
  failure     anything else: another exception type, a crash, a hang (more than --timeout s), peak RSS more
              than --rss-mb MiB above the worker's baseline (its RSS after one valid input), more than 256
              descriptors left open beyond the baseline (a leak that would end in EMFILE), wrong values
              loaded, a pickle that ran code, a file read or written outside the target. Must be 0; each is
              printed with what was done to the input, and --replay N --debug reruns it with its traceback.

Every family runs in forked worker processes (fuzz_runner.run_family) that live across inputs, so that a hang or
a crash costs one input and a fresh worker; --jobs N runs N of them side by side (each input's random source
depends only on --seed and its number, so the tally is the same), and --minutes M stops a family after M minutes
of inputs. Each family ends with one line: inputs, loaded right, clean errors, failures, peak RSS, inputs/s (the
inputs alone; its preparation, done once, is given apart). A long run on a two-core machine:

    .venv/bin/python tools/fuzz_readers.py --inputs 100000 --family automodel --jobs 2 --minutes 40

The suite runs a few inputs of the first six families (tests/test_hostile.py::test_fuzz_families_smoke) and 200
of each of the others (tests/test_fuzz_readers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import random
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

import torch  # noqa: E402

from ckptio import CheckpointError  # noqa: E402

TIMEOUT_S = 10
RSS_MB = 256
CANARY = b"CANARY-outside-the-checkpoint"


from fuzz_kit import WrongResult  # noqa: E402  (the reader returned, but what it returned or did is wrong)
from fuzz_kit import flip as _mutate  # noqa: E402  (random byte damage)


def _outside(tmp: Path) -> Path:
    """A folder beside the target holding a canary file that no reader may ever read."""
    out = tmp / "outside"
    out.mkdir(exist_ok=True)
    (out / "canary.distcp").write_bytes(CANARY * 64)
    return out


def _nothing_new_outside(tmp: Path, before: set[str], target: Path) -> None:
    now = {str(p.relative_to(tmp)) for p in tmp.rglob("*")}
    extra = [p for p in now - before if not (tmp / p).resolve().is_relative_to(target.resolve())]
    if extra:
        raise WrongResult(f"files appeared outside the target: {extra[:3]}")


# ---------------------------------------------------------------------------------------------- safetensors
def fuzz_safetensors(rng: random.Random, tmp: Path) -> None:
    """Shard sets whose placements may lie (overlap, leave gaps, fall outside). The oracle is independent
    of ckptio: a count of how many chunks claim each element. A load may succeed only when every element
    is claimed exactly once, and must then hold exactly what the chunks hold."""
    from ckptio.formats.safetensors import _writer as _st_writer, sharded as safetensors_sharded
    from ckptio.storage import LocalWriteStream

    rows, cols = rng.randint(1, 6), rng.randint(1, 3)
    n_files = rng.randint(1, 4)
    cuts = sorted(rng.sample(range(1, rows), min(rows - 1, n_files - 1))) if rows > 1 else []
    claims = torch.zeros(rows, cols, dtype=torch.int64)
    expected = torch.full((rows, cols), float("nan"))
    valid = True
    mutated = False
    for i, (a, b) in enumerate(zip([0] + cuts, cuts + [rows])):
        off, n = a, b - a
        if rng.random() < 0.35:  # a placement that lies
            off, n = rng.randint(-1, rows), rng.randint(0, rows)
        data = torch.arange(n * cols, dtype=torch.float32).reshape(n, cols) + 100.0 * (i + 1)
        if 0 <= off and off + n <= rows:
            claims[off:off + n] += 1
            expected[off:off + n] = data
        else:
            valid = False
        meta = {"format": "pt", "ckptio_format": safetensors_sharded.FORMAT_TAG,
                "ckptio_shards": json.dumps({"w": {"shape": [rows, cols], "offsets": [off, 0]}})}
        path = tmp / f"shard-{i}.safetensors"
        _st_writer.write(LocalWriteStream(path), [_st_writer.Entry("w", data.dtype, tuple(data.shape), lambda d=data: d)],
                         meta)
        if rng.random() < 0.3:
            path.write_bytes(_mutate(rng, path.read_bytes()))
            mutated = True  # damaged tensor bytes are caught by checksums (the manifest family), not here
    exact = valid and bool(torch.all(claims == 1))
    target = {"w": torch.full((rows, cols), -1.0)}
    safetensors_sharded.load(target, tmp)
    if not exact and not mutated:
        raise WrongResult(f"loaded although the chunks claim the elements {claims.tolist()} times")
    if exact and not mutated and not torch.equal(target["w"], expected):
        raise WrongResult(f"loaded {target['w'].tolist()} instead of {expected.tolist()}")


# ---------------------------------------------------------------------------------------------- dcp
def fuzz_dcp(rng: random.Random, tmp: Path) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from ckptio.formats.dcp import format as dcp_format

    folder = tmp / "ck"
    reference = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp_format.save({"w": reference.clone(), "lr": 0.25}, folder)
    outside = _outside(tmp)
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own file
    data_file = next(folder.glob("*.distcp"))
    attack = rng.choice(["path", "path", "chunks", "storage", "special", "bytes", "pickle"])
    if attack == "path":
        target = rng.choice([str(outside / "canary.distcp"), "../outside/canary.distcp", "./" + data_file.name,
                             "sub/../" + data_file.name, "", "/dev/zero", data_file.name + "/x", "a\\b", "ok\0x"])
        for info in md.storage_data.values():
            if rng.random() < 0.7:
                info.relative_path = target
    elif attack == "chunks":
        entry = md.state_dict_metadata["w"]
        chunk = entry.chunks[0]
        choice = rng.choice(["shrink", "dup", "shift", "grow"])
        if choice == "shrink":
            chunk.sizes = torch.Size([rng.randint(0, 3), rng.randint(0, 4)])
        elif choice == "dup":
            entry.chunks.append(ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes))
        elif choice == "shift":
            chunk.offsets = torch.Size([rng.randint(-1, 3), rng.randint(0, 4)])
        else:
            entry.size = torch.Size([rng.randint(1, 5), 4])
    elif attack == "storage":
        for info in md.storage_data.values():
            info.offset = rng.choice([info.offset, -1, 10**12, info.offset + rng.randint(-8, 8)])
            info.length = rng.choice([info.length, 0, -5, 10**12, info.length + rng.randint(-8, 8)])
    elif attack == "special":
        kind = rng.choice(["symlink", "fifo", "dir"])
        data_file.unlink()
        if kind == "symlink":
            data_file.symlink_to(outside / "canary.distcp")
        elif kind == "fifo":
            os.mkfifo(data_file)
        else:
            data_file.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    if attack == "pickle":  # well-formed opcodes whose objects cost far more than their bytes, or run code
        from fuzz_mutations import hostile_pickle

        payload, told = hostile_pickle(rng, tmp)
        if hasattr(rng, "note"):
            rng.note(f".metadata replaced by {told}")
        (folder / ".metadata").write_bytes(payload)
        attack, victim = "bytes", folder / ".metadata"
    elif attack == "bytes":
        victim = rng.choice([folder / ".metadata", data_file])
        victim.write_bytes(_mutate(rng, victim.read_bytes()))
    target = {"w": torch.full((3, 4), -1.0), "lr": 0.0}
    dcp_format.read_index(folder)
    dcp_format.load(target, folder)
    if attack != "bytes" and not (torch.equal(target["w"], reference) and target["lr"] == 0.25):
        raise WrongResult(f"loaded {target} instead of the saved values")
    if attack == "bytes" and not torch.equal(target["w"], reference) and victim == folder / ".metadata":
        raise WrongResult("damaged metadata loaded other values without an error")


# ---------------------------------------------------------------------------------------------- manifest
def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "neg", "float", "str", "path", "list", "dict"]
    kind = rng.choice(kinds if depth < 3 else kinds[:7])
    return {
        "none": lambda: None, "bool": lambda: rng.random() < 0.5, "int": lambda: rng.randint(0, 10**6),
        "neg": lambda: -rng.randint(1, 10), "float": lambda: rng.choice([0.5, float("nan"), float("inf"), -1e300]),
        "str": lambda: rng.choice(["", "x", "model", "crc32c:00000000", "\0"]),
        "path": lambda: rng.choice(["../x", "/etc/passwd", "a//b", "./m", "model", "LATEST"]),
        "list": lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "dict": lambda: {rng.choice(["a", "kind", "path", "0.weight", ""]): _random_value(rng, depth + 1)
                         for _ in range(rng.randint(0, 3))},
    }[kind]()


def _bucket_references(data: bytes, name: str) -> None:
    """What a bucket's step folder resolves from a manifest's ``shared``: only plain paths into another step."""
    from ckptio.storage.objstore.refs import shared_of

    for rel, target in shared_of(data, name).items():
        parts = target.split("/")
        if len(parts) < 2 or parts[0] in (name, "", ".", "..") or ".." in parts or target.startswith("/") \
                or ".." in rel.split("/"):
            raise WrongResult(f"a bucket would resolve {rel!r} to {target!r}")


def _share_from(tmp: Path, manifest: Any, victim: Path) -> None:
    """A save offered this manifest as the newest checkpoint's: it links only regular files of the folder."""
    from ckptio.engine.sharing import Previous, Sharer
    from ckptio.storage.local import LocalStorage

    manifest.ownership(LocalStorage(tmp).folder(manifest.name))
    writer = LocalStorage(tmp).begin_step("fuzz-next")
    try:
        previous = Previous.of(manifest)
        share = Sharer(writer, previous)
        for rel, digest in previous.contents.items():
            if share(rel, digest) is not None and not (writer.tmp / rel).is_file():
                raise WrongResult(f"{rel!r} was shared but is not a file of the new step")
        for linked in writer.tmp.rglob("*"):
            if linked.is_file() and linked.stat().st_ino == (victim / "keep").stat().st_ino:
                raise WrongResult(f"a file outside the folder was linked into a step: {linked}")
    finally:
        writer.abort()


def fuzz_manifest(rng: random.Random, tmp: Path) -> None:
    from ckptio.engine.layout import scan
    from ckptio.engine.manifest import _self_checksum, check_files, read_manifest

    step = _valid_checkpoint(tmp)
    path = step / "manifest.json"
    data = json.loads(path.read_text())
    how = rng.choice(["reseal", "reseal", "flip", "random"])
    if how == "reseal" and rng.random() < 0.3:  # what keep_optimizer_latest writes, aimed at what it deletes
        data["pruned"] = rng.choice([{"optim": "x"}, {"model": "x"}, {}, _random_value(rng)])
        data["pruned_paths"] = {rng.choice(["optim", "model", "rng"]): rng.choice(
            ["../victim", "model", "optim", ".", "", "optim/../model", "model/x", "/tmp", "rng"])}
        if rng.random() < 0.5:  # a pruned manifest as it is written (the optimizer's files left: garbage)
            data["states"].pop("optim", None)
            for listing in ("files", "checksums"):
                data[listing] = {k: v for k, v in data[listing].items() if not k.startswith("optim/")}
    if how == "reseal" and rng.random() < 0.3:  # what a save sharing unchanged files writes, aimed elsewhere
        rel = rng.choice([*data["files"], "model/x.safetensors", "../victim/keep", ""])
        data["contents"] = {rel: rng.choice(["sha256:" + "0" * 64, "sha256:zz", _random_value(rng)])}
        data["shared"] = {rel: rng.choice(["other/model/x", "../victim/keep", f"{step.name}/x", "x", "/etc/passwd",
                                           ".tmp-1/model/x", f"{tmp.name}-victim/keep", _random_value(rng)])}
    if how == "reseal":  # an attacker who knows the format: every field may hold anything
        for _ in range(rng.randint(1, 3)):
            node, key = data, rng.choice(list(data))
            if isinstance(data[key], dict) and data[key] and rng.random() < 0.6:
                node, key = data[key], rng.choice(list(data[key]))
                if isinstance(node[key], dict) and node[key] and rng.random() < 0.5:
                    node, key = node[key], rng.choice(list(node[key]))
            if rng.random() < 0.15:
                del node[key]
            else:
                node[key] = _random_value(rng)
        data.pop("manifest_checksum", None)
        data["manifest_checksum"] = _self_checksum(data)
        path.write_text(json.dumps(data))
    elif how == "flip":
        path.write_bytes(_mutate(rng, path.read_bytes()))
    else:
        path.write_text(json.dumps(_random_value(rng)))
    victim = tmp.parent / f"{tmp.name}-victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep").write_bytes(b"outside")
    before = {str(p.relative_to(tmp)) for p in tmp.rglob("*")}
    _bucket_references(path.read_bytes(), step.name)
    entries = scan(tmp)
    manifest = read_manifest(step)
    _share_from(tmp, manifest, victim)
    problems = check_files(step, manifest, checksums=True)
    if problems:
        raise CheckpointError("; ".join(problems))  # reported cleanly, as verify does
    _nothing_new_outside(tmp, before, step)
    from ckptio.engine.prune_optim import prune_optimizers
    from ckptio.storage.local import LocalStorage

    prune_optimizers(LocalStorage(tmp), entries, 0)  # prunes this step, and removes what it says was pruned
    if (victim / "keep").read_bytes() != b"outside":
        raise WrongResult("pruning removed a file outside the step")
    problems = check_files(step, read_manifest(step), checksums=True)
    if problems:
        raise WrongResult(f"pruning removed what the manifest still refers to: {problems[:2]}")


_CHECKPOINT_CACHE: dict[str, bytes] = {}


def _valid_checkpoint(tmp: Path) -> Path:
    """A small committed checkpoint (built once, then unpacked from memory)."""
    if "tar" not in _CHECKPOINT_CACHE:
        from ckptio import CheckpointConfig, CheckpointManager

        base = Path(tempfile.mkdtemp(prefix="ckptio-fuzz-"))
        model = torch.nn.Linear(3, 2)
        with contextlib.redirect_stdout(io.StringIO()):
            CheckpointManager(CheckpointConfig(checkpoint_dir=str(base)), model=model,
                              optimizer=torch.optim.AdamW(model.parameters()), rng=False).save(step=1)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(base / "epoch_0_step_1", arcname="epoch_0_step_1")
        _CHECKPOINT_CACHE["tar"] = buf.getvalue()
        shutil.rmtree(base)
    with tarfile.open(fileobj=io.BytesIO(_CHECKPOINT_CACHE["tar"])) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / "epoch_0_step_1"


# ---------------------------------------------------------------------------------------------- pointer
def fuzz_pointer(rng: random.Random, tmp: Path) -> None:
    from ckptio.engine.layout import LATEST, pointer_target, restore_candidates

    root = tmp / "root"
    root.mkdir()
    step = _valid_checkpoint(root)
    outside = _outside(tmp)
    shutil.copytree(step, outside / "foreign_step")
    os.symlink(outside / "foreign_step", root / "linked")  # a link inside the folder that leads out
    how = rng.choice(["link", "text", "huge", "binary"])
    name = rng.choice(["epoch_0_step_1", "linked", "../outside/foreign_step", str(outside / "foreign_step"), ".",
                       "..", "", "x/y", ".tmp-x", "missing", "epoch_0_step_1\0", "a" * 300])
    with contextlib.suppress(OSError, ValueError):
        if how == "link":
            os.symlink(name or "x", root / LATEST)
        elif how == "text":
            (root / "LATEST.txt").write_text(name + rng.choice(["", "\n", "\n\nextra"]))
        elif how == "huge":
            with open(root / "LATEST.txt", "wb") as fh:
                fh.truncate(rng.choice([5000, 1 << 20, 1 << 33]))
        else:
            (root / "LATEST.txt").write_bytes(rng.randbytes(rng.randint(1, 64)))
    found = restore_candidates(root, LATEST)  # must fall back, never lead out
    for path in found:
        if path.parent != root or path.is_symlink():
            raise WrongResult(f"LATEST led to {path}")
    target = pointer_target(root, LATEST)
    if target is not None and (target.parent != root or target.is_symlink()):
        raise WrongResult(f"the pointer resolved to {target}")


# ---------------------------------------------------------------------------------------------- archive
def fuzz_archive(rng: random.Random, tmp: Path) -> None:
    from ckptio.storage.archive import safe_extract

    names = ["a", "b", "c", "d/e", "d/f", "model_config.yaml", "w.bin"]
    targets = names + [".", "..", "../..", "/", "/etc/passwd", "a/..", "d/../..", "d", "../outside/canary.distcp",
                       "missing"]
    arc = tmp / "x.nemo"
    _outside(tmp)
    with tarfile.open(arc, "w") as tar:
        for _ in range(rng.randint(1, 8)):
            info = tarfile.TarInfo(rng.choice(names + ["d", "a/x", "../z", "/abs", "b/c/d"]))
            kind = rng.choice(["file", "file", "dir", "sym", "hard", "fifo"])
            data = None
            if kind == "file":
                data = rng.randbytes(rng.randint(0, 64))
                info.size = len(data)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                info.linkname = rng.choice(targets)
            else:
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    if rng.random() < 0.25:
        arc.write_bytes(_mutate(rng, arc.read_bytes()))
    before = {str(p.relative_to(tmp)) for p in tmp.rglob("*")}
    dest = tmp / "work" / "out"
    dest.parent.mkdir()
    try:
        safe_extract(arc, dest)
    finally:
        _nothing_new_outside(tmp, before, tmp / "work")
    for p in dest.rglob("*"):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            raise WrongResult(f"{p} is a link or special file")
        if p.is_file() and CANARY in p.read_bytes():
            raise WrongResult(f"{p} holds the contents of a file outside the archive")


# ---------------------------------------------------------------------------------------------- yaml
def fuzz_yaml(rng: random.Random, tmp: Path) -> None:
    from ckptio.formats.nemo import format as nemo

    how = rng.choice(["bomb", "deep", "random", "refs"])
    if how == "bomb":
        width, levels = rng.randint(2, 10), rng.randint(2, 30)
        lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
        text = "\n".join(lines)
    elif how == "deep":
        # around the bound (100 levels) mostly: PyYAML's scanner looks up to 1024 characters ahead for a key on
        # each bracket, so a depth d costs it ~min(d, 1000)**2 steps (~0.4 s past 1000): one deep input in twenty
        depth = rng.randint(50, 150) if rng.random() < 0.95 else rng.randint(150, 5000)
        text = "k: " + "[" * depth + "]" * depth
    elif how == "refs":
        text = "tokenizer:\n  files: {tokenizer.json: " + json.dumps(rng.choice(
            ["nemo:tok.json", "nemo:../tok.json", "/etc/passwd", "nemo:/etc/passwd", "nemo:", 5, "nemo:a/b"])) + "}\n"
        text += rng.choice(["", "artifacts: {x: nemo:missing}\n", "artifacts: [1, 2]\n", "tokenizer: 5\n"])
    else:
        text = rng.randbytes(rng.randint(0, 200)).decode("latin-1")
    folder = tmp / "nemo"
    folder.mkdir()
    (folder / "model_config.yaml").write_text(text, errors="replace")
    (folder / "tok.json").write_text("{}")
    torch.save({"w": torch.zeros(1)}, folder / "model_weights.ckpt")
    nemo.read_config(folder)


FAMILIES: dict[str, Callable[[random.Random, Path], None]] = {
    "safetensors": fuzz_safetensors, "dcp": fuzz_dcp, "manifest": fuzz_manifest, "pointer": fuzz_pointer,
    "archive": fuzz_archive, "yaml": fuzz_yaml,
}


def _all_families() -> dict[str, Callable[[random.Random, Path], None]]:
    from fuzz_config import FAMILIES as CONFIG
    from fuzz_deepspeed import FAMILIES as DEEPSPEED
    from fuzz_frameworks import FAMILIES as FRAMEWORKS
    from fuzz_megatron import FAMILIES as MEGATRON
    from fuzz_record import fuzz_record
    from fuzz_schedule import FAMILIES as SCHEDULE
    from fuzz_steps import FAMILIES as STEPS

    return {**FAMILIES, **FRAMEWORKS, **STEPS, **DEEPSPEED, **MEGATRON, **SCHEDULE, **CONFIG, "record": fuzz_record}


def run(families: list[str], inputs: int, seed: int, verbose: bool = True, *, timeout: float = TIMEOUT_S,
        rss_mb: int = RSS_MB, replay: list[int] | None = None, jobs: int = 1,
        minutes: float | None = None) -> dict[str, dict[str, Any]]:
    """Fuzz ``inputs`` inputs (or the inputs numbered ``replay``) of each family, each family in ``jobs`` worker
    processes side by side (:func:`fuzz_runner.run_family`), at most ``minutes`` per family after its preparation;
    return ``{family: {"ok", "clean", "other", "harness", "rss_kb", "seconds", "prepare_s", "failures"}}``."""
    from fuzz_runner import distinct, run_family, summary_line

    every = _all_families()
    tally: dict[str, dict[str, Any]] = {}
    for family in families:
        counts = run_family(family, every[family], list(replay) if replay is not None else list(range(inputs)), seed,
                            timeout=timeout, rss_mb=rss_mb, verbose=verbose, jobs=jobs, minutes=minutes)
        tally[family] = counts
        if verbose and counts["failures"]:
            print(f"  distinct failures of {family} (how many, the input with the fewest changes, what they were):")
            for sig, (n, i, notes) in distinct(counts["failures"]).items():
                print(f"    {n:>5} x {sig}\n          e.g. --family {family} --seed {seed} --replay {i}: "
                      f"{'; '.join(notes)[:300]}")
        if verbose:
            print(summary_line(family, counts, rss_mb), flush=True)
    return tally


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=500, help="inputs per family (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", action="append", choices=sorted(_all_families()), help="only these families")
    p.add_argument("--replay", type=int, action="append", help="only the input with this number (repeatable)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per input (default {TIMEOUT_S})")
    p.add_argument("--rss-mb", type=int, default=RSS_MB,
                   help=f"peak RSS bound, MiB above the worker's baseline (default {RSS_MB})")
    p.add_argument("--jobs", type=int, default=1, help="worker processes side by side per family (default 1)")
    p.add_argument("--minutes", type=float, help="stop each family after this many minutes of inputs")
    p.add_argument("--direct-reads", action="store_true",
                   help="read every advised range through the direct reads of cold files (CKPTIO_DIRECT_READS=force: "
                        "small pieces, cached or not), so that hostile offsets and spans meet that path too")
    p.add_argument("--prefetch", action="store_true",
                   help="have every restore prefetch its files, cached or not (CKPTIO_PREFETCH=force), so that the "
                        "damaged steps of the automodel and memory families meet that thread too")
    p.add_argument("--debug", action="store_true",
                   help="with --replay: run in this process, print the full traceback and keep the input's folder")
    args = p.parse_args()
    if args.direct_reads:
        os.environ["CKPTIO_DIRECT_READS"] = "force"  # the forked workers inherit it
    if args.prefetch:
        os.environ["CKPTIO_PREFETCH"] = "force"
    if args.debug:
        from fuzz_runner import debug

        every = _all_families()
        return debug({f: every[f] for f in args.family or []}, args.replay or [], args.seed)
    tally = run(args.family or list(_all_families()), args.inputs, args.seed, timeout=args.timeout,
                rss_mb=args.rss_mb, replay=args.replay, jobs=args.jobs, minutes=args.minutes)
    total = {k: sum(t[k] for t in tally.values()) for k in ("ok", "clean", "other", "harness", "seconds")}
    n = sum(total[k] for k in ("ok", "clean", "other", "harness"))
    print(f"\n{n} inputs tried ({n / max(total['seconds'], 1e-9):.1f} inputs/s): {total['ok']} loaded right, "
          f"{total['clean']} clean errors, {total['other']} failures"
          + (f", {total['harness']} errors of the fuzzer itself" if total["harness"] else ""))
    return 1 if total["other"] or total["harness"] else 0


if __name__ == "__main__":
    sys.exit(main())
