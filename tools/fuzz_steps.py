"""Fuzz families for adopted NeMo AutoModel step folders, memory-tier snapshots and chunk indexes (see
``fuzz_readers.py`` for the oracle, ``fuzz_frameworks.py`` for the shared helpers)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from fuzz_frameworks import _fixed_dir, _kinds, _objects, _place, _reset, _same_tensors, damage
from fuzz_kit import Case, Special, WrongResult, flip, load_image, materialize
from fuzz_mutations import mutate_json

from ckptio import CheckpointError


# ---------------------------------------------------------------------------------------------- AutoModel
def _write_steps(config: Any, steps: int) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    """A tiny model and optimizer saved by a real manager at steps 1.. ``steps``; the weights at each."""
    from ckptio import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = CheckpointManager(config, model=model, optimizer=opt)
    paths, weights = [], []
    for step in range(1, steps + 1):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        if config.memory_every_steps:
            paths.append(mgr.save_memory(step=step, epoch=0))
        else:
            paths.append(mgr.save(step=step, epoch=0))
    mgr.close(free_memory=False) if config.memory_every_steps else mgr.close()
    return paths, weights


class AutoModel:
    """NeMo AutoModel step directories (``epoch_E_step_S/`` with ``model/`` and ``optim/`` DCP folders, per-rank
    ``rng/``, no manifest), written by ckptio's own DCP writer and stripped of everything only ckptio writes, so
    that ``automodel.adopt`` takes them: over a pristine step 1 and a damaged step 2, the auto-resume discovery
    (``layout.restore_candidates``: ``layout.scan``, ``adopt``) on every input, ``ckptio list``
    (``describe.list_checkpoints``) on one in four, and an automatic ``CheckpointManager.restore`` on every input
    whose step 2 the discovery took (and on one in ten of the others, where it can only load step 1)."""

    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        from ckptio import CheckpointConfig, CheckpointManager

        base = _fixed_dir("automodel-build")
        config = CheckpointConfig(checkpoint_dir=str(base), model_save_format="torch_save",
                                  optimizer_save_format="torch_save")
        paths, self.weights = _write_steps(config, 2)
        self.images = {}
        for p in paths:
            image = load_image(p)
            only_ckptio = ("manifest.json", ".ckptio-chunks")
            self.images[p.name] = {r: v for r, v in image.items() if not r.endswith(only_ckptio)}
        self.root = _fixed_dir("automodel")
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.model(torch.ones(2, 4)).sum().backward()
        self.opt.step()
        self.mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(self.root)), model=self.model,
                                     optimizer=self.opt)
        self.objs = _objects(self.images["epoch_0_step_2"])

    def own_dirs(self) -> None:
        """In a worker process: a checkpoint folder of its own (workers run side by side)."""
        from ckptio import CheckpointConfig, CheckpointManager

        self.root = _fixed_dir(f"automodel-{os.getpid()}")
        self.mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(self.root)), model=self.model,
                                     optimizer=self.opt)

    def __call__(self, rng: Case, tmp: Path) -> None:
        from ckptio.engine.describe import list_checkpoints
        from ckptio.engine.layout import restore_candidates

        self.prepare()
        rng.reading = False
        root = _reset(self.root)
        materialize(self.images["epoch_0_step_1"], root / "epoch_0_step_1")
        image = dict(self.images["epoch_0_step_2"])
        if not rng.pristine:
            damage(rng, image, _kinds(image), tmp, self.objs, manifest=None)
        _place(rng, image, root / "epoch_0_step_2", tmp)
        rng.reading = True
        found = restore_candidates(root, None)  # discovery: layout.scan and adopt on both steps
        if [p.name for p in found] not in (["epoch_0_step_2", "epoch_0_step_1"], ["epoch_0_step_1"]):
            raise WrongResult(f"auto-resume would try {[str(p) for p in found]}")
        if rng.random() < 0.25:
            list_checkpoints(str(root))  # the same discovery, described (each costs a third of a restore)
        if found[0].name == "epoch_0_step_1" and not rng.pristine and rng.random() >= 0.1:
            return  # step 2 refused at discovery: the restore loads the pristine step 1 (done on one such input in ten)
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        info = self.mgr.restore()
        if info is None or info.step not in (1, 2) or Path(info.path).is_symlink():
            raise WrongResult(f"restore returned {info}")
        if rng.pristine and info.step != 2:
            raise WrongResult("the undamaged step 2 was skipped")
        if info.step == 1:
            _same_tensors(dict(self.model.state_dict()), self.weights[0], "step 1's model")


# ---------------------------------------------------------------------------------------------- memory tier
class Memory:
    """Memory-tier snapshots (``memory_tier.json``, the snapshot step folder, the node id): the single-process
    read entry point, an automatic ``CheckpointManager.restore`` with the memory tier on and no durable checkpoint
    (which lists the node's snapshots, picks one, builds its view and restores from it)."""

    def prepare(self) -> None:
        if hasattr(self, "image"):
            return
        from ckptio import CheckpointConfig, CheckpointManager

        self.memory_dir = _fixed_dir("memory")
        ckpt = _fixed_dir("memory-durable")
        config = CheckpointConfig(checkpoint_dir=str(ckpt), memory_every_steps=1, memory_dir=str(self.memory_dir))
        paths, weights = _write_steps(config, 1)
        self.snapshot = paths[0]
        self.run_dir = self.snapshot.parent
        self.image = load_image(self.snapshot)
        self.node_id = (self.run_dir / "node-id").read_bytes()
        self.want = weights[0]
        torch.manual_seed(1)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.mgr = CheckpointManager(config, model=self.model, optimizer=self.opt)
        self.objs = _objects(self.image)

    def own_dirs(self) -> None:
        """In a worker process: a memory folder of its own (workers run side by side); the run's folder in it has
        the same name (a hash of the durable folder, which stays shared and empty)."""
        import dataclasses
        import shutil

        from ckptio import CheckpointManager

        mine = _fixed_dir(f"memory-{os.getpid()}")
        shutil.rmtree(mine)
        shutil.copytree(self.memory_dir, mine, symlinks=True)
        self.snapshot = mine / self.snapshot.relative_to(self.memory_dir)
        self.run_dir = mine / self.run_dir.relative_to(self.memory_dir)
        self.memory_dir = mine
        config = dataclasses.replace(self.mgr.config, memory_dir=str(mine))
        self.mgr = CheckpointManager(config, model=self.model, optimizer=self.opt)

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        run_dir = _reset(self.run_dir)
        (run_dir / "node-id").write_bytes(self.node_id)
        image = dict(self.image)
        touched: set[str] = set()
        if not rng.pristine:
            if rng.random() < 0.1:
                rng.note("node-id damaged")
                os.unlink(run_dir / "node-id")
                materialize({"node-id": rng.choice([b"", b"x" * 64, self.node_id + b"\n\0", b"\xff" * 32,
                                                    Special(("sparse", 1 << 30)), Special(("fifo",))])}, run_dir)
            touched = damage(rng, image, _kinds(image), tmp, self.objs)
        _place(rng, image, self.snapshot, tmp)
        rng.reading = True
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        info = self.mgr.restore()
        if info is not None and Path(info.path).is_symlink():
            raise WrongResult(f"restored from {info.path}, a link")
        if rng.pristine and (info is None or info.tier != "memory"):
            raise WrongResult(f"the undamaged snapshot was not restored ({info})")
        if info is not None and touched <= {"manifest.json", "memory_tier.json"}:
            _same_tensors(dict(self.model.state_dict()), self.want, "the snapshot's model")
        if info is None:  # the snapshot was refused with its reason (logged): a clean refusal
            raise CheckpointError("the memory snapshot was refused; the restore fell back to the (empty) durable tier")


# ---------------------------------------------------------------------------------------------- chunk index
class ChunkIndex:
    """``.ckptio-chunks`` of a safetensors shard folder and of a DCP folder: the index is parsed, damaged in its
    header, its JSON and its table of integers, and sealed again (size and CRC-32C of the body) so that the parser
    behind the seal is reached; the data files stay whole, so a load that succeeds must load exactly what was
    saved."""

    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        from ckptio.formats.dcp import save as dcp_save
        from ckptio.formats.safetensors import sharded as safetensors_sharded

        torch.manual_seed(0)
        self.want = {"w": torch.randn(6, 4), "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(3.5),
                     "h": torch.randn(3, 2).to(torch.bfloat16)}
        st, dcp = _fixed_dir("chunks-st"), _fixed_dir("chunks-dcp")
        safetensors_sharded.save(self.want, str(st), rank=0, world_size=1, threads=3)
        dcp_save.save({**self.want, "lr": 0.25}, str(dcp))
        self.images = {"safetensors": load_image(st), "dcp": load_image(dcp)}
        for kind, image in self.images.items():
            if ".ckptio-chunks" not in image:
                raise RuntimeError(f"the {kind} writer wrote no chunk index: {sorted(image)}")

    def _folder(self, kind: str) -> Path:
        """This process's copy of the valid folder of ``kind`` (made once per worker)."""
        folders = self.__dict__.setdefault("folders", {})
        if folders.get(kind, (None,))[0] != os.getpid():
            mine = _reset(_fixed_dir(f"chunks-{kind}-{os.getpid()}"))
            folders[kind] = (os.getpid(), materialize(self.images[kind], mine))
        return folders[kind][1]

    def __call__(self, rng: Case, tmp: Path) -> None:
        from ckptio.formats.safetensors import chunk_index, sharded as safetensors_sharded
        from ckptio.formats.dcp import format as dcp
        from ckptio.storage.confined import Folder

        self.prepare()
        rng.reading = False
        kind = rng.choice(["safetensors", "dcp"])
        rng.note(f"a {kind} folder")
        index = self.images[kind][".ckptio-chunks"]
        if not rng.pristine:
            index = mutate_index(rng, index)
        folder = self._folder(kind)  # the data files stay as written: only the index changes from input to input
        (folder / ".ckptio-chunks").write_bytes(index)
        target = {k: torch.full_like(v, -7) for k, v in self.want.items()}
        rng.reading = True
        chunk_index.read(Folder(folder), kind)
        if kind == "safetensors":
            safetensors_sharded.load(target, folder)
            safetensors_sharded.read_index(folder)
        else:
            target["lr"] = 0.0
            dcp.read_index(folder)
            dcp.load(target, folder)
            if target.pop("lr") != 0.25:
                raise WrongResult("the DCP value 'lr' was not loaded right")
        _same_tensors(target, self.want, f"the {kind} folder")


def mutate_index(rng: Case, data: bytes) -> bytes:
    """A damaged chunk index, sealed again (nine times in ten) so that its parser is reached."""
    import numpy as np

    from ckptio.storage.checksum import bytes_checksum

    first, _, body = data.partition(b"\n")
    head = json.loads(first)
    split = head["meta_bytes"]
    meta, table = body[:split], np.frombuffer(body[split:], dtype="<i8").copy()
    part = rng.choice(["meta", "meta", "table", "table", "head", "raw", "gone"])
    if part == "gone":
        rng.note("index removed")
        return b""  # an empty file: refused; a missing one is the fallback the readers already have
    if part == "raw":
        rng.note("index bytes flipped, not sealed again")
        return flip(rng, data)
    if part == "meta":
        meta = mutate_json(rng, meta.rstrip(b" "), "index body JSON")
        meta += b" " * (-len(meta) % 8)
    elif part == "table" and len(table):
        for _ in range(rng.randint(1, 3)):
            if not len(table):
                break
            how = rng.choice(["set", "set", "cut", "grow", "swap"])
            if how == "set":
                i = rng.randrange(len(table))
                value = rng.choice([-1, 0, 1, 2 ** 62, 2 ** 63 - 1, -(2 ** 63), int(table[i]) + rng.choice([-1, 1]),
                                    int(table[i]) * 2])
                value = (value + 2 ** 63) % 2 ** 64 - 2 ** 63  # wrapped as an int64 field overflows on disk
                rng.note(f"index table[{i}] {int(table[i])} -> {value}")
                table[i] = value
            elif how == "cut":
                n = rng.randrange(len(table))
                rng.note(f"index table cut to {n} numbers")
                table = table[:n]
            elif how == "grow":
                rng.note("index table grown by 8 numbers")
                table = np.concatenate([table, np.asarray(table[:8])])
            elif len(table) > 1:
                i, j = rng.randrange(len(table)), rng.randrange(len(table))
                rng.note(f"index table[{i}] and [{j}] swapped")
                table[i], table[j] = table[j], table[i]
    body = meta + table.astype("<i8").tobytes()
    head.update(meta_bytes=len(meta), body_bytes=len(body), body_crc32c=bytes_checksum(body))
    if part == "head":
        key = rng.choice(sorted(head))
        value = rng.choice([None, -8, 0, 8, 2 ** 64, "x", "dcp", "safetensors", 2, [], 1e300, len(meta) + 8])
        rng.note(f"index head {key} <- {value!r}")
        head[key] = value
    else:
        rng.note("index sealed again")
    return json.dumps(head, allow_nan=True).encode() + b"\n" + body


FAMILIES = {"automodel": AutoModel(),
            "memory": Memory(), "chunk_index": ChunkIndex()}
