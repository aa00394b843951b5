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
    """The model: a Hugging Face folder to start from, or the sizes of a tiny Llama built from scratch."""

    pretrained_path: str | None = None
    """A Hugging Face folder to start from; when null, a tiny Llama is built from the fields below."""
    vocab_size: int = 96
    """Tokens in the vocabulary; the recipe's tokenizer is trained to this size."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of each MLP's hidden layer."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads per attention layer."""
    num_key_value_heads: int = 2
    """Key/value heads per attention layer (grouped-query attention when fewer than the query heads)."""
    max_position_embeddings: int = 128
    """Longest sequence the rotary embeddings are set up for."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the output head."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (0: deterministic training)."""


@dataclass
class DataConfig:
    """The training text, its split into sequences, and the loader's batches."""

    corpus: str = "builtin"
    """``builtin`` (generated English-like sentences) or a path to a UTF-8 text file."""
    seq_len: int = 64
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per batch on each rank."""
    val_fraction: float = 0.1
    """Share of the sequences held out for validation."""
    num_sentences: int = 3000
    """Sentences the builtin corpus generates."""
    seed: int = 0
    """Seed of the builtin corpus and of the loader's shuffling."""


@dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule (linear warm-up, then cosine decay)."""

    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    warmup_steps: int = 10
    """Steps of linear warm-up to ``lr``."""
    min_lr_ratio: float = 0.1
    """Cosine decay to ``lr * min_lr_ratio`` at ``step_scheduler.max_steps``."""


@dataclass
class StepSchedulerConfig:
    """How long the run trains and when it validates, checkpoints and logs."""

    max_steps: int | None = 200
    """Stop after this many optimizer steps (null: after ``num_epochs``)."""
    num_epochs: int = 1
    """Passes over the training data, when ``max_steps`` does not end the run first."""
    ckpt_every_steps: int | None = 50
    """Save a checkpoint every this many steps (and at the end; null: only at the end)."""
    val_every_steps: int | None = 25
    """Compute the validation loss every this many steps (null: never)."""
    log_every_steps: int = 10
    """Print the loss and throughput every this many steps."""


@dataclass
class PeftConfig:
    """LoRA fine-tuning with peft: only the adapters train and are checkpointed."""

    enabled: bool = False
    """Wrap the model in LoRA adapters (set ``checkpoint.is_peft`` too)."""
    r: int = 8
    """Rank of each adapter."""
    lora_alpha: int = 16
    """Scale of the adapters' output (``lora_alpha / r``)."""
    lora_dropout: float = 0.05
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Names of the linear layers that get adapters."""


@dataclass
class RecipeConfig:
    """The whole recipe: one section per part of the run, and the run's own options."""

    seed: int = 1234
    """Seed of the model's initial weights and of every rank's RNG streams."""
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
    assets_dir: str | None = None
    """A local folder for the run's assets (the tokenizer it built, a PEFT run's base model); null: ``.recipe``
    inside a local ``checkpoint_dir``, or a local cache folder named after an ``s3://`` one."""



_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(?:([^`<]*?)\s*<[^`>]*>|~(?:[\w.]*\.)?([^`.]+)|([^`]+))`")
_LINK = re.compile(r"`([^`<]+?)\s*<([^`>]+)>`_+")


def plain(text: str) -> str:
    """reStructuredText markup of the docstrings as plain text for ``--help``: ````x```` and ```x``` -> ``x``,
    ``:meth:`~ckptio.CheckpointManager.maybe_save``` -> ``maybe_save``, ```name <url>`_`` -> ``name (url)``."""
    text = _ROLE.sub(lambda m: next(g for g in m.groups() if g is not None), text)
    text = _LINK.sub(r"\1 (\2)", text)
    return re.sub(r"``?([^`]+?)``?", r"\1", text)


def _formatter() -> Any:
    from jsonargparse import DefaultHelpFormatter

    class PlainHelp(DefaultHelpFormatter):
        """jsonargparse's help (every key with its type and default), its texts as plain text."""

        def _get_help_string(self, action: Any) -> str:
            return plain(super()._get_help_string(action))

        def _format_text(self, text: str) -> str:
            return super()._format_text(plain(text))

    return PlainHelp


def build_parser(prog: str = "finetune.py") -> Any:
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # --help shows each field's docstring
    parser = ArgumentParser(prog=prog, exit_on_error=False, default_env=False, allow_abbrev=False,
                            formatter_class=_formatter(),  # every key shows its type and default, as plain text
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
        from ckptio.config import AUTOMODEL_ONLY

        name = key.rsplit(".", 1)[-1]
        if key.startswith("--checkpoint.") and name in AUTOMODEL_ONLY:
            return (f"checkpoint.{name}: NeMo AutoModel's key has no meaning in ckptio ({AUTOMODEL_ONLY[name]}); "
                    "remove it (docs/migrate-automodel.md lists every key)")
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
    cfg = RecipeConfig(**{f.name: init[f.name] for f in dataclasses.fields(RecipeConfig)})
    if cfg.assets_dir and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", cfg.assets_dir):
        raise RecipeConfigError(f"assets_dir={cfg.assets_dir!r}: give a local folder (run assets are read from disk)")
    check_monitor(cfg)
    return cfg


def check_monitor(cfg: RecipeConfig) -> None:
    """With ``checkpoint.monitor`` (top-k retention, ``BEST``), every checkpoint is ranked by the validation loss of
    its step: a checkpoint step must be a validation step (else ckptio refuses the run's first save, after the
    training that led to it). Refused here, before anything is built, naming both keys (docs/recipe.md)."""
    monitor, s = cfg.checkpoint.monitor, cfg.step_scheduler
    if monitor is None:
        return
    if monitor != "val_loss":
        raise RecipeConfigError(f"checkpoint.monitor={monitor!r}: the recipe computes val_loss only; set "
                                "checkpoint.monitor to val_loss, or unset it")
    if s.val_every_steps is None:
        raise RecipeConfigError("checkpoint.monitor='val_loss' ranks the checkpoints by the validation loss, but "
                                "step_scheduler.val_every_steps is null (it is never computed): set it, or unset "
                                "checkpoint.monitor")
    every, val = s.ckpt_every_steps, s.val_every_steps
    if every is not None and every % val:
        raise RecipeConfigError(
            f"step_scheduler.ckpt_every_steps={every} is not a multiple of step_scheduler.val_every_steps={val}: "
            f"with checkpoint.monitor='val_loss' each checkpoint is ranked by the validation loss of its step, and "
            f"step {every} has none. Set ckpt_every_steps to a multiple of {val} (e.g. {-(-every // val) * val}), or "
            f"val_every_steps to a divisor of {every}, or unset checkpoint.monitor (docs/recipe.md)")


def to_dict(cfg: RecipeConfig) -> dict:
    return dataclasses.asdict(cfg)
