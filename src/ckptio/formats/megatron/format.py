"""Megatron-LM and Megatron-Core checkpoints, read as one Hugging Face Llama, Qwen2, Qwen3 (or MoE, :mod:`.moe`) model.

Layouts, detected from the folder (a run folder with ``latest_checkpointed_iteration.txt``, or one
iteration folder ``iter_NNNNNNN``/``release``):

* **legacy** (Megatron-LM ``--ckpt-format torch``): ``mp_rank_TT/`` (tensor parallel only) or
  ``mp_rank_TT_PPP/`` (with pipeline stages), each with ``model_optim_rng.pt``: that rank's shard of the
  weights under per-layer names, the layer index restarting at 0 on every stage. Read with
  :mod:`ckptio.formats.safe_pickle` (no Megatron needed, no code run).
* **distributed** (Megatron-Core ``torch_dist``, also NeMo 2.0's ``weights/``): ``metadata.json``,
  ``common.pt`` and a DCP folder of whole tensors, the layers stacked along a leading dimension.

Both become the Megatron-Core GPT names of one whole model (``decoder.layers.{i}.self_attention.
linear_qkv.weight``...), tensor-parallel shards merged along each parameter's split dimension —
column-parallel ``linear_qkv`` (whole query groups per rank), embeddings and output layer on dim 0,
row-parallel ``linear_proj`` and ``linear_fc2`` on dim 1, and ``linear_fc1`` whose every shard holds
``[gate part; up part]`` regathered as ``[gate; up]`` — with pipeline stages renumbered into one layer
sequence and the vocabulary padding cut off. The ``megatron-to-llama`` naming converter
(:mod:`ckptio.formats.naming`) then splits the fused tensors into Llama's (Qwen2's: the same names, with
``linear_qkv.bias`` split into the q/k/v biases; Qwen3's: with ``q_layernorm``/``k_layernorm`` as ``q_norm``/
``k_norm``). The Hugging Face config comes from the run's ``args`` (or a ``config.json`` beside the checkpoint): a
Qwen2 when they have ``add_qkv_bias``, a Qwen3 with ``qk_layernorm``, else a Llama
(:func:`ckptio.formats.megatron.config.family`), and the biases or norms must be in every layer exactly then.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.confined import Folder
from ...storage.parse import json_object, within_one_read  # within_one_read: each file walked once per read
from ..common import TensorInfo, dtype_name
from .config import _arg, args_from_files, hf_config
from .layout import (GLOBAL_SPLIT, ITERATION_FILE, LAYER_SPLIT, NEMO_RANK_FILE, RANK_FILE, VOCAB_KEYS,
                     _LAYER, _rank_files, carry_side_files, iteration_folder, layout_of)
from ..registry import Format, Opened, WriteOptions, register
from . import moe, shapes
from .merge import _held_in, _kind, _merge_chunk

_CHAINED = re.compile(r"^chained_\d+\.(?=optimizer\.)")
"""The prefix of a chained optimizer's tensors in torch_dist (megatron-core's ``ChainedOptimizer``, its ``N``-th
optimizer, unless the save's metadata says ``chained_optim_avoid_prefix``)."""


def _strip(key: str) -> str:
    for prefix in ("module.", "model."):
        key = key.removeprefix(prefix)
    return key


# ------------------------------------------------------------------------------------------------ the layouts
def _rank_file(root: Folder, rel: str) -> tuple[dict[str, Any], list[str], list[dict[str, torch.Tensor]]]:
    """A legacy rank file's object, its placeholder classes and its model's weights (canonical prefixes stripped,
    ``_extra_state`` dropped): one state dict, or one per model chunk with virtual pipeline stages
    (:mod:`~ckptio.formats.megatron.vpp`). Read lazily: only the pickle and the model's tensors, never the whole
    file at once (a rank file can be as large as the rank's share of the model)."""
    from .. import safe_pickle as megatron_pickle
    from .vpp import chunk_models

    obj, placeholders, handle = megatron_pickle.open_lazy(root, rel)
    try:
        where = root.display(rel)
        if isinstance(obj, dict) and rel.endswith(NEMO_RANK_FILE) and not isinstance(obj.get("model"), dict):
            obj = {"model": obj}  # a NeMo archive's rank file is the state dict itself
        chunks = chunk_models(obj, where) if isinstance(obj, dict) else []
        if not chunks or not all(isinstance(c, dict) for c in chunks):
            raise CheckpointCorruptError(f"{where}: no 'model' state dict")
        models = []
        for chunk in chunks:
            named = [k for k in chunk if not isinstance(k, str)]
            if named:
                raise CheckpointCorruptError(f"{where}: model entries named {str(named[0])[:40]!r}, not a string")
            model = {_strip(k): v for k, v in chunk.items() if not k.endswith("_extra_state")}
            bad = [k for k, v in model.items() if not isinstance(v, megatron_pickle.LazyTensor)]
            if bad:
                raise CheckpointCorruptError(f"{where}: non-tensor model entries {bad[:3]}")
            models.append({k: v.load() for k, v in model.items()})
        return obj, placeholders, models
    finally:
        handle.close()


def _check_ranks(args: Any, tp: int, pp: int, root: Folder) -> None:
    """The rank folders found are the TP x PP the run's arguments record (a missing last rank is not a smaller run)."""
    for name, found in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        value = _arg(args, name)
        if type(value) is int and value != found:
            raise CheckpointCorruptError(f"{root.display()}: the run's {name} is {value}, but its rank folders are "
                                         f"for {found}: rank folders are missing or extra")


@within_one_read
def read_legacy(folder: Path, *, optimizer: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model (canonical names) and the run's ``args``/``iteration`` of a legacy iteration folder.

    ``optimizer``: also the distributed optimizer's state of every parameter (fp32 master copy and Adam moments,
    from each rank folder's ``distrib_optim.pt``), merged like the weights: ``info["optimizer"]`` maps
    ``param``/``exp_avg``/``exp_avg_sq`` to such a whole model, and ``info["optimizer_step"]`` is Adam's step
    (both absent when the folders have no ``distrib_optim.pt``)."""
    files = _rank_files(folder)
    experts = moe.rank_dirs(folder, RANK_FILE)  # with expert parallelism: each (TP, PP) rank's file of every EP rank
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(s for _, s in files)
    root = Folder(folder)
    info: dict[str, Any] = {"tp": tp, "pp": pp, "placeholders": set()}
    from .distrib_optim import legacy_reader
    from .vpp import check_chunks

    optim = legacy_reader(root, files, experts) if optimizer else None
    merged: dict[tuple[int, int], Any] = {}  # (chunk, stage): _merge_chunk's
    for stage in range(pp):
        chunks: dict[int, list[tuple[Any, dict[str, dict[str, torch.Tensor]]]]] = {}
        held: dict[int, Callable[[str], str]] = {}
        for t in range(tp):
            rel = files[(t, stage)]
            held_in: list[dict[str, str]] = []  # with EP, each chunk's experts' files
            obj, placeholders, models = _rank_file(root, rel) if experts is None else \
                moe.rank_models(root, [f"{d}/{rel.rsplit('/', 1)[1]}" for d in experts[(t, stage)]], _rank_file,
                                held_in)
            where = root.display(rel)
            info["placeholders"].update(placeholders)
            if t == 0 and stage == 0:
                info["args"], info["iteration"] = obj.get("args"), obj.get("iteration")
                _check_ranks(info["args"], tp, pp, root)
                moe.check_legacy(info["args"], tp, root.display(rel))
            check_chunks(info, len(models), where)
            states = optim((t, stage), obj, models, pp, info) if optim is not None else None
            for v, model in enumerate(models):
                parts = {"": model, **(states[v] if states is not None else {})}
                chunks.setdefault(v, []).append((where, parts))
                if t == 0:
                    held[v] = _held_in(folder, rel, held_in[v] if held_in else {}, None if "model" in obj else v)
        for v, shards in chunks.items():
            merged[(v, stage)] = _merge_chunk(shards, held[v])
    sets = _numbered(merged, info)
    if len(sets) > 1:
        info["optimizer"] = {k: v for k, v in sets.items() if k}
    return sets[""], info


def _numbered(merged: dict[tuple[int, int], Any], info: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The merged chunks (``(chunk, stage)``: :func:`_merge_chunk`'s) as one model of globally numbered layers, per
    part (``""`` the weights); ``info["origins"]`` where each weight was read, for a refusal of its shape."""
    sets: dict[str, dict[str, torch.Tensor]] = {"": {}}
    offset = 0
    info["origins"] = {}
    for key in sorted(merged):  # layer order: chunk 0 over every stage, then chunk 1... (one chunk: stage order)
        at, chunk_parts, layers, origins = merged[key]
        # layer indices restart at 0 on each stage (chunk); one already numbered globally is kept as is
        base = 0 if layers and layers[0] == offset else offset
        for part, tensors in chunk_parts.items():
            for (local_name, layer), tensor in tensors.items():
                name = local_name if layer is None else f"decoder.layers.{base + layer}.{local_name}"
                if part == "" and name in sets[""]:
                    raise CheckpointCorruptError(f"{at}: {name} is held by two pipeline stages")
                sets.setdefault(part, {})[name] = tensor
                info["origins"][name] = origins[(local_name, layer)]
        offset = base + (layers[-1] + 1 if layers else 0)
    return sets


class _DistModel:
    """A Megatron-Core distributed checkpoint's weights, layers unstacked (each stacked tensor read once)."""

    def __init__(self, folder: Path, prefix: str = "") -> None:
        """``prefix``: read the tensors under it instead of the weights (``optimizer.state.exp_avg.``: Adam's
        first moments, keyed like the weights)."""
        from ..dcp import format as dcp_format
        from .distrib_optim import read_common

        if not (folder / "common.pt").is_file() and (folder / "weights").is_dir():
            folder = folder / "weights"
        root = Folder(folder)
        meta = json_object(root.read_bytes("metadata.json", max_size=1 << 20), root.display("metadata.json"))
        if meta.get("sharded_backend") != "torch_dist":
            raise CheckpointError(f"{root.display('metadata.json')}: sharded backend {meta.get('sharded_backend')!r}; "
                                  "ckptio reads torch_dist checkpoints")
        common, placeholders, step, sharding = read_common(root)
        self.info: dict[str, Any] = {"args": common.get("args"), "iteration": common.get("iteration"),
                                     "placeholders": set(placeholders), "optimizer_step": step,
                                     "optimizer_sharding": sharding}
        self.source = dcp_format.DCPSource(root)
        self._stacked: dict[str, torch.Tensor] = {}
        self.index: dict[str, TensorInfo] = {}
        self._where: dict[str, tuple[str, int | tuple[int, int] | None]] = {}
        for key, ti in self.source.index().items():
            bare = _CHAINED.sub("", key, count=1)  # a chained optimizer's tensors, without chained_optim_avoid_prefix
            if prefix and not bare.startswith(prefix):
                continue
            name = _strip(bare[len(prefix):])
            if name.startswith("decoder.layers.") and (name[len("decoder.layers."):] in LAYER_SPLIT or
                                                       moe.per_layer(name[len("decoder.layers."):])):
                for i in range(ti.shape[0]):
                    self._add(f"decoder.layers.{i}.{name[len('decoder.layers.'):]}", TensorInfo(ti.shape[1:], ti.dtype),
                              key, i)
            elif moe.dist_key(name[len("decoder.layers."):]) is not None:  # [layers, experts, ...]
                for i in range(ti.shape[0]):
                    for j in range(ti.shape[1]):
                        self._add(f"decoder.layers.{i}.mlp.experts.{j}.{moe.dist_key(name[len('decoder.layers.'):])}",
                                  TensorInfo(ti.shape[2:], ti.dtype), key, (i, j))
            elif name in GLOBAL_SPLIT:
                self._add(name, ti, key, None)
            elif not name.startswith(("optimizer.", "rng_state")):
                _kind(name, root.display())  # refuses, naming the parameter
        self.info["layers"] = 1 + max((int(_LAYER.match(k).group(1)) for k in self.index if _LAYER.match(k)),  # type: ignore[union-attr]
                                      default=-1)

    def _add(self, name: str, info: TensorInfo, key: str, layer: int | tuple[int, int] | None) -> None:
        if name in self.index:
            raise CheckpointCorruptError(f"{self.source.folder}: {key} and {self._where[name][0]} both hold {name}")
        self.index[name] = info
        self._where[name] = (key, layer)

    def origin(self, name: str) -> str:
        """Where ``name`` is read: its torch_dist tensor (and its index there when it stacks layers or experts)."""
        key, layer = self._where[name]
        return f"torch_dist tensor {key}" + ("" if layer is None else str([layer] if isinstance(layer, int) else
                                                                          list(layer)))

    def read(self, name: str) -> torch.Tensor:
        key, layer = self._where[name]
        if layer is None:
            return self.source.read(key)
        if key not in self._stacked:
            self._stacked[key] = self.source.read(key)
        return self._stacked[key][layer]


# ------------------------------------------------------------------------------------------------ the source
class MegatronSource:
    """A Megatron checkpoint's whole model under Megatron-Core GPT names, vocabulary padding cut off."""

    @within_one_read
    def __init__(self, path: Path, *, args: Any = None, prefix: str = "",
                 legacy: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None) -> None:
        """``args``: the model's Megatron arguments when the checkpoint does not carry them (a NeMo config);
        ``prefix``: another set of parameter-shaped tensors of a distributed checkpoint (optimizer moments);
        ``legacy``: a legacy checkpoint's tensors and info as :func:`read_legacy` gave them (one of its sets of
        optimizer state, read once for all of them)."""
        self.run = path
        self.folder = iteration_folder(path)
        self.layout = layout_of(self.folder)
        if prefix and self.layout != "dist":
            raise CheckpointError(f"{path}: only distributed (torch_dist) checkpoints are read beyond the weights")
        if self.layout == "legacy":
            tensors, self.info = legacy if legacy is not None else read_legacy(self.folder)
            self._index = {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in tensors.items()}
            self._read = tensors.__getitem__
            self.info["layers"] = 1 + max((int(m.group(1)) for m in map(_LAYER.match, tensors) if m), default=-1)
            self._origin = self.info["origins"].__getitem__
        elif self.layout == "dist":
            dist = _DistModel(self.folder, prefix)
            self.info, self._index, self._read, self._origin = dist.info, dist.index, dist.read, dist.origin
        else:
            raise CheckpointError(f"{path}: not a Megatron checkpoint (no mp_rank_* folders, no metadata.json and "
                                  "common.pt)")
        named = re.fullmatch(r"iter_(\d+)", self.folder.name)  # the folder's number is the one Megatron resumes at
        if named:
            self.info["iteration"] = int(named.group(1))
        args = self.info.get("args") if args is None else args
        if args is None:
            args = args_from_files(self.folder, self.run)
        rows = self._index["embedding.word_embeddings.weight"].shape[0] if "embedding.word_embeddings.weight" in \
            self._index else 0
        self.config = hf_config(args, self.folder, self.info["layers"], rows)
        shapes.check(self._index, args, self.config, self.info["layers"], self.folder, self._origin)  # names, shapes
        if self.config["tie_word_embeddings"]:  # a last-stage copy of the tied embedding is not a weight of its own
            self._index.pop("output_layer.weight", None)
        self.vocab = self.config["vocab_size"]
        for key in VOCAB_KEYS:
            if key in self._index:
                shape = self._index[key].shape  # of at least vocab rows (shapes.check)
                self._index[key] = TensorInfo((self.vocab, *shape[1:]), self._index[key].dtype)

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        if key not in self._index:
            raise CheckpointError(f"{self.folder}: no tensor {key!r}")
        t = self._read(key)
        return t[: self.vocab] if key in VOCAB_KEYS else t

    def close(self) -> None:
        """Nothing is held open between reads."""


def _as_llama(source: MegatronSource) -> Any:
    from ..naming import _RenamedSource, get_converter

    naming = {"mixtral": "megatron-to-mixtral", "qwen2_moe": "megatron-to-qwen2moe", "qwen3_moe": "megatron-to-qwen2moe"}.get(
        str(source.config.get("model_type")), "megatron-to-llama")
    return _RenamedSource(source, get_converter(naming), source.config)


class MegatronFormat(Format):
    """Megatron-LM legacy (``mp_rank_*``) and Megatron-Core ``torch_dist`` checkpoints, read as HF Llama/Qwen2/Qwen3."""

    name = "megatron"
    summary = ("Megatron-LM / Megatron-Core checkpoint (mp_rank_* or torch_dist), read as Hugging Face "
               "Llama/Qwen2/Qwen3/Mixtral")
    priority = 25

    def detect(self, path: Path) -> bool:
        try:
            return path.is_dir() and ((path / ITERATION_FILE).is_file() or layout_of(path) is not None)
        except OSError:
            return False

    def open(self, path: Path) -> Opened:
        import json

        source = MegatronSource(path)
        renamed = _as_llama(source)
        extras = Path(tempfile.mkdtemp(prefix="ckptio-megatron-"))
        (extras / "config.json").write_text(json.dumps(source.config, indent=2))
        carry_side_files(path, extras)  # generation config and tokenizer, when the run folder has them
        iteration = source.info.get("iteration")
        renamed.folder = extras
        return Opened(self.name, renamed, extras, step=iteration if isinstance(iteration, int) else 0,
                      cleanup=lambda: shutil.rmtree(extras, ignore_errors=True))

    @within_one_read
    def open_adam(self, path: Path) -> tuple[float, dict[str, Any]] | None:
        folder = iteration_folder(path)
        if layout_of(folder) == "legacy":  # the distributed optimizer's distrib_optim.pt files, when present
            _, info = read_legacy(folder, optimizer=True)
            state = info.pop("optimizer", None)
            if state is None:
                return None  # without the distributed optimizer the files key Adam's state by position in groups
            sources = {m: MegatronSource(path, legacy=(state[m], dict(info))) for m in ("exp_avg", "exp_avg_sq")}
            return float(info["optimizer_step"]), {m: _as_llama(source) for m, source in sources.items()}
        if layout_of(folder) != "dist":
            return None
        moments = {m: MegatronSource(path, prefix=f"optimizer.state.{m}.") for m in ("exp_avg", "exp_avg_sq")}
        step, sharding = moments["exp_avg"].info.get("optimizer_step"), moments["exp_avg"].info["optimizer_sharding"]
        if sharding is not None and not moments["exp_avg"].index():
            raise CheckpointError(f"{path}: the distributed optimizer's state is saved in its {sharding!r} format "
                                  "(each data-parallel group's flat buckets); ckptio reads its fully_reshardable "
                                  "format (Megatron-LM's --dist-ckpt-optim-fully-reshardable)")
        if not moments["exp_avg"].index() or step is None:
            return None
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if type(step) not in (int, float) or not 0 <= step < float("inf"):
            raise CheckpointCorruptError(f"{moments['exp_avg'].folder}: common.pt records the optimizer's step as "
                                         f"{type(step).__name__} {str(step)[:40]!r}, not a number")
        return float(step), {m: _as_llama(source) for m, source in moments.items()}

    @within_one_read
    def open_masters(self, path: Path) -> Any:
        folder = iteration_folder(path)
        if layout_of(folder) != "legacy":
            return None
        tensors, info = read_legacy(folder, optimizer=True)
        state = info.pop("optimizer", None)
        if state is None or all(t.dtype == torch.float32 for t in tensors.values()):
            return None  # no distributed optimizer's state, or fp32 weights that are the masters themselves
        return _as_llama(MegatronSource(path, legacy=(state["param"], info)))

    def write(self, opened: Opened, source: Any, out: Path, options: WriteOptions) -> None:
        from . import write as megatron_write

        from .optim_write import open_adam

        extra, adam = options.extra, open_adam(opened)  # a ckptio checkpoint's Adam state goes along
        try:
            megatron_write.write(source, opened.extras, out, tp=extra.get("tp"), pp=extra.get("pp"),
                                 layout=extra.get("layout", "dist"), iteration=opened.step,
                                 divisible_by=extra.get("divisible_by"), like=extra.get("like"), vpp=extra.get("vpp"),
                                 adam=adam, optimizer=extra.get("optimizer") or "plain", ep=extra.get("ep"))
        finally:
            if adam is not None:
                adam.close()

    @within_one_read
    def describe(self, path: Path) -> dict[str, Any]:
        from dataclasses import asdict

        from ..common import summarize_index

        source = MegatronSource(path)
        args, info = source.info.get("args"), source.info
        tp = info.get("tp") or _arg(args, "tensor_model_parallel_size")
        pp = info.get("pp") or _arg(args, "pipeline_model_parallel_size")
        folder = Folder(source.folder)
        files = {rel: e.size for rel, e in folder.walk_files() if e.kind == "file"}
        layout = {"legacy": "Megatron-LM legacy (mp_rank_*)", "dist": "Megatron-Core torch_dist"}[source.layout or ""]
        return {"path": str(path), "kind": self.name, "label": self.summary, "iteration": info.get("iteration"),
                "weights": f"{source.folder.name}: {layout}, saved on TP={tp} PP={pp}" + (
                    f" EP={_arg(args, 'expert_model_parallel_size')}" if moe.experts_of(args) else ""),
                "layout": source.layout, "tp": tp, "pp": pp, "layers": info.get("layers"),
                "architecture": f"{source.config['architectures'][0]} (Megatron GPT)", "config": source.config,
                "placeholders": sorted(info.get("placeholders", ())),
                "tensors": asdict(summarize_index(_as_llama(source).index())), "files": files,
                "total_bytes": sum(files.values())}


register(MegatronFormat())
