"""Megatron's distributed optimizer state in the legacy layout: ``mp_rank_TT[_PPP]/distrib_optim.pt``.

With ``--use-distributed-optimizer`` and ``--ckpt-format torch``, Megatron-LM writes beside each tensor/pipeline
rank's ``model_optim_rng.pt`` (which keeps only the optimizer's hyper-parameters and step) one
``distrib_optim.pt``: the data-parallel ranks' shards of that rank's fp32 master parameters and Adam moments,
gathered on DP rank 0 into three flat buffers (``param``, ``exp_avg``, ``exp_avg_sq``) that say nothing of
which parameter is where. That follows from the model and the run's arguments, by megatron-core's rules for the
gradient buffer (megatron-core >= 0.6, the format with ``buckets_coalesced``):

* the parameters that are trained, taken in the reverse of the model's order (the order of its state dict);
* each starts at a multiple of 64 elements of the buffer;
* a bucket closes after the parameter that makes it hold at least the bucket size (``--ddp-bucket-size``, or
  ``max(40e6, 1e6 * DP)`` with ``--overlap-grad-reduce``; one bucket without it, and on every pipeline stage but
  the first), and around a tied embedding's copy on a pipeline's first and last stage; its end is padded to a
  multiple of lcm(DP, 128), so that each DP rank owns an equal contiguous part;
* the file keeps each bucket up to its last parameter's end (the padding between parameters included, the
  bucket's tail padding cut), the buckets one after another.

Everything is checked, and refused by name when it does not hold: the file's structure, one buffer of the
model's dtype, its length against the layout, zeros in the padding, and every parameter's fp32 master copy
against the weight in ``model_optim_rng.pt`` (equal after rounding to the model's dtype) — a wrong ordering, a
wrong bucket size or a missing data-parallel shard cannot pass that.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ...errors import CheckpointCorruptError, CheckpointError
from ...storage.confined import Folder

__all__ = ["DISTRIB_OPTIM_FILE", "legacy_reader", "STATE_KEYS", "bucket_size", "dist_optimizer_step", "flat_layout", "optimizer_step",
           "rank_state", "read_common"]

DISTRIB_OPTIM_FILE = "distrib_optim.pt"
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64
"""Every parameter starts at a multiple of this many elements of the gradient buffer."""
SHARED_EMBEDDING = ("embedding.word_embeddings.weight", "output_layer.weight")


def _arg(args: Any, name: str, kind: type, default: Any = None) -> Any:
    """The run's argument ``name`` when it is a ``kind`` (bool or a positive int), ``default`` when absent;
    anything else is refused."""
    value = getattr(args, name, None) if args is not None else None
    if value is None:
        return default
    if kind is bool and isinstance(value, bool) or kind is int and type(value) is int and value > 0:
        return value
    raise CheckpointCorruptError(f"the run's argument {name} is {str(value)[:40]!r}, not a "
                                 f"{'switch' if kind is bool else 'positive integer'}")


def bucket_size(args: Any, pp_rank: int) -> int | None:
    """The gradient buffer's bucket size (elements) on pipeline stage ``pp_rank``, ``None`` for one bucket."""
    if not _arg(args, "overlap_grad_reduce", bool, False) or pp_rank > 0 or \
            _arg(args, "overlap_param_gather_with_optimizer_step", bool, False):
        return None
    size = _arg(args, "ddp_bucket_size", int)
    return size if size is not None else max(40_000_000, 1_000_000 * _arg(args, "data_parallel_size", int, 1))


def flat_layout(params: list[tuple[str, int]], *, size: int | None, shared: frozenset[str] | set[str] = frozenset(),
                ) -> tuple[dict[str, tuple[int, int]], int, list[tuple[int, int]]]:
    """Where each parameter is in the flat buffers of ``distrib_optim.pt``: ``{name: (start, end)}``, the buffers'
    length, and the padding ranges between parameters (which hold zeros). ``params``: (name, numel) in the
    model's order; ``size``: the bucket size or ``None``; ``shared``: parameters that get a bucket of their own.

    Positions in the gradient buffer are computed first (each bucket starts at a multiple of 128 there, so the
    64-element alignment is the same relative to the bucket as in the buffer), then each bucket's span up to its
    last parameter's end is laid after the previous one's."""
    at, bucket_start, members = 0, 0, 0
    buffer_pos: dict[str, tuple[int, int, int]] = {}
    spans: list[tuple[int, int]] = []  # (start, unpadded end) of each bucket in the buffer

    def close(end: int) -> int:
        nonlocal bucket_start, members
        spans.append((bucket_start, end))
        bucket_start = math.ceil(end / 128) * 128 if end % 128 else end  # any multiple of 128 keeps the layout
        members = 0
        return bucket_start

    end = 0
    for name, numel in reversed(params):
        at = math.ceil(at / PARAM_ALIGN) * PARAM_ALIGN
        if name in shared and members:
            at = close(at)
        end = at + numel
        buffer_pos[name] = (at, end, len(spans))
        members += 1
        at = close(end) if (size is not None and end - bucket_start >= size) or name in shared else end
    if members:
        close(end)
    offsets, total = [], 0
    for start, stop in spans:
        offsets.append(total - start)
        total += stop - start
    slots = {name: (a + offsets[b], e + offsets[b]) for name, (a, e, b) in buffer_pos.items()}
    gaps, covered = [], 0
    for a, e in sorted(slots.values()):
        if a > covered:
            gaps.append((covered, a))
        covered = max(covered, e)
    if covered < total:
        gaps.append((covered, total))
    return slots, total, gaps


def optimizer_step(optimizer: Any, where: object, chained: int = 1) -> float | None:
    """The Adam step a rank file's ``optimizer`` entry records (in every parameter group, equal), or ``None``;
    ``chained``: 2 for a run with expert-parallel parameters (the dense and the experts' optimizer, a list)."""
    if isinstance(optimizer, list) and len(optimizer) == chained > 1:
        each = {optimizer_step(o, where) for o in optimizer}
        if len(each) != 1:
            raise CheckpointCorruptError(f"{where}: its chained optimizers record the steps {sorted(map(str, each))}")
        return each.pop()
    if isinstance(optimizer, list) or chained > 1:
        raise CheckpointError(f"{where}: holds the state of {len(optimizer) if isinstance(optimizer, list) else 1} "
                              f"chained optimizers, but the run has {chained} (a second one for expert-parallel "
                              "parameters, exactly when the model has experts)")
    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list):
        return None
    steps: list[Any] = [g.get("step") if isinstance(g, dict) else g for g in groups]
    if not steps or not all(type(s) in (int, float) and math.isfinite(s) and s >= 0 for s in steps) or \
            len(set(steps)) != 1:
        raise CheckpointCorruptError(f"{where}: the optimizer's parameter groups record the steps "
                                     f"{[str(s)[:20] for s in steps[:4]]}, not one step")
    return float(steps[0])


RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
"""The distributed optimizer's torch_dist formats that key Adam's state like the model (``optimizer.state.exp_avg.
<model key>``, whole tensors); its others (``dp_reshardable``...) keep each data-parallel group's flat buckets."""


def dist_optimizer_step(optimizer: Any, where: object) -> tuple[float | None, str | None]:
    """The Adam step of a torch_dist checkpoint's common ``optimizer`` entry — the plain optimizer's
    ``state.common_step``, or the distributed optimizer's parameter groups' step — and the distributed optimizer's
    sharding format (``param_state_sharding_type``; ``None`` for the plain optimizer). A ``ChainedOptimizer``'s
    (a run with expert-parallel parameters: the dense and the experts' optimizer) is ``{0: ..., 1: ...}``, each
    its optimizer's entry, which must agree."""
    if not isinstance(optimizer, dict):
        return None, None
    if optimizer and all(type(k) is int for k in optimizer):
        if sorted(optimizer) != list(range(len(optimizer))) or len(optimizer) < 2:
            raise CheckpointCorruptError(f"{where}: the optimizer entry is keyed {sorted(optimizer)[:4]}, not the "
                                         "chained optimizers 0, 1...")
        each = {dist_optimizer_step(optimizer[n], where) for n in range(len(optimizer))}
        if len(each) != 1:
            raise CheckpointCorruptError(f"{where}: its chained optimizers record the steps and formats "
                                         f"{sorted(map(str, each))[:4]}")
        return each.pop()
    kind = optimizer.get("param_state_sharding_type")
    kind = None if kind is None else str(kind)[:60]
    state = optimizer.get("state")
    if isinstance(state, dict) and "common_step" in state:
        step = state["common_step"]
        if callable(getattr(step, "load", None)) and getattr(step, "numel", None) == 1:  # safe_pickle's LazyTensor
            step = step.load()
        step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        if type(step) not in (int, float) or not math.isfinite(step) or step < 0:
            raise CheckpointCorruptError(f"{where}: the optimizer's common_step is {str(step)[:40]!r}, not a step")
        return float(step), kind
    return (optimizer_step(optimizer, where) if kind in RESHARDABLE else None), kind


def read_common(root: Folder) -> tuple[dict[str, Any], list[str], float | None, str | None]:
    """A torch_dist checkpoint's ``common.pt`` (only its pickle is read, so a large or sparse file costs no memory;
    of its tensors, only the step), its placeholder classes, Adam's step and the distributed optimizer's sharding
    format (:func:`dist_optimizer_step`)."""
    from .. import safe_pickle as megatron_pickle

    where = root.display("common.pt")
    common, placeholders, handle = megatron_pickle.open_lazy(root, "common.pt")
    try:
        common = common if isinstance(common, dict) else {}
        step, sharding = dist_optimizer_step(common.get("optimizer"), where)
    finally:
        handle.close()
    args = common.get("args")
    if args is not None and not isinstance(args, dict) and not hasattr(args, "__dict__"):
        raise CheckpointCorruptError(f"{where}: its args are a {type(args).__name__}, not the run's arguments")
    return common, placeholders, step, sharding


def _states(obj: Any, where: object, chained: int) -> list[Any]:
    """The optimizers' states a ``distrib_optim.pt`` holds: one, or with expert-parallel parameters the list of
    megatron-core's ``ChainedOptimizer.save_parameter_state`` (the dense optimizer's, ``None`` on the ranks that are
    not its data-parallel rank 0, then the experts')."""
    if chained == 1:
        if isinstance(obj, list):
            raise CheckpointError(f"{where}: holds the state of {len(obj)} chained optimizers, but the model has no "
                                  "expert-parallel parameters (which alone have an optimizer of their own)")
        return [obj]
    if not isinstance(obj, list) or len(obj) != chained:
        raise CheckpointCorruptError(f"{where}: holds the state of {len(obj) if isinstance(obj, list) else 1} "
                                     f"optimizer(s), not the {chained} of a run with expert-parallel parameters "
                                     "(the dense one and the experts')")
    return obj


def _buffers(obj: Any, where: object, count: int) -> list[tuple[Any, dict[str, Any]]]:
    """The ``count`` gradient buffers of one optimizer's state (one per model chunk that has such parameters, in
    chunk order): each ``(param dtype, {param, exp_avg, exp_avg_sq, numel_unpadded})``."""
    if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
        raise CheckpointError(f"{where}: not the distributed optimizer's state in the format of megatron-core >= 0.6 "
                              "(no buckets_coalesced); convert it with Megatron-LM's "
                              "--ckpt-convert-update-legacy-dist-opt-format first")
    buffers = {k: v for k, v in obj.items() if k != "buckets_coalesced"}
    if list(buffers) != list(range(count)):
        raise CheckpointCorruptError(f"{where}: holds the gradient buffers {sorted(map(str, buffers))[:4]}, but the "
                                     f"rank's {count} model chunk(s) have {count} (one each, every parameter of one "
                                     "dtype)")
    out = []
    for n in range(count):
        by_dtype = buffers[n]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise CheckpointCorruptError(f"{where}: buffer {n} is not one (param dtype, grad dtype) entry")
        (key, entry), = by_dtype.items()
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], torch.dtype)):
            raise CheckpointCorruptError(f"{where}: buffer {n} is keyed {str(key)[:60]}, not (param dtype, grad dtype)")
        if not isinstance(entry, dict) or set(entry) != {*STATE_KEYS, "numel_unpadded"}:
            held = sorted(map(str, entry))[:6] if isinstance(entry, dict) else type(entry).__name__
            raise CheckpointCorruptError(f"{where}: buffer {n} holds {held}, not {list(STATE_KEYS)} and numel_unpadded")
        out.append((key[0], entry))
    return out


def _read_buffer(entry: dict[str, Any], where: object, model: dict[str, torch.Tensor], *, size: int | None,
                 shared: set[str], held_by: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{"param"|"exp_avg"|"exp_avg_sq": {name: tensor shaped like the weight}}`` of one gradient buffer's entry,
    laid out from its parameters ``model`` (in the rank file's order), each master copy checked against the
    weight ``held_by`` holds."""
    from .. import safe_pickle as megatron_pickle

    slots, total, gaps = flat_layout([(k, v.numel()) for k, v in model.items()], size=size, shared=shared)
    if type(entry["numel_unpadded"]) is not int or entry["numel_unpadded"] != total:
        raise CheckpointCorruptError(f"{where}: numel_unpadded is {str(entry['numel_unpadded'])[:20]}, but its "
                                     f"{len(model)} parameters lay out to {total} elements (bucket size {size})")
    flat = {}
    for key in STATE_KEYS:
        t = entry[key]
        if not isinstance(t, megatron_pickle.LazyTensor) or t.dtype != torch.float32 or t.shape != (total,):
            shape = list(t.shape) if isinstance(t, megatron_pickle.LazyTensor) else type(t).__name__
            raise CheckpointCorruptError(f"{where}: {key} is {shape} {getattr(t, 'dtype', '')}, not a float32 "
                                         f"buffer of {total} elements (a data-parallel shard missing or extra?)")
        flat[key] = t
    for key, t in flat.items():
        for a, e in gaps:
            if t.read(a, e - a).any():
                raise CheckpointCorruptError(f"{where}: {key} holds values in the padding at elements {a}..{e}: "
                                             "its layout is not the one the model and the run's arguments give")
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in STATE_KEYS}
    for name, (a, e) in slots.items():
        weight = model[name]
        for key, t in flat.items():
            out[key][name] = t.read(a, e - a).view(weight.shape)
        if not torch.equal(out["param"][name].to(weight.dtype), weight):
            raise CheckpointCorruptError(f"{where}: the fp32 master copy of {name} is not the weight {held_by} "
                                         "holds: the buffers are not laid out as the model and the run's arguments "
                                         f"say (bucket size {size})")
    return out


_EXPERT = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.(\d+)\.")
"""An expert's parameter in a merged rank model (:func:`ckptio.formats.megatron.moe.rank_model`): its global index."""


def _expert(name: str) -> int:
    m = _EXPERT.match(name)
    return int(m.group(1)) if m else -1


def rank_state(root: Folder, rank_dirs: list[str], models: list[dict[str, torch.Tensor]], *, sizes: list[int | None],
               shared: set[str]) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Per model chunk, ``{"param"|"exp_avg"|"exp_avg_sq": {name: tensor shaped like the weight}}`` of one
    tensor/pipeline rank, from the ``distrib_optim.pt`` of its folder (of each expert-parallel rank's folder,
    ``rank_dirs``, with experts) and its chunks' weights (``models``, in the rank file's order; the experts under
    their global index). ``sizes``: each chunk's bucket size.

    The dense optimizer keeps one buffer per chunk, in EP rank 0's file; the experts' optimizer, in each EP rank's
    file, one per chunk with experts, of that rank's experts (``e * E/EP`` on) in their order."""
    from .. import safe_pickle as megatron_pickle

    ep = len(rank_dirs)
    experts = [{n for n in m if _EXPERT.match(n)} for m in models]
    held = {_expert(n) for names in experts for n in names}
    if (ep > 1) != bool(held) or len(held) % ep:
        raise CheckpointCorruptError(f"{root.display(rank_dirs[0])}: {len(held)} experts over {ep} expert-parallel "
                                     "rank folder(s)")
    local = len(held) // ep if held else 0
    chained = 2 if held else 1
    dense = [{k: v for k, v in m.items() if k not in names} for m, names in zip(models, experts)]
    out: list[dict[str, dict[str, torch.Tensor]]] = [{key: {} for key in STATE_KEYS} for _ in models]
    for e, rank_dir in enumerate(rank_dirs):
        rel = f"{rank_dir}/{DISTRIB_OPTIM_FILE}"
        where = root.display(rel)
        obj, _, handle = megatron_pickle.open_lazy(root, rel)
        try:
            states = _states(obj, where, chained)
            parts = [(states[0], dense, [v for v, m in enumerate(dense) if m])] if e == 0 else []
            if e == 0 and states[0] is None:
                raise CheckpointCorruptError(f"{where}: holds no state of the dense parameters (written by their "
                                             "data-parallel rank 0, whose folder is expert-parallel rank 0's)")
            if held:
                mine = [{k: v for k, v in m.items() if k in names and local * e <= _expert(k) < local * (e + 1)}
                        for m, names in zip(models, experts)]
                parts.append((states[1], mine, [v for v, m in enumerate(mine) if m]))
            for state, chunk_models, chunks in parts:
                for (dtype, entry), v in zip(_buffers(state, where, len(chunks)), chunks):
                    dtypes = {t.dtype for t in chunk_models[v].values()}
                    if dtypes != {dtype}:
                        raise CheckpointCorruptError(f"{where}: a buffer is for {dtype}, but the weights of its model "
                                                     f"chunk are {sorted(map(str, dtypes))}")
                    got = _read_buffer(entry, where, chunk_models[v], size=sizes[v], shared=shared,
                                       held_by=str(root.display(rank_dir)))
                    for key in STATE_KEYS:
                        out[v][key].update(got[key])
        finally:
            handle.close()
    for v, model in enumerate(models):  # back in the model's order
        out[v] = {key: {name: out[v][key][name] for name in model} for key in STATE_KEYS}
    return out


def legacy_reader(root: Folder, files: dict[tuple[int, int], str],
                  experts: dict[tuple[int, int], list[str]] | None = None) -> Any:
    """A reader of one rank's distributed optimizer state for :func:`read_legacy`, or ``None`` when no rank
    folder has a ``distrib_optim.pt``; refuses a folder without one when others have it. ``experts``: each
    (TP, PP) rank's folder of every expert-parallel rank (:func:`ckptio.formats.megatron.moe.rank_dirs`)."""
    dirs = {rank: [rel.rsplit("/", 1)[0]] if experts is None else experts[rank] for rank, rel in files.items()}
    every = [d for ds in dirs.values() for d in ds]
    have = {d for d in every if root.kind(f"{d}/{DISTRIB_OPTIM_FILE}") is not None}
    if not have:
        return None
    if len(have) != len(every):
        missing = sorted(set(every) - have)
        raise CheckpointCorruptError(f"{root.display()}: the rank folders {missing[:4]} have no {DISTRIB_OPTIM_FILE}, "
                                     "which the others have")

    def read(rank: tuple[int, int], obj: dict[str, Any], models: list[dict[str, torch.Tensor]], pp: int,
             info: dict[str, Any]) -> list[dict[str, dict[str, torch.Tensor]]]:
        rel = files[rank]
        args = obj.get("args") if obj.get("args") is not None else info.get("args")
        step = optimizer_step(obj.get("optimizer"), root.display(rel), 2 if len(dirs[rank]) > 1 else 1)
        if step is None:
            raise CheckpointCorruptError(f"{root.display(rel)}: records no optimizer step beside its "
                                         f"{DISTRIB_OPTIM_FILE}")
        if info.setdefault("optimizer_step", step) != step:
            raise CheckpointCorruptError(f"{root.display(rel)}: the optimizer's step is {step}, another rank's "
                                         f"{info['optimizer_step']}")
        try:  # Megatron-LM's get_model: bucketing only in the first model chunk (each chunk its own DDP)
            sizes = [bucket_size(args, rank[1]) if v == 0 else None for v in range(len(models))]
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{root.display(rel)}: {exc}") from exc
        tied = getattr(args, "untie_embeddings_and_output_weights", None) is not True and pp > 1
        return rank_state(root, dirs[rank], models, sizes=sizes, shared=set(SHARED_EMBEDDING) if tied else set())

    return read
