"""Configuration of a :class:`~ckptio.CheckpointManager`, validated once at construction."""

from __future__ import annotations

import string
from dataclasses import dataclass, fields
from typing import Literal, Union

from .errors import ConfigError

__all__ = ["CheckpointConfig", "MODEL_SAVE_FORMATS"]

MODEL_SAVE_FORMATS = ("safetensors", "torch_save")
_TEMPLATE_FIELDS_REQUIRED = ("step",)

SaveConsolidated = Union[bool, Literal["final"]]


@dataclass
class CheckpointConfig:
    """Where and how checkpoints are written and which one a run resumes from."""

    checkpoint_dir: str = "checkpoints"
    """Folder that holds the step directories and the LATEST pointer; created on first save."""

    model_save_format: str = "safetensors"
    """``safetensors``: one safetensors file of local shards per rank; ``torch_save``: a PyTorch DCP folder."""

    save_consolidated: SaveConsolidated = False
    """Also write a Hugging Face bundle under ``model/consolidated``: ``False``, ``True`` (every
    checkpoint) or ``"final"`` (only the last checkpoint of a run)."""

    consolidated_max_shard_size: str = "5GB"
    """Largest file of the consolidated bundle (``"5GB"``, ``"500MB"``, ``"2GiB"``); a bigger tensor gets its own file."""

    is_peft: bool = False
    """The model is a PEFT model: only the adapter weights are saved, always consolidated."""

    restore_from: str | None = None
    """``None``: newest complete checkpoint in ``checkpoint_dir`` (start fresh if none); ``"LATEST"``:
    the LATEST pointer; a step directory name inside ``checkpoint_dir``; or a path to a step directory."""

    name_template: str = "epoch_{epoch}_step_{step}"
    """Python format string for step directory names; must contain ``{step}``."""

    enabled: bool = True
    """``False`` turns every save and restore into a no-op (dry runs, debugging)."""

    strict: bool = True
    """Refuse to load a checkpoint whose model or optimizer keys differ from the live objects."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ConfigError("checkpoint_dir must be a non-empty path string, e.g. 'checkpoints'")
        if self.model_save_format not in MODEL_SAVE_FORMATS:
            raise ConfigError(
                f"model_save_format={self.model_save_format!r} is not supported; use one of {list(MODEL_SAVE_FORMATS)}"
            )
        self.save_consolidated = _parse_save_consolidated(self.save_consolidated)
        from .formats.hf_bundle import parse_size

        try:
            parse_size(self.consolidated_max_shard_size)
        except ConfigError as exc:
            raise ConfigError(f"consolidated_max_shard_size: {exc}") from exc
        for name in ("is_peft", "enabled", "strict"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
        if self.restore_from is not None and (not isinstance(self.restore_from, str) or not self.restore_from):
            raise ConfigError("restore_from must be null, 'LATEST', a step directory name, or a path")
        _validate_template(self.name_template)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _parse_save_consolidated(value: object) -> SaveConsolidated:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "yes", "1"):
            return True
        if low in ("false", "no", "0", "none", ""):
            return False
        if low == "final":
            return "final"
    raise ConfigError(f"save_consolidated must be true, false or 'final', got {value!r}")


def _validate_template(template: object) -> None:
    if not isinstance(template, str) or not template:
        raise ConfigError("name_template must be a non-empty format string such as 'epoch_{epoch}_step_{step}'")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(f"name_template {template!r} is not a valid format string: {exc}") from exc
    for required in _TEMPLATE_FIELDS_REQUIRED:
        if required not in names:
            raise ConfigError(
                f"name_template {template!r} must contain {{{required}}} so that every step gets its own directory"
            )
    if "/" in template or "\\" in template or template.startswith("."):
        raise ConfigError(f"name_template {template!r} must name a single directory (no '/', no leading '.')")
