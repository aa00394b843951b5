"""Whole training state across formats: ckptio's FQN-keyed optimizer state <-> torch's index-keyed one.

ckptio stores the optimizer flattened and keyed by parameter name (``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``) so that it reshards; Lightning and plain ``optimizer.state_dict()`` key it by
the parameter's position in the optimizer. The positions are the model's parameter order, which is
recovered without weights by building the model's architecture from its ``config.json`` on the meta
device. Parameter groups are rebuilt from the per-parameter hyper-parameters, in order of appearance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, require
from . import pt as pt_format
from . import registry
from .common import read_json
from ..storage.confined import Folder

__all__ = ["parameter_order", "per_parameter", "grouped", "index_keyed_optimizer", "saved_optimizer",
           "read_training_state"]


def _meta_model(config_json: Path) -> Any:
    import torch
    transformers = require("transformers", extra="hf", purpose="reading a model's parameter order from its config")
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM

    if not config_json.is_file():
        raise CheckpointError(f"{config_json} is missing: the model's parameter layout comes from its config")
    config = AutoConfig.for_model(**read_json(config_json))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def parameter_order(config_json: Path) -> list[str]:
    """Parameter names in ``model.parameters()`` order, for the transformers model ``config_json`` describes."""
    return [name for name, _ in _meta_model(config_json).named_parameters()]


def tied_aliases(config_json: Path) -> dict[str, str]:
    """Alias -> primary name of parameters the model registers twice (a tied ``lm_head.weight``)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in _meta_model(config_json).named_parameters(remove_duplicate=False):
        primary = first.setdefault(id(param), name)
        if primary != name:
            aliases[name] = primary
    return aliases


def _split(key: str, head: str) -> tuple[str, str]:
    body = key[len(head):]
    if "." not in body:
        raise CheckpointCorruptError(f"optimizer key {key!r} has no parameter name")
    fqn, name = body.rsplit(".", 1)
    return fqn, name


def per_parameter(flat: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """ckptio's flattened, FQN-keyed optimizer state (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``) as the state
    and the hyper-parameters of each parameter name."""
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            fqn, name = _split(key, "state.")
            state.setdefault(fqn, {})[name] = value
        elif key.startswith("param_groups."):
            fqn, name = _split(key, "param_groups.")
            hyper.setdefault(fqn, {})[name] = value
    return state, hyper


def grouped(hyper: dict[str, dict[str, Any]], optimized: list[str]) -> list[dict[str, Any]]:
    """Parameter groups rebuilt from per-parameter hyper-parameters, in order of appearance; each group's ``params``
    are positions in ``optimized``."""
    groups: list[dict[str, Any]] = []
    signature_to_group: dict[str, int] = {}
    for index, fqn in enumerate(optimized):
        sig = repr(sorted(hyper[fqn].items()))
        if sig not in signature_to_group:
            signature_to_group[sig] = len(groups)
            groups.append({**hyper[fqn], "params": []})
        groups[signature_to_group[sig]]["params"].append(index)
    return groups


def index_keyed_optimizer(flat: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` layout from ckptio's flattened, FQN-keyed optimizer state."""
    state, hyper = per_parameter(flat)
    unknown = sorted(set(hyper) - set(order))
    if unknown:
        raise CheckpointError(f"optimizer state names parameters the model config does not have, e.g. {unknown[:3]}")
    optimized = [fqn for fqn in order if fqn in hyper]  # the others are not optimized (frozen)
    out_state = {index: state[fqn] for index, fqn in enumerate(optimized) if fqn in state}
    return {"state": out_state, "param_groups": grouped(hyper, optimized)}


def saved_optimizer(step_dir: Path) -> tuple[dict[str, Any] | None, Any]:
    """A ckptio step directory's flattened optimizer state (keys without ``optim.``) and LR scheduler state; ``None``
    for each it does not hold (the scheduler is read only beside an optimizer)."""
    from ..engine.manifest import read_manifest

    manifest = read_manifest(step_dir)
    entry = manifest.states.get("optim")
    if entry is None:
        return None, None
    flat = registry.get(entry.format).read_state(Folder(step_dir).sub(entry.path))
    saved = {k[len("optim."):]: v for k, v in flat.items() if k.startswith("optim.")}
    return saved, _scheduler(step_dir, manifest)


def open_saved_optimizer(step_dir: Path) -> tuple[Any, dict[str, Any], Any]:
    """A ckptio step directory's optimizer state to stream: a source of its tensors (one read at a time) and its other
    entries, both keyed without ``optim.``, and the LR scheduler's state; ``(None, {}, None)`` without an optimizer."""
    from ..engine.manifest import read_manifest

    manifest = read_manifest(step_dir)
    entry = manifest.states.get("optim")
    if entry is None:
        return None, {}, None
    fmt, folder = registry.get(entry.format), Folder(step_dir).sub(entry.path)
    values = {k[len("optim."):]: v for k, v in fmt.state_values(folder).items() if k.startswith("optim.")}
    return _Unprefixed(fmt.open(folder.path).source, "optim."), values, _scheduler(step_dir, manifest)


class _Unprefixed:
    """The tensors of a source whose names start with ``prefix``, under the rest of their names."""

    def __init__(self, source: Any, prefix: str) -> None:
        self.source, self.prefix, self.folder = source, prefix, source.folder

    def index(self) -> dict[str, Any]:
        return {k[len(self.prefix):]: v for k, v in self.source.index().items() if k.startswith(self.prefix)}

    def read(self, key: str) -> Any:
        return self.source.read(self.prefix + key)

    def close(self) -> None:
        self.source.close()


def _scheduler(step_dir: Path, manifest: Any) -> Any:
    sched = manifest.states.get("lr_scheduler")
    return None if sched is None or sched.per_rank else pt_format.load_from(Folder(step_dir), sched.path)


def read_training_state(step_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(index-keyed optimizer state, LR scheduler state) of a ckptio step directory; ``None`` when absent."""
    from ..engine.manifest import read_manifest

    saved, scheduler = saved_optimizer(step_dir)
    if saved is None:
        return None, None
    manifest = read_manifest(step_dir)
    order = parameter_order(step_dir / manifest.states["model"].path / "config.json")
    return index_keyed_optimizer(saved, order), scheduler
