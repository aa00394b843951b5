"""The fine-tuning recipe's configuration: typed sections read from YAML and ``--section.key value`` overrides.

The sections are dataclasses; `jsonargparse <https://jsonargparse.readthedocs.io>`_ turns them into the
command line. It was chosen over OmegaConf and tyro because it builds the parser from the dataclasses
*and* their attribute docstrings (so ``--help`` lists every key with its type, default and meaning), has
``--config FILE`` and ``--print_config`` built in, checks ``Literal``/``Optional``/``list`` types and
names the key in its errors, and keeps the dotted ``--section.key value`` overrides the recipe already
had; OmegaConf has no ``--help`` from types, tyro no YAML config files of its own.

``load_config(["--config", "x.yaml", "--step_scheduler.max_steps", "60"])``: the defaults below, then the
YAML file, then each override in the order given. ``--print_config`` prints the effective YAML and exits.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from ckptio import CheckpointConfig
from ckptio.errors import ConfigError


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



def build_parser(prog: str = "finetune.py") -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # --help shows each field's docstring
    parser = ArgumentParser(prog=prog, exit_on_error=False, default_env=False, allow_abbrev=False,
                            description="Fine-tune a causal LM with ckptio checkpointing. Rerunning the same "
                                        "command resumes from the newest complete checkpoint.")
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file with any of the sections below")
    parser.add_class_arguments(RecipeConfig, fail_untyped=True, sub_configs=True)
    return parser


def _options(parser: Any) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _explain(parser: Any, message: str) -> str:
    """jsonargparse's message, with the closest valid key for a misspelt one."""
    message = " ".join(message.split())
    unknown = re.search(r"unrecognized arguments: (--[\w.]+)", message, re.IGNORECASE) or \
        re.search(r"Group '([\w.]+)' does not accept option '(\w+)'", message)
    if unknown:
        key = unknown.group(1) if unknown.lastindex == 1 else f"--{unknown.group(1)}.{unknown.group(2)}"
        close = difflib.get_close_matches(key, _options(parser), n=1)
        if close:
            message += f"; did you mean {close[0].removeprefix('--')!r}?"
    return message


def load_config(argv: list[str], prog: str = "finetune.py") -> RecipeConfig:
    """Defaults, then ``--config FILE``, then ``--a.b value`` overrides, in the order given.

    ``--help`` and ``--print_config`` print and exit (``SystemExit(0)``); a bad key or value raises
    :class:`RecipeConfigError` naming it.
    """
    from argparse import ArgumentError

    parser = build_parser(prog)
    try:
        ns = parser.parse_args(argv)
        init = (parser.instantiate if hasattr(parser, "instantiate") else parser.instantiate_classes)(ns)
    except ArgumentError as exc:
        raise RecipeConfigError(_explain(parser, str(exc))) from exc
    except ConfigError as exc:  # CheckpointConfig's own checks, run as it is built
        raise RecipeConfigError(f"checkpoint: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise RecipeConfigError(str(exc)) from exc
    return RecipeConfig(**{f.name: init[f.name] for f in dataclasses.fields(RecipeConfig)})


def to_dict(cfg: RecipeConfig) -> dict:
    return dataclasses.asdict(cfg)
