"""The Hugging Face Trainer's ``trainer_state.json`` and side files (model configuration, weights index) read as
:mod:`ckptio.hf_trainer` checks a checkpoint before a resume: bounded, and every field the Trainer reads checked for its
type and range."""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import TrainerState

from ..errors import CheckpointCorruptError
from .hf_trainer_save import TRAINER_STATE

__all__ = ["trainer_state", "side_files"]

_MAX_JSON = 256 << 20

_NUMBER = (int, float)
_STATE_FIELDS: dict[str, tuple[Any, ...]] = {  # field -> the types TrainerState and the Trainer use it with
    "epoch": (int, float, type(None)), "global_step": (int,), "max_steps": (int,), "logging_steps": _NUMBER,
    "eval_steps": _NUMBER, "save_steps": _NUMBER, "train_batch_size": (int,), "num_train_epochs": _NUMBER,
    "num_input_tokens_seen": _NUMBER, "total_flos": _NUMBER, "log_history": (list,),
    "best_metric": (int, float, type(None)), "best_global_step": (int, type(None)),
    "best_model_checkpoint": (str, type(None)), "is_local_process_zero": (bool,), "is_world_process_zero": (bool,),
    "is_hyper_param_search": (bool,), "trial_name": (str, type(None)), "trial_params": (dict, type(None)),
    "stateful_callbacks": (dict, type(None)),
}
_COUNTS = ("epoch", "global_step", "max_steps", "num_train_epochs", "num_input_tokens_seen", "total_flos",
           "best_global_step")
_REQUIRED = ("global_step", "train_batch_size")  # the Trainer divides by the batch size when it resumes


def trainer_state(folder: Any) -> TrainerState:
    """``trainer_state.json`` read bounded, every field the Trainer reads checked for its type and range."""
    import dataclasses

    from ..storage.parse import as_float, as_int, field, parsing, read_json

    where = folder.display(TRAINER_STATE)
    if folder.kind(TRAINER_STATE) != "file":
        raise CheckpointCorruptError(f"{where}: missing (a save cut short)")
    data = read_json(folder, TRAINER_STATE, max_size=_MAX_JSON, what="a Trainer state ")
    known = {f.name for f in dataclasses.fields(TrainerState)}
    if set(data) - known:
        raise CheckpointCorruptError(f"{where}: not a Trainer state (unknown keys {sorted(set(data) - known)[:5]})")
    for key, kinds in _STATE_FIELDS.items():
        value = field(data, key, kinds, where, default=None)
        if value is None and key in _REQUIRED:
            raise CheckpointCorruptError(f"{where}: {key!r} is missing (the Trainer needs it to resume)")
        if isinstance(value, int) and not isinstance(value, bool):
            as_int(value, where, key, lo=0 if key in _COUNTS else -(1 << 63))
        elif isinstance(value, float):
            as_float(value, where, key)
            if key in _COUNTS and value < 0:
                raise CheckpointCorruptError(f"{where}: {key!r} must not be negative, found {value}")
    if data.get("train_batch_size") == 0 or any(data.get(k) is not None and data[k] <= 0
                                                for k in ("logging_steps", "eval_steps", "save_steps")):
        raise CheckpointCorruptError(f"{where}: the batch size, logging, eval and save steps must be positive")
    if isinstance(data.get("best_model_checkpoint"), str) and (len(data["best_model_checkpoint"]) > 4096 or
                                                               "\0" in data["best_model_checkpoint"]):
        raise CheckpointCorruptError(f"{where}: 'best_model_checkpoint' is not a path")
    for i, entry in enumerate(data.get("log_history") or ()):
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(f"{where}: log_history[{i}] must be an object, found {type(entry).__name__}")
    _check_callbacks(data.get("stateful_callbacks") or {}, where)
    with parsing(where):
        state = TrainerState(**data)
    return state


def _check_callbacks(callbacks: dict[str, Any], where: object) -> None:
    """``stateful_callbacks`` as ``Trainer._load_callback_state`` reads it: by class name, one state or a list of
    them, each ``{"args": {name: value}, "attributes": {name: value}}`` (public names only: they are set on the
    callback)."""
    for name, states in callbacks.items():
        for i, state in enumerate(states if isinstance(states, list) else [states]):
            what = f"stateful_callbacks[{name!r}]" + (f"[{i}]" if isinstance(states, list) else "")
            if not isinstance(state, dict):
                raise CheckpointCorruptError(f"{where}: {what} must be an object, found {type(state).__name__}")
            for part in ("args", "attributes"):
                names = state.get(part, {})
                if not isinstance(names, dict) or not all(k.isidentifier() and not k.startswith("_") for k in names):
                    raise CheckpointCorruptError(f"{where}: {what}[{part!r}] must map public names to values")


def _config_errors() -> tuple[type[BaseException], ...]:
    """What else transformers raises about a configuration it refuses: huggingface_hub's validators, where they exist."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def side_files(folder: Any) -> None:
    """The JSON files the Trainer reads when it resumes (``config.json`` for its version, the weights' index, the
    adapter's configuration), read bounded and typed as the readers use them."""
    from transformers import configuration_utils

    from ..storage.parse import field, parsing, read_json

    config_class = getattr(configuration_utils, "PreTrainedConfig", None) or configuration_utils.PretrainedConfig

    names = {e.name for e in folder.listdir() if e.kind == "file"}
    if "config.json" in names:
        where = folder.display("config.json")
        config = read_json(folder, "config.json", max_size=_MAX_JSON, what="a model configuration ")
        field(config, "transformers_version", (str, type(None)), where, default=None)
        with parsing(where, "as a model configuration", also=_config_errors()):
            config_class.from_dict(config)
    if "adapter_config.json" in names:
        read_json(folder, "adapter_config.json", max_size=_MAX_JSON, what="an adapter configuration ")
    for name in sorted(n for n in names if n.endswith(".index.json")):
        where = folder.display(name)
        shards = field(read_json(folder, name, max_size=_MAX_JSON), "weight_map", dict, where)
        for shard in set(shards.values()):
            if not isinstance(shard, str) or shard not in names:
                raise CheckpointCorruptError(f"{where}: names a shard {str(shard)[:80]!r} the folder does not hold")
