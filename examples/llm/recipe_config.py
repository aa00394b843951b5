"""The fine-tuning recipe's configuration: typed sections, YAML files and dotted command-line overrides.

``load_config(["--config", "x.yaml", "--step_scheduler.max_steps", "60"])`` starts from the defaults
below, applies the YAML file, then each ``--section.key value`` override (values are parsed as YAML:
``true``, ``20``, ``1e-3``, ``null``, ``[q_proj, v_proj]``). Unknown keys and values of the wrong type
are refused with a message that names the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union



from ckptio import CheckpointConfig, CheckpointError, safe_yaml


class RecipeConfigError(ValueError):
    """A bad config file or override; the message names the key."""


@dataclass
class ModelConfig:
    pretrained_path: str | None = None
    """A Hugging Face folder to start from; when null, a tiny Llama is built from the fields below."""
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = True
    attention_dropout: float = 0.0


@dataclass
class DataConfig:
    corpus: str = "builtin"
    """``builtin`` (generated English-like sentences) or a path to a UTF-8 text file."""
    seq_len: int = 64
    batch_size: int = 8
    val_fraction: float = 0.1
    num_sentences: int = 3000
    seed: int = 0


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    """Cosine decay to ``lr * min_lr_ratio`` at ``step_scheduler.max_steps``."""


@dataclass
class StepSchedulerConfig:
    max_steps: int | None = 200
    num_epochs: int = 1
    ckpt_every_steps: int | None = 50
    val_every_steps: int | None = 25
    log_every_steps: int = 10


@dataclass
class PeftConfig:
    enabled: bool = False
    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])


@dataclass
class RecipeConfig:
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    step_scheduler: StepSchedulerConfig = field(default_factory=StepSchedulerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log_file: str | None = None
    """Where to append one JSON line per training step (step, loss, lr); null: not written."""
    init_from_lightning: str | None = None
    """A PyTorch Lightning ``.ckpt`` of the same model to start from (weights, optimizer, LR scheduler,
    global step and epoch) when the checkpoint folder holds no checkpoint yet."""
    export_lightning: str | None = None
    """At the end of a run, also write the final state as a Lightning ``.ckpt`` here (one process only)."""


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _apply(obj: Any, data: dict, prefix: str) -> None:
    if not isinstance(data, dict):
        raise RecipeConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise RecipeConfigError(f"unknown config key {path!r}; known keys here: {sorted(names)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, path + ".")
            continue
        hint = hints[key]
        if isinstance(value, int) and not isinstance(value, bool) and _type_ok(1.0, hint) and not _type_ok(1, hint):
            value = float(value)
        if key == "save_consolidated" and isinstance(value, str):
            pass  # CheckpointConfig validates "final" and friends itself
        elif not _type_ok(value, hint):
            raise RecipeConfigError(f"config key {path!r} must be {_describe(hint)}, got {value!r}")
        setattr(obj, key, value)


def parse_override_value(text: str) -> Any:
    try:
        return safe_yaml.load(text, "override")
    except CheckpointError:
        return text


def load_config(argv: list[str]) -> RecipeConfig:
    """Defaults, then ``--config FILE``, then ``--a.b value`` overrides, in the order given."""
    cfg = RecipeConfig()
    config_file = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise RecipeConfigError(f"unexpected argument {arg!r}; use --config FILE and --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise RecipeConfigError(f"option --{key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_file = value
        else:
            overrides.append((key, value))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise RecipeConfigError(f"--config {config_file}: no such file")
        if path.stat().st_size > safe_yaml.MAX_BYTES:
            raise RecipeConfigError(f"--config {config_file}: larger than {safe_yaml.MAX_BYTES} bytes")
        try:
            data = safe_yaml.load(path.read_bytes(), f"--config {config_file}") or {}
        except CheckpointError as exc:
            raise RecipeConfigError(str(exc)) from exc
        _apply(cfg, data, "")
    for key, value in overrides:
        nested: Any = parse_override_value(value)
        for part in reversed(key.split(".")):
            if not part:
                raise RecipeConfigError(f"override --{key}: empty key segment")
            nested = {part: nested}
        _apply(cfg, nested, "")
    try:
        cfg.checkpoint.validate()
    except ValueError as exc:
        raise RecipeConfigError(f"checkpoint: {exc}") from exc
    return cfg


def to_dict(cfg: RecipeConfig) -> dict:
    return dataclasses.asdict(cfg)
