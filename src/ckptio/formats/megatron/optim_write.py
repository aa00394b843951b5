"""Adam's state written into a Megatron-Core export, for megatron-core's optimizer to load and train on.

``ckptio convert STEP_DIR OUT --to megatron`` from a ckptio checkpoint whose optimizer is Adam/AdamW adds to the
torch_dist iteration folder what Megatron-LM's ``save_checkpoint`` writes for its (non-distributed) fp32 optimizer
(``FP32Optimizer.sharded_state_dict``):

* the sharded tensors ``optimizer.state.exp_avg.<model key>`` and ``optimizer.state.exp_avg_sq.<model key>``,
  shaped, stacked and padded like the model's own (the moments are renamed, fused and split exactly like the
  weights: fusing q/k/v and [gate; up] only moves elements; the padding rows are zeros);
* in ``common.pt``: ``optimizer`` = ``{"state": {"common_step": step}, "param_groups": [...]}`` with megatron-core's
  two parameter groups (``_get_param_groups``' standard ones: weight decay on the matrices, ``wd_mult`` 0 for the
  norms and biases), each with the source's Adam hyper-parameters (betas, eps...) and megatron's keys
  (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``...), and ``opt_param_scheduler`` with a
  constant schedule at the source's learning rate and weight decay, ``num_steps`` = step × the run's global batch
  size (Megatron-LM counts samples; 1 without ``--like``).

With ``optimizer="distributed"`` (``--megatron-optimizer distributed``) the ``optimizer`` entry is the
``DistributedOptimizer``'s in its ``fully_reshardable`` format instead: the step in every parameter group,
``param_state_sharding_type``, and the fp32 master copies (the weights) as ``optimizer.state.param.<key>``.

Refused by name: an optimizer that is not Adam (no moments for some parameter), steps that differ between
parameters, hyper-parameters that differ inside one of megatron's groups, and reduced-precision weights (a bf16 or
fp16 model trains with megatron's ``Float16OptimizerWithFloat16Params``, whose fp32 master copies ckptio does not
write). In the legacy layout, with the plain optimizer each rank file's ``optimizer`` is the
fp32 optimizer's torch state dict, Adam's state keyed by position (:func:`legacy_optimizer`); with the distributed
optimizer it holds the groups and the step, and a ``distrib_optim.pt`` beside it the fp32 master copies and moments
in megatron-core's flat buffers (:func:`legacy_distributed`, loaded by its ``load_parameter_state``); and each its
``opt_param_scheduler``. With virtual pipeline stages the positions run over the rank's model chunks in chunk order
and ``distrib_optim.pt`` holds a buffer per chunk; a tied embedding over pipeline stages has its copy on the last
stage (``output_layer.weight``, a parameter of megatron-core's there, its state the embedding's).

A mixture of experts (a Mixtral) goes as megatron-core's ``get_megatron_optimizer`` chains it: a second optimizer
over the expert-parallel parameters (its own ``is_expert_parallel`` groups), ``common.pt``'s ``optimizer`` the two
states ``{0: dense, 1: experts}``, their tensors keyed without a ``chained_N.`` prefix as ``content_metadata``'s
``chained_optim_avoid_prefix`` says (Megatron-LM's saves set it); in a legacy rank file (of each expert-parallel
rank), the list of the two optimizers' entries (:func:`legacy_state`), with virtual pipeline stages each over the
rank's model chunks (the distributed ones a buffer per chunk that has their parameters).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import torch

from ...errors import CheckpointError, ConfigError
from ..common import TensorInfo

__all__ = ["MOMENTS", "SourceAdam", "open_adam"]

MOMENTS = ("exp_avg", "exp_avg_sq")
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_TORCH_ONLY = ("params", "param_names", "initial_lr")


class _Moment:
    """One moment of every optimized parameter, as a source keyed like the weights (a Hugging Face model)."""

    def __init__(self, source: Any, moment: str, index: dict[str, TensorInfo], folder: Any) -> None:
        self.source, self.moment, self._index, self.folder = source, moment, index, folder

    def index(self) -> dict[str, TensorInfo]:
        return dict(self._index)

    def read(self, key: str) -> torch.Tensor:
        t = self.source.read(f"state.{key}.{self.moment}")
        return t.to(torch.float32).reshape(self._index[key].shape)


class SourceAdam:
    """A ckptio checkpoint's Adam state, keyed by the model's (Hugging Face) names."""

    def __init__(self, step_dir: Any, weights: Any) -> None:
        from ..training_state import open_saved_optimizer, per_parameter

        self.where = step_dir
        self.source, values, self.scheduler = open_saved_optimizer(step_dir)
        state, self.hyper = per_parameter(values) if self.source is not None else ({}, {})
        index = weights.index()
        saved = self.source.index() if self.source is not None else {}
        missing = [n for n in index if not all(f"state.{n}.{m}" in saved for m in MOMENTS)]
        if missing:
            self.close()
            raise CheckpointError(f"{step_dir}: the optimizer is not Adam/AdamW with state for every parameter (no "
                                  f"exp_avg/exp_avg_sq for {missing[:3]}); a Megatron export holds Adam's moments")
        steps = {float(self._step(n, state)) for n in index}
        if len(steps) != 1:
            self.close()
            raise CheckpointError(f"{step_dir}: the parameters' Adam steps differ ({sorted(steps)[:4]}); Megatron "
                                  "keeps one step for all")
        self.step = steps.pop()
        self.moments = {m: _Moment(self.source, m, index, getattr(weights, "folder", None)) for m in MOMENTS}

    def _step(self, name: str, state: dict[str, dict[str, Any]]) -> float:
        value = state.get(name, {}).get("step")
        value = self.source.read(f"state.{name}.step") if value is None else value
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def open_adam(opened: Any) -> SourceAdam | None:
    """The Adam state of a ckptio step directory being converted, or ``None`` when it holds no optimizer."""
    from ..training_state import open_saved_optimizer

    if getattr(opened, "step_dir", None) is None:
        return None
    source, _, _ = open_saved_optimizer(opened.step_dir)
    if source is None:
        return None
    source.close()
    return SourceAdam(opened.step_dir, opened.source)


def _megatron_group(name: str, shape: tuple[int, ...]) -> int:
    """0: megatron-core's default group (weight decay); 1: its ``wd_mult`` 0 group (1-dim parameters, biases)."""
    return 1 if len(shape) == 1 or name.endswith(".bias") else 0


def param_groups(adam: SourceAdam, names: dict[str, tuple[int, ...]], expert: bool = False) -> list[dict[str, Any]]:
    """megatron-core's two parameter groups for the Hugging Face parameters ``names`` (name: shape), with the
    source's hyper-parameters (equal inside each group, else refused) and megatron's group keys; ``expert``: the
    groups of the experts' optimizer (``is_expert_parallel``), only those that have parameters (megatron-core's
    ``_get_param_groups`` makes a group per kind of parameter present)."""
    groups: list[dict[str, Any] | None] = [None, None]
    for name, shape in names.items():
        which = _megatron_group(name, shape)
        hyper = {k: v for k, v in adam.hyper.get(name, {}).items() if k not in _TORCH_ONLY}
        held = groups[which]
        if held is None:
            groups[which] = hyper
        elif held != hyper:
            raise CheckpointError(f"{adam.where}: {name} has other Adam hyper-parameters ({_differ(held, hyper)}) "
                                  f"than the other parameters of megatron's {'no-' if which else ''}weight-decay group")
    out = []
    for which, given in enumerate(groups):
        if expert and given is None:
            continue
        hyper = dict(given if given is not None else (groups[1 - which] or {}))
        lr = float(hyper.get("lr", 0.0))
        out.append({**hyper, "wd_mult": 0.0 if which else 1.0, "lr_mult": 1.0, "is_expert_parallel": expert,
                    "is_decoupled_lr": False, "default_config": True, "max_lr": lr, "min_lr": lr})
    return out


def _is_expert(name: str) -> bool:
    """A Hugging Face MoE parameter that megatron-core's experts' optimizer holds (not the router)."""
    return ".experts." in name


def _differ(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {str(b.get(k))[:20]} vs {str(a.get(k))[:20]}" for k in keys[:3])


def scheduler_state(groups: list[dict[str, Any]], step: float, args: argparse.Namespace) -> dict[str, Any]:
    """Megatron's ``opt_param_scheduler``: a constant schedule at the source's learning rate and weight decay."""
    lr, wd = float(groups[0].get("lr", 0.0)), float(groups[0].get("weight_decay", 0.0))
    batch = getattr(args, "global_batch_size", None) or 1
    return {"max_lr": lr, "min_lr": lr, "lr_warmup_steps": 0, "num_steps": int(step) * int(batch),
            "lr_decay_style": "constant", "lr_decay_steps": max(1, int(step) * int(batch)), "start_wd": wd,
            "end_wd": wd, "wd_incr_style": "constant", "wd_incr_steps": max(1, int(step) * int(batch))}


def common_entries(adam: SourceAdam, args: argparse.Namespace, layout: str, kind: str = "plain") -> dict[str, Any]:
    """What ``common.pt`` gets besides the model's entries: ``optimizer`` and ``opt_param_scheduler``; ``kind``
    ``"distributed"``: the ``optimizer`` entry of megatron-core's ``DistributedOptimizer`` in its
    ``fully_reshardable`` format (the step in every parameter group; the fp32 master copies, here the weights,
    go beside the moments as ``optimizer.state.param.<key>``)."""
    if kind not in ("plain", "distributed"):
        raise ConfigError(f"--megatron-optimizer {kind!r}: use 'plain' (megatron-core's FP32Optimizer) or "
                          "'distributed' (its DistributedOptimizer, fully_reshardable format)")
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        raise ConfigError(f"{adam.where}: a {'bf16' if args.bf16 else 'fp16'} model trains in Megatron with "
                          "Float16OptimizerWithFloat16Params (fp32 master copies beside the weights), which ckptio "
                          "does not write; convert with --dtype fp32 to carry the optimizer")
    names = {n: tuple(i.shape) for n, i in adam.moments["exp_avg"].index().items()}
    chained = [param_groups(adam, {n: s for n, s in names.items() if not _is_expert(n)})]
    if any(map(_is_expert, names)):  # megatron-core chains a second optimizer over the expert-parallel parameters
        chained.append(param_groups(adam, {n: s for n, s in names.items() if _is_expert(n)}, expert=True))
    states: list[dict[str, Any]] = []
    for groups in chained:
        states.append({"state": {"common_step": torch.tensor(adam.step)}, "param_groups": groups}
                      if kind == "plain" else
                      {"optimizer": {"param_groups": [{**g, "step": adam.step} for g in groups]},
                       "param_state_sharding_type": "fully_reshardable"})
    out = {"optimizer": states[0] if len(states) == 1 else dict(enumerate(states)),
           "opt_param_scheduler": scheduler_state(chained[0], adam.step, args)}
    if len(states) > 1:  # the chained states' tensors keyed without a chained_N. prefix, as Megatron-LM saves them
        out["content_metadata"] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                   **({"distrib_optim_sharding_type": "fully_reshardable"} if kind != "plain" else {})}
    return out


_LEGACY_ORDER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                 "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
                 "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                 "mlp.linear_fc2.weight", "mlp.router.weight", "mlp.experts", "mlp.shared_experts.gate_weight",
                 "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight")
"""A layer's parameters in the order megatron-core's local spec registers them (``TransformerLayer``: the input
norm, ``SelfAttention``: ``linear_proj`` (in ``Attention``), then ``linear_qkv``, ``q_layernorm``, ``k_layernorm``;
the MLP's norm, ``linear_fc1``, ``linear_fc2``; a ``MoELayer``'s router, its local experts (each ``linear_fc1``,
``linear_fc2``), its shared expert's gate (``SharedExpertMLP``'s own parameter, so before its submodules'),
``linear_fc1``, ``linear_fc2``)."""
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def _module_order(name: str) -> tuple[int, ...]:
    if name.startswith("decoder.layers."):
        layer, suffix = name[len("decoder.layers."):].split(".", 1)
        expert = _LOCAL_EXPERT.match(suffix)
        if expert:
            return 1, int(layer), _LEGACY_ORDER.index("mlp.experts"), int(expert.group(1)), int(expert.group(2))
        return 1, int(layer), _LEGACY_ORDER.index(suffix), 0, 0
    return {"embedding.word_embeddings.weight": 0, "decoder.final_layernorm.weight": 2}.get(name, 3), 0, 0, 0, 0


def legacy_state(chunks: list[dict[str, Any]], moments: list[dict[str, dict[str, Any]]], entry: dict[Any, Any],
                 args: argparse.Namespace, stage: int, ep_rank: int) -> tuple[Any, Any]:
    """One legacy rank folder's optimizer: its rank file's ``optimizer`` entry and, for the distributed optimizer, its
    ``distrib_optim.pt`` (else ``None``). ``chunks``: each model chunk's parameters on the rank (of expert-parallel
    rank ``ep_rank``; one chunk without virtual pipeline stages) in the order the model registers them
    (:func:`registered`), ``moments`` each chunk's; ``entry``: :func:`common_entries`' ``optimizer``.

    The plain optimizer's entry is :func:`legacy_optimizer`'s; the distributed optimizer's is
    :func:`legacy_distributed`'s. With experts (``entry`` chained, ``{0: dense, 1: experts}``) each is the list
    ``ChainedOptimizer`` saves: the dense optimizer's over the rest, the experts' over the rank's local experts; the
    dense one's ``distrib_optim.pt`` state only in EP rank 0's folder (its data-parallel rank 0's), ``None`` in the
    others'."""
    chained = [entry[0], entry[1]] if 0 in entry else [entry]
    parts = [chunks] if len(chained) == 1 else [
        [{n: w for n, w in c.items() if bool(_LOCAL_EXPERT.match(n.split(".", 3)[-1])) == bool(which)}
         for c in chunks] for which in (0, 1)]
    if "param_state_sharding_type" not in chained[0]:
        plain = [legacy_optimizer(p, moments, float(c["state"]["common_step"]), c["param_groups"])
                 for p, c in zip(parts, chained)]
        return (plain[0] if len(plain) == 1 else plain), None
    made = [legacy_distributed(p, moments, c, args, stage) for p, c in zip(parts, chained)]
    if len(made) == 1:
        return made[0]
    return [m[0] for m in made], [None if ep_rank else made[0][1], made[1][1]]


def legacy_optimizer(chunks: list[dict[str, Any]], moments: list[dict[str, dict[str, Any]]], step: float,
                     groups: list[dict[str, Any]]) -> dict[str, Any]:
    """One legacy rank file's ``optimizer`` entry: the state dict of megatron-core's plain (fp32) optimizer, which
    keys Adam's state by position: the rank's parameters in megatron-core's groups (weight decay, then none for
    1-dim parameters and biases), each the model chunks' in chunk order, a chunk's in the order the model registers
    them (``chunks``: the rank's shard of each, ``moments`` their moments), as ``_get_param_groups`` collects them."""
    names = [sorted((n for n, t in c.items() if isinstance(t, torch.Tensor)), key=_module_order) for c in chunks]
    state, out_groups, at = {}, [], 0
    for group_entry in groups:  # the weight-decay group (wd_mult 1) and the other; the experts' only what they have
        which = 0 if group_entry["wd_mult"] else 1
        members = [(v, n) for v, c in enumerate(chunks) for n in names[v]
                   if _megatron_group(n, tuple(c[n].shape)) == which]
        for i, (v, name) in enumerate(members):
            state[at + i] = {"step": torch.tensor(step), **{m: moments[v][m][name] for m in MOMENTS}}
        out_groups.append({**group_entry, "params": list(range(at, at + len(members)))})
        at += len(members)
    return {"state": state, "param_groups": out_groups}


def registered(shard: dict[str, Any]) -> dict[str, Any]:
    """A dense rank's legacy state dict with its parameters in the order the model registers them (as megatron-core's
    own ``state_dict`` has them, which readers of ``distrib_optim.pt`` lay its buffers out by), the ``_extra_state``
    entries after them."""
    names = sorted((n for n, t in shard.items() if isinstance(t, torch.Tensor)), key=_module_order)
    return {**{n: shard[n] for n in names}, **{n: t for n, t in shard.items() if not isinstance(t, torch.Tensor)}}


def legacy_distributed(chunks: list[dict[str, Any]], moments: list[dict[str, dict[str, Any]]], entry: dict[str, Any],
                       args: argparse.Namespace, stage: int) -> tuple[dict[str, Any], dict[Any, Any]]:
    """One legacy rank folder's state for megatron-core's ``DistributedOptimizer``: its rank file's ``optimizer``
    entry (``DistributedOptimizer.state_dict()``: the parameter groups with the step, no per-parameter state) and
    its ``distrib_optim.pt`` (``save_parameter_state``'s: the fp32 master copies, ``moments[v]["param"]``, and the
    moments in three flat buffers laid out by megatron-core's gradient-buffer rules,
    :func:`~ckptio.formats.megatron.distrib_optim.flat_layout`, the padding zeros), one gradient buffer per model
    chunk that has parameters here, numbered in chunk order. ``chunks``: each model chunk's parameters in the order
    the model registers them (:func:`registered`); ``entry``: :func:`common_entries`' ``optimizer``.
    The buffers keep each bucket up to its last parameter, so they are the same for every data-parallel size (the
    bucket size, with the run's ``--overlap-grad-reduce``, from ``args``, in the first chunk only: Megatron-LM's
    ``get_model`` buckets no other); a tied embedding over pipeline stages, and its copy on the last stage, each in a
    bucket of its own, as megatron-core's ``_ParamAndGradBuffer`` puts a ``shared_embedding`` parameter."""
    from .distrib_optim import SHARED_EMBEDDING, STATE_KEYS, bucket_size, flat_layout

    tied = not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1
    flat_state: dict[Any, Any] = {"buckets_coalesced": True}
    for v, weights in enumerate(chunks):
        if not weights:
            continue
        slots, total, _ = flat_layout([(n, w.numel()) for n, w in weights.items()],
                                      size=bucket_size(args, stage) if v == 0 else None,
                                      shared=set(SHARED_EMBEDDING) if tied else set())
        buffers: dict[str, Any] = {}
        for key in STATE_KEYS:
            flat = torch.zeros(total, dtype=torch.float32)
            for name, (start, end) in slots.items():
                flat[start:end] = moments[v][key][name].reshape(-1)
            buffers[key] = flat
        buffers["numel_unpadded"] = total
        flat_state[len(flat_state) - 1] = {(torch.float32, torch.float32): buffers}
    return {"optimizer": {"param_groups": [dict(g) for g in entry["optimizer"]["param_groups"]]}}, flat_state
