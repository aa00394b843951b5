"""The fuzz families of Megatron checkpoints (see ``fuzz_readers.py`` for the oracle).

``megatron_mixtral``: a mixture of experts with expert parallelism (:class:`MegatronMixtral`); ``megatron_qwen2moe``
the same with a Qwen2-MoE (a gated shared expert and q/k/v biases, ``megatron_fixture.py --family qwen2moe``).

``megatron_distopt``, Megatron's distributed optimizer in the legacy layout:
a run folder written by the real megatron-core (``tests/megatron_fixture.py --dp 2``: TP=2 x DP=2, three steps of
its ``DistributedOptimizer``, ``model_optim_rng.pt`` and ``distrib_optim.pt`` per TP rank; built once, kept in the
fuzzer's scratch folder), damaged one to three files at a time — three times in four a ``distrib_optim.pt`` —
as bytes, pickles, whole entries and the saved object itself, then read as a resume does: the format's
detection, the weights, and Adam's moments, master copies and step. An untouched folder must read exactly what
the pristine one holds; a damaged one that still reads must still have every fp32 master copy equal to its
weight (the reader's own promise).

``megatron_vpp``: the legacy rank files of a run with virtual pipeline stages and the distributed optimizer
(``megatron_distopt_chunks.py --pp 2 --vpp 2 --dp 2``: ``model0``/``model1`` in each, ``distrib_optim.pt`` with one
buffer per chunk), damaged as above, three times in four a rank file or a ``distrib_optim.pt``, read as a conversion
and a resume do (detection, every chunk's weights, Adam's state). ``megatron_mixtral`` also damages the legacy
files of an EP=2 run of the distributed optimizer (``distrib_optim.pt``: the dense and the experts' chained states),
and a PP=2 x VPP=2 x EP=2 one's legacy files and torch_dist folders (``megatron_distopt_chunks.py --dist``: with and
without ``chained_N.`` prefixes). ``megatron_dist_distopt``: a torch_dist checkpoint of
the DistributedOptimizer in its ``fully_reshardable`` format (``--dp 2 --dist-formats
fully_reshardable,dp_reshardable``, test_megatron_dist_distopt.py's run, of which the first is read: the step in
``common.pt``'s parameter groups, the moments in the DCP files), three times in four ``common.pt`` or ``.metadata``
damaged, read for its weights and Adam's moments and step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from fuzz_frameworks import _fixed_dir, _kinds, _objects, _place, damage
from fuzz_kit import Case, WrongResult, adam_tensors, load_image

HERE = Path(__file__).resolve().parent
ITER = "iter_0000003"


def _built(name: str, sub: str, script: str, *args: str) -> Path:
    """The folder ``tests/<script> ARGS --out FOLDER`` writes (once per run of the fuzzer); under pytest the test
    session's shared one (``tests/fixture_cache.py``: the test files build the same runs; it is only read here)."""
    if os.environ.get("CKPTIO_FIXTURE_CACHE"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        from fixture_cache import built

        return built(script, *args, timeout=600)
    out = _fixed_dir(name)
    if not (out / sub / "latest_checkpointed_iteration.txt").is_file():
        cmd = [sys.executable, str(HERE.parent / "tests" / script), *args, "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"the megatron-core run failed: {r.stderr[-2000:]}")
    return out


def _run() -> Path:
    return _built("megatron-distopt", "legacy", "megatron_fixture.py", "--tp", "2", "--dp", "2", "--iteration", "3",
                  "--hidden", "48", "--bucket", "6192", "--family", "llama") / "legacy"


def _read(root: Path) -> dict[str, torch.Tensor]:
    from ckptio.formats import registry
    from ckptio.formats.megatron.format import read_legacy
    from ckptio.formats.megatron.layout import iteration_folder

    fmt = registry.detect(root)
    got: dict[str, torch.Tensor] = {}
    got.update(adam_tensors(fmt, root))
    model, info = read_legacy(iteration_folder(root), optimizer=True)
    got.update({f"model/{k}": v for k, v in model.items()})
    for name, master in info.get("optimizer", {}).get("param", {}).items():
        if not torch.equal(master.to(model[name].dtype), model[name]):
            raise WrongResult(f"the fp32 master copy of {name} read is not its weight")
        got[f"param/{name}"] = master
    return got


class MegatronDistOpt:
    def prepare(self) -> None:
        if hasattr(self, "image"):
            return
        root = _run()
        self.image = load_image(root)
        self.objs = _objects(self.image)
        self.want = _read(root)

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        image = dict(self.image)
        kinds = _kinds(image)
        if rng.random() < 0.75:  # mostly the new file kind
            kinds = {k: v for k, v in kinds.items() if k.endswith("distrib_optim.pt")}
        touched = set() if rng.pristine else damage(rng, image, kinds, tmp, self.objs, manifest=None)
        root = tmp / "run"
        _place(rng, image, root, tmp)
        rng.reading = True
        got = _read(root)
        if touched:
            return  # a damaged file that still reads is a checkpoint of other values (no checksums to hold it to)
        if set(got) != set(self.want) or any(not torch.equal(got[k], v) for k, v in self.want.items()):
            raise WrongResult("an undamaged Megatron checkpoint read other values")


def _fixture(name: str, sub: str, *args: str, script: str = "megatron_fixture.py") -> Path:
    return _built(name, sub, script, *args) / sub


def _read_any(root: Path) -> dict[str, torch.Tensor]:
    """Detection, the weights as a conversion reads them, and Adam's state as a resume does."""
    from ckptio.formats import registry
    from ckptio.formats.megatron.format import MegatronSource

    fmt = registry.detect(root)
    got: dict[str, torch.Tensor] = dict(adam_tensors(fmt, root))
    source = MegatronSource(root)
    got.update({f"model/{k}": source.read(k) for k in source.index()})
    return got


class _Damaged(MegatronDistOpt):
    """A megatron-core run's folder, damaged mostly in the files whose names end with one of ``favour``."""

    def __init__(self, run: Any, favour: tuple[str, ...]) -> None:
        self.run, self.favour = run, favour

    def prepare(self) -> None:
        if hasattr(self, "image"):
            return
        root = self.run()
        self.image = load_image(root)
        self.objs = _objects(self.image)
        self.want = _read_any(root)

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        image = dict(self.image)
        kinds = _kinds(image)
        if rng.random() < 0.75:
            kinds = {k: v for k, v in kinds.items() if k.endswith(self.favour)} or kinds
        touched = set() if rng.pristine else damage(rng, image, kinds, tmp, self.objs, manifest=None)
        root = tmp / "run"
        _place(rng, image, root, tmp)
        rng.reading = True
        got = _read_any(root)
        if touched:
            return
        if set(got) != set(self.want) or any(not torch.equal(got[k], v) for k, v in self.want.items()):
            raise WrongResult("an undamaged Megatron checkpoint read other values")



def _mixtral_run(family: str = "mixtral") -> Path:
    """A Mixtral (or another ``family`` of experts) written by megatron-core at TP=1 PP=2 EP=2 (``mp_rank_TT_PPP_EEE``
    rank folders and torch_dist)."""
    return _built(f"megatron-{family}", "torch_dist", "megatron_fixture.py", "--family", family, "--tp", "1", "--pp",
                  "2", "--ep", "2")


def _read_mixtral(root: Path, layout: str) -> dict[str, torch.Tensor]:
    """What converting ``root`` (one layout's run folder) reads: every tensor of the Mixtral, and Adam's state."""
    from ckptio.formats import registry

    fmt = registry.detect(root)
    opened = fmt.open(root)
    try:
        got = {f"model/{k}": opened.source.read(k) for k in opened.source.index()}
    finally:
        opened.close()
    if layout != "legacy":  # torch_dist's moments, or the distributed optimizer's distrib_optim.pt
        got.update(adam_tensors(fmt, root))
    return got


class MegatronMixtral:
    """A megatron-core Mixtral's legacy expert-parallel rank files or its torch_dist folder (one of them per input),
    damaged one to three files at a time, then read as a conversion does (every expert, and Adam's moments of the
    torch_dist one); an untouched folder must read exactly what the pristine one holds. ``family``: the fixture's
    (``mixtral``, or ``qwen2moe`` with its shared expert)."""

    def __init__(self, family: str = "mixtral") -> None:
        self.family = family

    def prepare(self) -> None:
        if hasattr(self, "images"):
            return
        out = _mixtral_run(self.family)
        self.images = {layout: load_image(out / layout) for layout in ("legacy", "torch_dist")}
        roots = {layout: out / layout for layout in self.images}
        if self.family == "mixtral":  # and the distributed optimizer's chained states of an EP run
            roots["legacy_distopt"] = _fixture("megatron-mixtral-distopt", "legacy", "--family", "mixtral", "--ep",
                                               "2", "--dp", "2", script="megatron_distopt_chunks.py")
            # and of a PP=2 x VPP=2 x EP=2 run: model0/model1 in each rank file, a buffer per chunk in each state,
            # torch_dist with and without the chained optimizers' chained_N. prefixes
            vppep = _fixture("megatron-mixtral-vppep", "legacy", "--family", "mixtral", "--pp", "2",
                             "--vpp", "2", "--ep", "2", "--dp", "2", "--dist", script="megatron_distopt_chunks.py")
            for sub in ("legacy", "torch_dist", "torch_dist_chained"):
                roots[f"{sub}_vppep"] = vppep.parent / sub
            for layout in ("legacy_distopt", *(f"{sub}_vppep" for sub in ("legacy", "torch_dist",
                                                                          "torch_dist_chained"))):
                self.images[layout] = load_image(roots[layout])
        self.objs = {layout: _objects(image) for layout, image in self.images.items()}
        self.want = {layout: _read_mixtral(roots[layout], layout) for layout in self.images}

    def __call__(self, rng: Case, tmp: Path) -> None:
        self.prepare()
        rng.reading = False
        layout = rng.choice(sorted(self.images))
        image = dict(self.images[layout])
        touched = set() if rng.pristine else damage(rng, image, _kinds(image), tmp, self.objs[layout], manifest=None)
        root = tmp / "run"
        _place(rng, image, root, tmp)
        rng.reading = True
        got = _read_mixtral(root, layout)
        if touched:
            return
        want = self.want[layout]
        if set(got) != set(want) or any(not torch.equal(got[k], v) for k, v in want.items()):
            raise WrongResult(f"an undamaged Megatron {self.family} ({layout}) read other values")


FAMILIES = {
    "megatron_distopt": MegatronDistOpt(),
    "megatron_mixtral": MegatronMixtral(),
    "megatron_qwen2moe": MegatronMixtral("qwen2moe"),
    "megatron_vpp": _Damaged(lambda: _fixture("megatron-vpp-distopt", "legacy", "--pp", "2", "--vpp", "2", "--dp", "2",
                                              "--bucket", "6192", script="megatron_distopt_chunks.py"),
                             ("model_optim_rng.pt", "distrib_optim.pt")),
    "megatron_dist_distopt": _Damaged(lambda: _fixture("megatron-dist-distopt", "torch_dist_fully_reshardable",
                                                       "--tp", "2", "--dp", "2", "--iteration", "3", "--hidden", "48",
                                                       "--dist-formats", "fully_reshardable,dp_reshardable"),
                                      ("common.pt", ".metadata")),
}
