"""A DeepSpeed checkpoint's fp32 master weights and Adam moments, one parameter at a time, without DeepSpeed.

Every file goes through the one read gate (:func:`ckptio.formats.safe_pickle.open_lazy`): only the pickle
is read when a file is opened, DeepSpeed's own classes become named stand-ins (:data:`STANDINS`; any other class is
refused by name), and each tensor is a range of the file that is read when a parameter needs it.

How the ranks' partitions make whole parameters (what DeepSpeed's ``zero_to_fp32`` does, here per parameter):

* **stages 1 and 2**: each rank's ``single_partition_of_fp32_groups[g]`` is an equal slice of parameter group
  ``g`` flattened; the slices of ranks 0..N-1 end to end hold the group's parameters in ``param_shapes[g]`` order,
  then ``group_paddings[g]`` elements of padding. Adam's ``exp_avg``/``exp_avg_sq`` (``base_optimizer_state``)
  are laid out the same way;
* **stage 3**: each parameter is split on its own: every rank holds ``ceil(numel / N)`` elements of it (the last
  padded), the parameters one after the other in ``fp32_flat_groups`` (sub-groups end to end);
* **universal** (``ds_to_universal``): ``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` and ``step.pt``
  hold each parameter whole.

Frozen parameters (``frozen_param_shapes``) come from ``frozen_param_fragments``, buffers from the model-states
file's ``module``, tied parameters (``shared_params``) from the parameter they share. Sizes are checked against
``param_shapes`` before a parameter is read: a partition of the wrong size is an error naming its file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointCorruptError, CheckpointError, ConfigError
from ...storage.confined import Folder
from ...storage.parse import parsing
from ..common import TensorInfo, dtype_name
from ..safe_pickle import LazyTensor, Placeholder, open_lazy
from . import ranks
from .layout import MODEL_FILES

__all__ = ["STANDINS", "ZeroCheckpoint", "MOMENTS"]

STANDINS = frozenset({
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
})
"""The DeepSpeed classes a checkpoint's pickles name, each read as an inert stand-in that keeps its arguments."""
MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: object) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointCorruptError(f"{where}: no {key!r} entry")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CheckpointCorruptError(f"{where}: {key!r} is a {type(value).__name__}, not a {getattr(kind, '__name__', kind)}")
    return value


def _shape(value: Any, where: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and 0 <= n < 1 << 40 for n in value) or len(value) > 16:
        raise CheckpointCorruptError(f"{where}: param_shapes[{name!r}] is not a shape ({str(value)[:80]})")
    return tuple(value)


def _lazy(value: Any, where: object, what: str) -> LazyTensor:
    if not isinstance(value, LazyTensor):
        raise CheckpointCorruptError(f"{where}: {what} is a {type(value).__name__}, not a tensor")
    return value


class _Flat:
    """Tensors end to end, read as one flat vector (a rank's sub-groups; a group's rank partitions)."""

    def __init__(self, parts: list[LazyTensor]) -> None:
        self.parts = parts
        self.numel = sum(p.numel for p in parts)

    def read(self, start: int, count: int) -> torch.Tensor:
        out, at = [], 0
        for part in self.parts:
            lo, hi = max(start, at), min(start + count, at + part.numel)
            if lo < hi:
                out.append(part.read(lo - at, hi - lo))
            at += part.numel
        if sum(t.numel() for t in out) != count:
            raise CheckpointCorruptError(f"elements {start}..{start + count} past the end of {self.numel}")
        return out[0] if len(out) == 1 else torch.cat(out)


def _inner(osd: Any, stage: int) -> dict[str, Any]:
    """The wrapped optimizer's own state dict (``state``, ``param_groups``) inside a rank's ZeRO state (an elastic
    ZeRO-1/2 checkpoint keeps a list of per-group states instead: that is its ``state``)."""
    inner = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") if isinstance(osd, dict) else None
    return inner if isinstance(inner, dict) else {"state": inner} if isinstance(inner, list) else {}


def _entry(state: Any, i: int) -> Any:
    """Entry ``i`` of an optimizer's ``state`` (a dict by index, or a list), else ``None``."""
    if isinstance(state, dict):
        return state.get(i)
    return state[i] if isinstance(state, list) and i < len(state) else None


def _step_value(value: Any, where: object) -> float:
    if isinstance(value, LazyTensor):
        if value.numel != 1:
            raise CheckpointCorruptError(f"{where}: Adam's step holds {value.numel} values")
        return float(value.read().item())
    if type(value) in (int, float):
        return float(value)
    raise CheckpointCorruptError(f"{where}: Adam's step is a {type(value).__name__}")


def _parsed(method: Any) -> Any:
    """A reader of the checkpoint's saved objects, inside :class:`parsing` of the checkpoint: whatever an object of the
    wrong type or shape makes it raise becomes an error naming the checkpoint."""
    import functools

    @functools.wraps(method)
    def wrapper(self: "ZeroCheckpoint", *args: Any, **kwargs: Any) -> Any:
        with parsing(self.path):
            return method(self, *args, **kwargs)

    return wrapper


class ZeroCheckpoint:
    """One DeepSpeed checkpoint (a tag folder): its parameters' fp32 masters and Adam moments, read on demand."""

    def __init__(self, tag_dir: Path) -> None:
        self.path = tag_dir
        self.folder = Folder(tag_dir)
        self._handles: list[Any] = []
        self._fragments: list[dict[str, Any]] | None = None
        self.optim: list[tuple[dict[str, Any], object]] = []
        self.flats: dict[str, list[Any]] = {}
        """Per kind (``fp32``, a moment): the flat vectors a parameter's elements are read from (per group, stages
        1-2; per rank, stage 3)."""
        self.where: dict[str, tuple[int, int]] = {}
        """Per parameter: its group and offset (stages 1-2), or its offset in every rank's flat vector (stage 3)."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------- opening
    def _load(self, rel: str) -> Any:
        obj, _, handle = open_lazy(self.folder, rel, standins=STANDINS)
        self._handles.append(handle)
        return obj

    def _open(self) -> None:
        model_file = next((n for n in MODEL_FILES if self.folder.kind(n) == "file"), None)
        if model_file is None:
            raise CheckpointCorruptError(f"{self.path}: no {' or '.join(MODEL_FILES)}")
        where = self.folder.display(model_file)
        self.meta = meta = self._load(model_file)
        with parsing(where):
            self._read_meta(meta, where)
        names = {e.name for e in self.folder.listdir()}
        self.universal = "zero" in names and not any(_OPTIM.fullmatch(n) for n in names)
        if self.universal:
            self.stage = int(self.config_stage or 0)
            return
        ranks: dict[int, str] = {}
        for n in names:
            m = _OPTIM.fullmatch(n)
            if m and int(m.group(2)) == 0:
                ranks[int(m.group(1))] = n
        if not ranks:
            raise CheckpointCorruptError(f"{self.path}: no *_optim_states.pt files (a stage-0 checkpoint, or the "
                                         "optimizer state was not saved): the fp32 master weights are not there")
        missing = [r for r in range(self.world) if r not in ranks]
        if missing:
            want = ranks.get(0, "zero_pp_rank_0_mp_rank_00_optim_states.pt").replace("rank_0_", f"rank_{missing[0]}_", 1)
            raise CheckpointCorruptError(f"{self.path / want}: missing (the checkpoint was saved on {self.world} "
                                         f"data-parallel ranks; found the files of ranks {sorted(ranks)})")
        extra = sorted(r for r in ranks if r >= self.world)
        if extra:
            raise CheckpointCorruptError(f"{self.folder.display(ranks[extra[0]])}: rank {extra[0]} of a checkpoint "
                                         f"saved on {self.world} ranks (dp_world_size)")
        for r in range(self.world):
            obj = self._load(ranks[r])
            where = self.folder.display(ranks[r])
            self.optim.append((_get(obj, "optimizer_state_dict", dict, where), where))
        self.stage = self._stage()
        with parsing(self.path):
            (_layout_zero3 if self.stage == 3 else _layout_zero12)(self)

    def _read_meta(self, meta: Any, where: object) -> None:
        shapes = _get(meta, "param_shapes", (list, dict), where)
        groups = shapes if isinstance(shapes, list) else [shapes]
        self.groups: list[dict[str, tuple[int, ...]]] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        for g in groups:
            if not isinstance(g, dict):
                raise CheckpointCorruptError(f"{where}: param_shapes holds a {type(g).__name__}")
            group = {}
            for name, shape in g.items():
                if not isinstance(name, str) or name in self.shapes:
                    raise CheckpointCorruptError(f"{where}: param_shapes names {str(name)[:80]!r} twice or not as text")
                group[name] = self.shapes[name] = _shape(shape, where, name)
            self.groups.append(group)
        mp = meta.get("mp_world_size", 1)
        if mp != 1:
            raise ConfigError(f"{where}: saved with model parallelism (mp_world_size {mp}); ckptio reads DeepSpeed "
                              "checkpoints of data parallelism (ZeRO) only")
        self.world = _get(meta, "dp_world_size", int, where)
        if not 1 <= self.world <= 1 << 16:
            raise CheckpointCorruptError(f"{where}: dp_world_size {self.world}")
        self.frozen = {n: _shape(s, where, n) for n, s in (meta.get("frozen_param_shapes") or {}).items()}
        shared = meta.get("shared_params") or {}
        self.shared = {k: v for k, v in shared.items() if isinstance(k, str) and isinstance(v, str)}
        if len(self.shared) != len(shared) or any(v not in self.shapes and v not in self.frozen for v in self.shared.values()):
            raise CheckpointCorruptError(f"{where}: shared_params names a parameter param_shapes does not have")
        module = meta.get("module") or {}
        buffers = meta.get("buffer_names") or []
        self.buffers = {n: _lazy(module.get(n), where, f"buffer {n!r}") for n in buffers}
        self.module_dtypes = {n: v.dtype for n, v in module.items() if isinstance(v, LazyTensor)}
        self.global_steps = meta.get("global_steps") if type(meta.get("global_steps")) is int else None
        config: dict[str, Any] = meta["ds_config"] if isinstance(meta.get("ds_config"), dict) else {}
        zero: dict[str, Any] = config["zero_optimization"] if isinstance(config.get("zero_optimization"), dict) else {}
        self.config_stage = zero.get("stage") if type(zero.get("stage")) is int else None
        self.scheduler = meta.get("lr_scheduler") if isinstance(meta.get("lr_scheduler"), dict) else None

    def _stage(self) -> int:
        osd, where = self.optim[0]
        stage = osd.get("zero_stage")
        if isinstance(stage, Placeholder):
            stage = stage.args[0] if stage.args else None
        if type(stage) is not int:
            stage = self.config_stage
        if stage not in (1, 2, 3):
            raise CheckpointCorruptError(f"{where}: ZeRO stage {stage!r} (ckptio reads stages 1, 2 and 3)")
        return stage

    # --------------------------------------------------------------------------------------------- reading
    @_parsed
    def index(self) -> dict[str, TensorInfo]:
        out = {n: TensorInfo(s, "float32") for n, s in self.shapes.items()}
        out.update({n: TensorInfo(s, dtype_name(self.module_dtypes.get(n, torch.float32))) for n, s in self.frozen.items()})
        out.update({n: TensorInfo(b.shape, dtype_name(b.dtype)) for n, b in self.buffers.items()})
        return out  # a tied parameter (``shared_params``) once, under the name it is trained as; read() takes both

    @_parsed
    def has_moments(self) -> bool:
        if self.universal:
            return all(self.folder.kind(f"zero/{self._safe(n)}/{m}.pt") == "file" for n in self.shapes for m in MOMENTS)
        return all(self.flats.get(m) and all(f is not None for f in self.flats[m]) for m in MOMENTS)

    @_parsed
    def read(self, name: str, what: str = "fp32") -> torch.Tensor:
        """Parameter ``name`` whole: its fp32 master (``what="fp32"``) or an Adam moment; a frozen parameter, buffer or
        tied parameter by its name."""
        name = self.shared.get(name, name)
        if name in self.buffers:
            return self.buffers[name].load()
        if name in self.frozen:
            return self._frozen(name)
        if name not in self.shapes:
            raise CheckpointError(f"{self.path}: no parameter {name!r}")
        shape = self.shapes[name]
        numel = math.prod(shape)
        if self.universal:
            return self._universal(name, what, shape)
        flats = self.flats.get(what) or []
        if self.stage == 3:
            if len(flats) != self.world:
                raise CheckpointError(f"{self.path}: no {what} state saved")
            part = math.ceil(numel / self.world)
            _, offset = self.where[name]
            whole = torch.cat([f.read(offset, part) for f in flats]) if part else torch.empty(0)
            return whole[:numel].view(shape)
        g, offset = self.where[name]
        if g >= len(flats) or flats[g] is None:
            raise CheckpointError(f"{self.path}: no {what} state saved")
        return flats[g].read(offset, numel).view(shape)

    def _frozen(self, name: str) -> torch.Tensor:
        fragments = self.meta.get("frozen_param_fragments") or {}
        where = self.folder.display(MODEL_FILES[1] if self.stage == 3 else MODEL_FILES[0])
        shape = self.frozen[name]
        if self.stage != 3:
            t = _lazy(fragments.get(name), where, f"frozen parameter {name!r}")
            if t.numel != math.prod(shape):
                raise CheckpointCorruptError(f"{where}: frozen parameter {name!r} holds {t.numel} elements, not {shape}")
            return t.read().view(shape)
        part = math.ceil(math.prod(shape) / self.world)
        pieces = []
        for r, fragments in enumerate(self._rank_fragments()):
            where = self.folder.display(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
            t = _lazy(fragments.get(name), where, f"frozen parameter {name!r}")
            if t.numel != part:
                raise CheckpointCorruptError(f"{where}: frozen {name!r} holds {t.numel}, not {part}")
            pieces.append(t.read())
        return torch.cat(pieces)[: math.prod(shape)].view(shape)

    def _rank_fragments(self) -> list[dict[str, Any]]:
        """Stage 3: every rank's ``frozen_param_fragments``, its model-states file opened once (the first time a
        frozen parameter is read) and kept open for the tensors' reads: one handle per file, whatever the number of
        frozen parameters."""
        if self._fragments is None:
            out = []
            for r in range(self.world):
                rel = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                obj = self.meta if r == 0 else self._load(rel)
                fragments = obj.get("frozen_param_fragments") if isinstance(obj, dict) else None
                out.append(fragments if isinstance(fragments, dict) else {})
            self._fragments = out
        return self._fragments

    def _safe(self, name: str) -> str:
        if not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
            raise CheckpointCorruptError(f"{self.path}: a parameter named {name[:80]!r} cannot name a folder of zero/")
        return name

    def _universal(self, name: str, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        rel = f"zero/{self._safe(name)}/{what}.pt"
        obj = self._load(rel)
        t = _lazy(obj.get("param") if isinstance(obj, dict) else obj, self.folder.display(rel), "the parameter")
        if t.numel != math.prod(shape):
            raise CheckpointCorruptError(f"{self.folder.display(rel)}: holds {t.shape}, param_shapes says {shape}")
        out = t.read().view(shape)
        self._handles.pop().close()
        return out

    @_parsed
    def adam_step(self) -> float:
        where: object
        state: Any
        if self.universal:
            first = f"zero/{self._safe(next(iter(self.shapes)))}/step.pt"
            if self.folder.kind(first) == "file":  # stages 1-2: a step per parameter
                return _step_value(self._load(first), self.folder.display(first))
            osd, where = self._load("zero/optimizer_state.pt"), self.folder.display("zero/optimizer_state.pt")
            state = _inner(osd, 3)  # stage 3: one step
        else:
            osd, where = self.optim[0]
            state = _inner(osd, self.stage)
        entry = _entry(state.get("state"), 0)
        if not isinstance(entry, dict) or "step" not in entry:
            raise CheckpointCorruptError(f"{where}: no Adam step")
        return _step_value(entry["step"], where)

    @_parsed
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's hyper-parameters per group as DeepSpeed saved them (``params`` left out)."""
        if self.universal:
            if self.folder.kind("zero/optimizer_state.pt") is None:
                return []
            obj = self._load("zero/optimizer_state.pt")
            groups = (obj.get("param_groups") if isinstance(obj, dict) else None) or _inner(obj, 3).get("param_groups")
        else:
            groups = _inner(self.optim[0][0], self.stage).get("param_groups")
        plain = (int, float, bool, str, type(None), tuple)
        return [{k: v for k, v in g.items() if k != "params" and isinstance(v, plain)}
                for g in (groups if isinstance(groups, list) else []) if isinstance(g, dict)]

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        self._handles, self._fragments = [], None


def _layout_zero12(ck: "ZeroCheckpoint") -> None:
    """Stages 1-2: the offset of each parameter in its group's flat vector, the ranks' partitions end to end."""
    ck.flats = {"fp32": [], **{m: [] for m in MOMENTS}}
    ck.where = {}
    last, last_where = ck.optim[-1]
    for g, group in enumerate(ck.groups):
        parts = []
        for osd, where in ck.optim:
            flats = _get(osd, "single_partition_of_fp32_groups", list, where)
            if g >= len(flats):
                raise CheckpointCorruptError(f"{where}: {len(flats)} partitions, param_shapes has {len(ck.groups)} groups")
            parts.append(_lazy(flats[g], where, f"the fp32 partition of group {g}"))
        sizes = {p.numel for p in parts}
        need = sum(math.prod(s) for s in group.values())
        pads = last.get("group_paddings")
        pad = pads[g] if isinstance(pads, list) and g < len(pads) and type(pads[g]) is int else 0
        if len(sizes) != 1 or need + pad != sum(p.numel for p in parts):
            raise CheckpointCorruptError(
                f"{last_where}: the fp32 partitions of group {g} hold {sorted(p.numel for p in parts)} elements on "
                f"the {ck.world} ranks; param_shapes needs {need} (+{pad} padding) in equal parts")
        for r, (osd, where) in enumerate(ck.optim):  # each file holds its rank's partition, as it says
            ranks.check_slices(osd, where, r, ck.world, g, group, parts[r].numel)
        ck.flats["fp32"].append(_Flat(parts))
        offset = 0
        for name, shape in group.items():
            ck.where[name] = (g, offset)
            offset += math.prod(shape)
        for m in MOMENTS:
            ck.flats[m].append(_moment_flat(ck, g, m, [p.numel for p in parts]))


def _moment_flat(ck: "ZeroCheckpoint", g: int, moment: str, sizes: list[int]) -> Any:
    parts = []
    for (osd, where), size in zip(ck.optim, sizes):
        entry = _entry(_inner(osd, ck.stage).get("state"), g)
        if not isinstance(entry, dict) or moment not in entry:
            return None  # not Adam, or no optimizer state saved
        part = _lazy(entry[moment], where, f"{moment} of group {g}")
        if part.numel != size:
            raise CheckpointCorruptError(f"{where}: {moment} of group {g} holds {part.numel} elements, its fp32 "
                                         f"partition {size}")
        parts.append(part)
    return _Flat(parts)


def _layout_zero3(ck: "ZeroCheckpoint") -> None:
    """Stage 3: every rank holds ``ceil(numel / N)`` elements of each parameter, one parameter after another."""
    ck.flats = {"fp32": [], **{m: [] for m in MOMENTS}}
    ck.where = {}
    moments: dict[str, Any] = {}
    offset = 0
    for group in ck.groups:
        for name, shape in group.items():
            ck.where[name] = (0, offset)
            offset += math.ceil(math.prod(shape) / ck.world)
    for osd, where in ck.optim:
        ranks.check_count(osd, where, ck.world, None)
        flats = [_lazy(t, where, "an fp32 flat group") for t in _get(osd, "fp32_flat_groups", list, where)]
        flat = _Flat(flats)
        if flat.numel != offset:
            raise CheckpointCorruptError(f"{where}: the fp32 flat groups hold {flat.numel} elements; param_shapes "
                                         f"needs {offset} on each of {ck.world} ranks")
        ck.flats["fp32"].append(flat)
        state = _inner(osd, 3).get("state")
        for m in MOMENTS:
            entries = [_entry(state, i) for i in range(len(flats))]
            if not all(isinstance(e, dict) and m in e for e in entries):
                moments[m] = None  # not Adam, or no optimizer state saved
                continue
            moment = _Flat([_lazy(e[m], where, f"{m} of sub-group {i}") for i, e in enumerate(entries)
                            if isinstance(e, dict)])
            if [p.numel for p in moment.parts] != [p.numel for p in flats]:
                raise CheckpointCorruptError(f"{where}: {m} holds {[p.numel for p in moment.parts]} elements per "
                                             f"sub-group, the fp32 groups {[p.numel for p in flats]}")
            if moments.get(m, True) is not None:
                moments.setdefault(m, []).append(moment)
    for m in MOMENTS:
        ck.flats[m] = moments.get(m) or []
    params = [(n, math.prod(s), ck.where[n][1]) for n, s in ck.shapes.items()]
    ranks.check_padding({m: ck.flats[m] for m in MOMENTS if ck.flats[m]}, [w for _, w in ck.optim], params, ck.world)
