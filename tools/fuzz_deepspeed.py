"""The fuzz family of DeepSpeed checkpoints (see ``fuzz_readers.py`` for the oracle): a ZeRO-2 and a ZeRO-3 run
folder (the toy model 33 wide, so that ZeRO-3 pads parameters and the check of each rank's padding is read) and a
universal folder (``ds_to_universal`` of the ZeRO-2 one) written by the real DeepSpeed
(``tests/ds_run.py`` under torchrun, once, kept in the fuzzer's scratch folder), damaged one to three files at a
time (bytes, pickles, whole entries), then read as every reader does: the format's detection, the fp32 masters of
every parameter, Adam's moments and step, and the scheduler state. An untouched folder must read exactly what the
pristine one holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from fuzz_frameworks import _fixed_dir, _kinds, _objects, _place, damage
from fuzz_kit import Case, Special, WrongResult, adam_tensors, load_image, materialize

HERE = Path(__file__).resolve().parent


def _run(stage: str) -> Path:
    if stage == "universal":  # DeepSpeed's own ds_to_universal of the ZeRO-2 run, alone in a run folder
        out = _fixed_dir("deepspeed-universal")
        if not (out / "latest_universal").is_file():
            tag = _run("2") / "global_step3"
            r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                                "--output_folder", str(out / "global_step3_universal"), "--inject_missing_state"],
                               capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"ds_to_universal failed: {r.stderr[-2000:]}")
            (out / "latest_universal").write_text("global_step3_universal")
        return out
    if os.environ.get("CKPTIO_FIXTURE_CACHE"):  # under pytest: the session's shared run (tests/fixture_cache.py; the
        sys.path.insert(0, str(HERE.parent / "tests"))  # ZeRO-3 one is test_deepspeed.py's odd3), only read here
        from fixture_cache import ds_run

        return ds_run("--stage", stage, *(["--hidden", "33"] if stage == "3" else []))
    out = _fixed_dir(f"deepspeed-zero{stage}")
    if not (out / "latest").is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE.parent / "tests" / "ds_run.py"), str(out), "--stage", stage,
               *(["--hidden", "33"] if stage == "3" else [])]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"the DeepSpeed run failed: {r.stderr[-2000:]}")
    return out


def _read(root: Path) -> dict[str, torch.Tensor]:
    from ckptio.formats import registry

    fmt = registry.detect(root)
    opened = fmt.open(root)
    try:
        got = {k: opened.source.read(k) for k in opened.source.index()}
    finally:
        opened.close()
    got.update(adam_tensors(fmt, root))
    extras = fmt.training_extras(root)
    got["scheduler"] = torch.tensor(float(len(repr(extras.get("lr_scheduler")))))
    _check_hyper(extras)
    return got


def _check_hyper(extras: dict) -> None:
    """What a resume does before applying the scheduler's state and the hyper-parameters: check them against the
    objects ``tests/ds_run.py`` trains with (AdamW, StepLR(2, 0.5)); a damaged state is refused, never applied."""
    from ckptio.state import hyper

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    groups = extras.get("param_groups") or []
    if len(groups) == 1:
        hyper.check_groups(opt.param_groups, [{k: v for k, v in groups[0].items() if k in opt.param_groups[0]}],
                           "the parameter groups")
    if extras.get("lr_scheduler") is not None:
        hyper.check(sched, extras["lr_scheduler"], "the LR scheduler state")


def _link_attack(rng: Case, image: dict, tmp: Path) -> bool:
    """One time in six: the pointer file gone and a ``global_step9`` beside the real tag, a link to a copy of it
    outside the run folder (a resume must refuse the link and take the real tag)."""
    pointer = next((p for p in ("latest", "latest_universal") if p in image), None)
    if pointer is None or rng.random() > 1 / 6:
        return False
    value = image.get(pointer)
    tag = value.decode(errors="replace").strip() if isinstance(value, bytes) else ""
    if not tag or "/" in tag or not any(rel.startswith(tag + "/") for rel in image):
        return False  # a damaged pointer: the damage is the input
    del image[pointer]
    outside = tmp / "outside-run"
    materialize({rel[len(tag) + 1:]: v for rel, v in image.items() if rel.startswith(tag + "/")}, outside / tag)
    image["global_step9" + ("_universal" if tag.endswith("_universal") else "")] = Special(("link", str(outside / tag)))
    rng.note(f"{pointer} removed; global_step9 a link to a copy of {tag} outside")
    return True


class DeepSpeed:
    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        self.images, self.objs, self.want = {}, {}, {}
        for stage in ("2", "3", "universal"):
            root = _run(stage)
            self.images[stage] = load_image(root)
            self.objs[stage] = _objects(self.images[stage])
            self.want[stage] = _read(root)

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        stage = rng.choice(["2", "3", "universal"])
        rng.note(f"ZeRO-{stage}" if stage != "universal" else "a universal folder")
        image = dict(self.images[stage])
        kinds = {k: v for k, v in _kinds(image).items() if not k.endswith(".py")}
        touched = set() if rng.pristine else damage(rng, image, kinds, tmp, self.objs[stage], manifest=None)
        linked = not rng.pristine and _link_attack(rng, image, tmp)
        root = tmp / "run"
        _place(rng, image, root, tmp)
        rng.reading = True
        got = _read(root)
        if linked:
            from ckptio.formats.deepspeed import layout

            taken = layout.find_tag_dir(root)
            if taken.is_symlink() or not taken.resolve().is_relative_to(root.resolve()):
                raise WrongResult(f"the resume took {taken}, a link outside the run folder")
        if touched:
            return  # a damaged file that still reads is a valid checkpoint of other values (no checksums to hold it to)
        want = self.want[stage]
        if set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want):
            raise WrongResult("an undamaged DeepSpeed checkpoint read other values")


FAMILIES = {"deepspeed": DeepSpeed()}
