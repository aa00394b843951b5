"""Fuzz families for the readers of the frameworks' folders (HF Trainer, accelerate, Lightning), and the helpers
every family of whole folders shares (see ``fuzz_readers.py`` for the oracle, ``fuzz_steps.py`` for adopted
AutoModel steps, memory snapshots and chunk indexes).

Each family builds its valid folders once (``prepare``, in the parent process, with ckptio's real writers and the
real frameworks on a tiny model), then every input copies one, damages it structurally, re-signs its manifest
most of the time (so the reader behind the checksum gate is reached) and reads it through the public entry
point. Where a pristine older folder sits beside the damaged one, the oracle is stronger: the reader must take
one of the two (never ``NoUsableCheckpointError``) and, when it takes the pristine one, load exactly what was
saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from fuzz_kit import Case, Special, WrongResult, flip, load_image, materialize, outside_dir, resign, scratch_root
from fuzz_mutations import mutate_entry, mutate_json, mutate_pickle

_SCRATCH: list[Path] = []


def _fixed_dir(name: str) -> Path:
    """A folder that lives as long as the run (the frameworks' objects built once keep pointing at it)."""
    if not _SCRATCH:
        _SCRATCH.append(scratch_root())
        import atexit

        atexit.register(lambda: shutil.rmtree(_SCRATCH[0], ignore_errors=True))
    path = _SCRATCH[0] / name
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _reset(path: Path) -> Path:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.mkdir(mode=0o700, parents=True)
    return path


def damage(rng: Case, image: dict[str, Any], kinds: dict[str, str], tmp: Path, objs: dict[str, Any] | None = None,
           manifest: str | None = "manifest.json") -> set[str]:
    """Damage one to three files of ``image`` (``kinds``: rel -> ``json``, ``pickle`` or ``bytes``), then re-sign
    the manifest four times in five (unless it was the target). Returns the names touched."""
    outside = outside_dir(tmp)
    touched: set[str] = set()
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        rel = rng.choice(sorted(kinds))
        if not isinstance(image.get(rel), bytes):
            continue
        touched.add(rel)
        if rng.random() < 0.2:
            mutate_entry(rng, image, rel, outside)
        elif kinds[rel] == "json":
            image[rel] = mutate_json(rng, image[rel], rel)
        elif kinds[rel] == "pickle":
            image[rel] = mutate_pickle(rng, image[rel], rel, tmp, (objs or {}).get(rel))
        else:
            rng.note(f"{rel}: bytes flipped")
            image[rel] = flip(rng, image[rel])
    if manifest is not None and manifest not in touched and rng.random() < 0.8:
        resign(image, manifest)
        rng.note("manifest re-signed")
    return touched


def _kinds(image: dict[str, Any]) -> dict[str, str]:
    def kind(rel: str) -> str:
        if rel.endswith(".json"):
            return "json"
        if rel.endswith((".pt", ".pth", ".bin", ".pkl")) and not rel.endswith("training_args.bin"):
            return "pickle"
        return "bytes"

    return {rel: kind(rel) for rel in image}


def _objects(image: dict[str, Any]) -> dict[str, Any]:
    """The objects our own writers saved in the image's pickles (for mutations of the object itself)."""
    import io

    out = {}
    for rel, kind in _kinds(image).items():
        if kind == "pickle":
            try:
                out[rel] = torch.load(io.BytesIO(image[rel]), weights_only=False)  # our own file, made just now
            except Exception:  # noqa: BLE001 - not a torch file: no object mutations for it
                pass
    return out


def _same_tensors(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    if set(got) != set(want):
        raise WrongResult(f"{what}: loaded keys {sorted(got)[:5]} instead of {sorted(want)[:5]}")
    for k, v in want.items():
        if not (isinstance(got[k], torch.Tensor) and got[k].dtype == v.dtype and torch.equal(got[k], v)):
            raise WrongResult(f"{what}: {k} is not what was saved")


def _folder_attack(rng: Case, image: dict[str, Any], tmp: Path) -> "Special | None":
    """Sometimes the damaged folder itself is replaced: a link (to the pristine one, outside), a file, a FIFO."""
    if rng.random() > 0.05:
        return None
    kind = rng.choice(["link_out", "file", "fifo"])
    rng.note(f"the folder itself: {kind}")
    if kind == "link_out":
        materialize(image, tmp / "outside" / "foreign")
        return Special(("link", str(tmp / "outside" / "foreign")))
    return Special(("fifo",)) if kind == "fifo" else Special(("sparse", 10))


def _place(rng: Case, image: dict[str, Any], dest: Path, tmp: Path) -> None:
    special = _folder_attack(rng, image, tmp)
    if special is None:
        materialize(image, dest)
    else:
        materialize({dest.name: special}, dest.parent)


# ---------------------------------------------------------------------------------------------- HF Trainer
class HFTrainer:
    """``checkpoint-N/`` folders of ``CkptioTrainer``: ``hf_trainer.last_checkpoint`` over a pristine
    ``checkpoint-1`` and a damaged ``checkpoint-2``, then the Trainer's own load path (``_load_optimizer_and_
    scheduler``, ``_load_rng_state``, then transformers' ``TrainerState.load_from_json``) on what it chose: on
    every input where that is the damaged ``checkpoint-2``, on one in ten of the others (the pristine one)."""

    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

        from ckptio.hf_trainer import CkptioTrainer

        base = _fixed_dir("hf-build")
        cfg = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
        torch.manual_seed(0)
        ids = torch.randint(0, 32, (8, 6))
        data = [{"input_ids": r, "labels": r} for r in ids]
        args = TrainingArguments(output_dir=str(base), max_steps=2, save_steps=1, save_strategy="steps",
                                 per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
                                 dataloader_num_workers=0, logging_steps=1)
        self.trainer = CkptioTrainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=data)
        self.trainer.train()
        self.images = {n: load_image(base / n) for n in ("checkpoint-1", "checkpoint-2")}
        self.objs = _objects(self.images["checkpoint-2"])
        one = _objects(self.images["checkpoint-1"])
        self.want_moments = {k: v for k, v in one["optimizer.pt"]["state"][0].items() if isinstance(v, torch.Tensor)}

    def __call__(self, rng: Case, tmp: Path) -> None:
        from transformers import TrainerState

        from ckptio.hf_trainer import last_checkpoint

        self.prepare()
        rng.reading = False
        root = tmp / "out"
        materialize(self.images["checkpoint-1"], root / "checkpoint-1")
        image = dict(self.images["checkpoint-2"])
        if not rng.pristine:
            damage(rng, image, _kinds(image), tmp, self.objs)
            if rng.random() < 0.05:
                image["checkpoint-is-incomplete.txt"] = b""
                rng.note("checkpoint-is-incomplete.txt added")
        _place(rng, image, root / "checkpoint-2", tmp)
        rng.reading = True
        found = last_checkpoint(root)  # NoUsableCheckpointError here is wrong: checkpoint-1 is whole
        if found not in (root / "checkpoint-1", root / "checkpoint-2") or found.is_symlink():
            raise WrongResult(f"last_checkpoint chose {found}{' (a link)' if found.is_symlink() else ''}")
        if rng.pristine and found.name != "checkpoint-2":
            raise WrongResult("the undamaged checkpoint-2 was skipped")
        if found.name == "checkpoint-1" and rng.random() >= 0.1:
            return  # checkpoint-2 refused: the load path reads the pristine checkpoint-1 (done on one such input in ten)
        self.trainer._load_optimizer_and_scheduler(str(found))
        self.trainer._load_rng_state(str(found))
        TrainerState.load_from_json(str(found / "trainer_state.json"))  # what Trainer.train reads next
        if found.name == "checkpoint-1":
            got = self.trainer.optimizer.state_dict()["state"][0]
            _same_tensors({k: got[k] for k in self.want_moments}, self.want_moments, "checkpoint-1's optimizer")


# ---------------------------------------------------------------------------------------------- accelerate
class Accelerate:
    """``checkpoint_N/`` folders of ``CkptioAccelerator``: ``load_state()`` with automatic naming over a pristine
    ``checkpoint_0`` and a damaged ``checkpoint_1`` (discovery, accelerate's loader, the registered object)."""

    class Counter:
        def __init__(self) -> None:
            self.n, self.total = 0, torch.zeros(())

        def state_dict(self) -> dict:
            return {"n": self.n, "total": self.total.clone()}

        def load_state_dict(self, sd: dict) -> None:
            self.n, self.total = sd["n"], sd["total"]

    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        from accelerate.utils import ProjectConfiguration

        from ckptio.accelerate import CkptioAccelerator

        self.project = _fixed_dir("accelerate")
        acc = CkptioAccelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(self.project),
                                                                             automatic_checkpoint_naming=True))
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        model, opt, sched = acc.prepare(model, opt, sched)
        self.counter = self.Counter()
        acc.register_for_checkpointing(self.counter)
        for i in range(2):
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            self.counter.n, self.counter.total = i + 1, self.counter.total + 1.5
            if i == 0:
                self.want = {k: v.clone() for k, v in model.state_dict().items()}
            acc.save_state()
        folder = self.project / "checkpoints"
        self.images = {n: load_image(folder / n) for n in ("checkpoint_0", "checkpoint_1")}
        self.objs = _objects(self.images["checkpoint_1"])
        self.acc, self.model = acc, model

    def own_dirs(self) -> None:
        """In a worker process: a project folder of its own (workers run side by side)."""
        import os

        self.project = _fixed_dir(f"accelerate-{os.getpid()}")
        self.acc.project_configuration.set_directories(str(self.project))

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        root = _reset(self.project / "checkpoints")
        materialize(self.images["checkpoint_0"], root / "checkpoint_0")
        image = dict(self.images["checkpoint_1"])
        if not rng.pristine:
            damage(rng, image, _kinds(image), tmp, self.objs)
        _place(rng, image, root / "checkpoint_1", tmp)
        rng.reading = True
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        self.counter.n = -1
        path = self.acc.load_state()
        if path not in (str(root / "checkpoint_0"), str(root / "checkpoint_1")) or Path(path).is_symlink():
            raise WrongResult(f"load_state took {path}{' (a link)' if Path(path).is_symlink() else ''}")
        if rng.pristine and not path.endswith("checkpoint_1"):
            raise WrongResult("the undamaged checkpoint_1 was skipped")
        if path.endswith("checkpoint_0"):
            _same_tensors(dict(self.model.state_dict()), self.want, "checkpoint_0's model")
            if self.counter.n != 1:
                raise WrongResult(f"checkpoint_0's registered object loaded as n={self.counter.n!r:.40}")


# ---------------------------------------------------------------------------------------------- Lightning
class Lightning:
    """Folders written by ``CkptioCheckpointIO``: ``CkptioCheckpointIO().load_checkpoint`` on a damaged copy and
    ``lightning.last_checkpoint`` over it."""

    def prepare(self) -> None:
        if hasattr(self, "image"):
            return
        import pytorch_lightning as pl

        from ckptio.lightning import CkptioCheckpointIO, read_checkpoint

        class Tiny(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.save_hyperparameters()
                self.net = torch.nn.Linear(4, 1)

            def training_step(self, batch: Any, idx: int) -> torch.Tensor:
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self) -> Any:
                opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}

        base = _fixed_dir("lightning-build")
        torch.manual_seed(0)
        x = torch.randn(8, 4)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
        trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", devices=1, plugins=[CkptioCheckpointIO()],
                             callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(base), save_last=True)])
        trainer.fit(Tiny(), data)
        self.image = load_image(base / "last.ckpt")
        self.objs = _objects(self.image)
        self.want = read_checkpoint(base / "last.ckpt")["state_dict"]

    def __call__(self, rng: Case, tmp: Path) -> None:
        from ckptio.lightning import CkptioCheckpointIO, last_checkpoint

        self.prepare()
        rng.reading = False
        image = dict(self.image)
        touched = set() if rng.pristine else damage(rng, image, _kinds(image), tmp, self.objs)
        root = tmp / "lit"
        _place(rng, image, root / "last.ckpt", tmp)
        rng.reading = True
        last_checkpoint(root)
        out = CkptioCheckpointIO().load_checkpoint(root / "last.ckpt")
        if not isinstance(out, dict) or not isinstance(out.get("state_dict"), dict):
            raise WrongResult(f"load_checkpoint returned {type(out).__name__}")
        if touched <= {"manifest.json"}:
            _same_tensors(out["state_dict"], self.want, "the checkpoint's state_dict")


FAMILIES = {"hf_trainer": HFTrainer(), "accelerate": Accelerate(), "lightning": Lightning()}
