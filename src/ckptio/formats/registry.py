"""The format registry: every checkpoint format ckptio knows is one :class:`Format`, registered once.

A format says what it can do by the methods it overrides:

=================  ==========================================================================
``detect(path)``   whether ``path`` is in this format, from its layout alone (names, not contents)
``open(path)``     an :class:`Opened` source: the tensors' index (shape, dtype), whole-tensor reads,
                   the side files (config, tokenizer) and the training position where it has one
``write(...)``     write an opened source as a new file or folder in this format (``convert``)
``index(folder)``  the tensors of a model folder inside a step directory, from headers only
``save_shards``    write one rank's shards of a state dict into a step directory (the manager)
``load_shards``    fill one rank's local tensors (plain or DTensor shards) from a step directory
``describe(path)`` what ``ckptio inspect`` reports
=================  ==========================================================================

The manager, ``convert``, ``inspect``, ``consolidate``, ``verify`` and the CLI ask the registry
(:func:`get`, :func:`detect`, :func:`names`) and never branch on a format's name. Adding a format is one
new module that defines a :class:`Format` subclass and calls :func:`register`, plus its tests; it is
loaded with the built-in ones (the list :data:`ckptio.formats.BUILTIN_FORMATS`) by :func:`_load_builtins`.

Call sequence: ``save_shards`` and ``load_shards`` are called by every rank with its own state dict
(a format may run collectives inside; the others read and write only what the rank owns); the other
methods are local to one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from .common import TensorInfo

if TYPE_CHECKING:
    import torch

    from ..storage.base import FolderWriter
    from ..storage.confined import Folder

__all__ = ["Format", "Opened", "TensorSource", "WriteOptions", "register", "get", "detect", "names"]


class TensorSource(Protocol):
    """Whole tensors, one at a time, from a saved model."""

    folder: Path

    def index(self) -> dict[str, TensorInfo]: ...

    def read(self, key: str) -> "torch.Tensor": ...

    def close(self) -> None: ...


class Opened:
    """An opened source: its tensors, the folder with its side files (config, tokenizer), its position."""

    def __init__(self, kind: str, source: Any, extras: Path | None, step: int = 0, epoch: int = 0,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.kind, self.source, self.extras, self.step, self.epoch = kind, source, extras, step, epoch
        self._cleanup = cleanup
        self.step_dir: Path | None = None
        """A ckptio step directory: its optimizer and scheduler travel to formats that hold them."""
        self.training: Callable[[], dict[str, Any]] | None = None
        """A foreign checkpoint with a training state (a DeepSpeed run): called, it gives the optimizer state as ckptio
        saves it (torch's flattened, name-keyed entries): ``tensors``, a :class:`TensorSource` of its tensors
        (``state.<fqn>.exp_avg``, read one at a time), and ``values``, its other entries (``param_groups.<fqn>.lr``),
        and ``lr_scheduler`` (a state dict, or ``None``); ``{}`` when there is none. A ckptio step directory written
        from it then resumes the whole run."""

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()
        if self._cleanup is not None:
            self._cleanup()


@dataclass
class WriteOptions:
    """How :meth:`Format.write` writes: a dtype cast is already applied by the source it is given."""

    max_shard_size: str = "5GB"
    dtype: Any = None
    progress: Callable[[int], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Format-specific choices (for ``megatron``: ``tp``, ``pp``, ``layout``)."""


@dataclass
class ShardContext:
    """Where a rank stands when it writes its shards."""

    rank: int = 0
    world_size: int = 1
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    """Format-specific inputs (the PEFT model and its base path, for instance)."""
    progress: Callable[[int], None] | None = None
    """Loads: called with the bytes of each part of this rank's tensors as it is filled (a large restore's
    progress); formats that cannot tell may leave it uncalled."""


class Format:
    """One checkpoint format. Subclasses set :attr:`name` and override what the format can do."""

    name: str = ""
    summary: str = ""
    """One line for ``--help`` and ``inspect``."""
    priority: int = 100
    """Detection order: lower is tried first (a step directory before the folders it contains)."""
    file_suffix: str = ""
    """The suffix of a single-file output (``.pt``, ``.nemo``); empty for folders."""
    groups_apart: bool = False
    """Saves honour ``ShardContext.extra["apart"]`` and ``["share"]``: frozen tensors in files of their own, shared
    with the previous checkpoint when their bytes did not change (:mod:`ckptio.engine.sharing`)."""
    shares_reads: bool = False
    """Loads honour ``ShardContext.extra["skip"]`` (values another rank reads and sends: see
    :mod:`ckptio.engine.shared_reads`) and call ``extra["filled"]``, when given, with a value's identity once it is
    filled (its bytes may then be sent; a load that never calls it only loses the overlap)."""
    full_model: bool = False
    """Inside a step directory: holds the whole model (then its config, tokenizer and consolidated bundle
    are written beside it), rather than a part of it such as an adapter."""
    resumes_runs: bool = False
    """A folder in this format is a training run of another tool: an automatic resume in it continues from its newest
    checkpoint (DeepSpeed's ``latest``), weights, optimizer and scheduler, as ``restore_from=`` it would."""
    step_files: bool = False
    """A single file of this format in a checkpoint folder is one checkpoint of a run (a Lightning ``.ckpt``), which
    ``ckptio list`` shows beside the folders; other files there (a ``.pt`` of logits) are not."""
    needs_config: bool = False
    """A folder in this format is loaded by ``from_pretrained``, which builds the model from the ``config.json``
    beside the weights: ``convert`` warns when it writes one without it."""
    any_values: bool = False
    """``save_state`` keeps values of any structure beside the tensors (DCP pickles them): the optimizer's folder
    can then also carry the LR scheduler's state, where NeMo AutoModel keeps it."""

    # capabilities -----------------------------------------------------------------------------------
    def detect(self, path: Path) -> bool:
        return False

    def open(self, path: Path) -> Opened:
        raise ConfigError(f"ckptio cannot read the {self.name} format")

    def write(self, opened: Opened, source: TensorSource, out: Path, options: WriteOptions) -> None:
        raise ConfigError(f"ckptio cannot write the {self.name} format")

    def index(self, folder: "Folder") -> dict[str, TensorInfo | None]:
        raise ConfigError(f"the {self.name} format has no tensor index")

    def open_adam(self, path: Path) -> "tuple[float, dict[str, TensorSource]] | None":
        """A foreign checkpoint's Adam state under the names :meth:`open` gives the weights: the step and a source
        per moment (``exp_avg``, ``exp_avg_sq``); ``None`` when the format or this checkpoint has none."""
        return None

    def open_masters(self, path: Path) -> "TensorSource | None":
        """The fp32 master copies of a checkpoint whose weights are 16-bit, under the names :meth:`open` gives the
        weights, where the format saves them (a resume into an fp32 model takes these); ``None`` otherwise."""
        return None

    def training_extras(self, path: Path) -> dict[str, Any]:
        """What else of a foreign checkpoint continues a run: ``lr_scheduler`` (a scheduler's state dict) and
        ``param_groups`` (the optimizer's hyper-parameters per group), where the format saves them."""
        return {}

    def read_value(self, folder: "Folder", key: str) -> Any:
        """The value saved under the top-level ``key`` of a state folder (a scheduler kept beside an optimizer)."""
        raise ConfigError(f"the {self.name} format keeps no values beside its tensors")

    def snapshot(self, state_dict: dict[str, Any], model: Any) -> dict[str, Any]:
        """Training thread, collective: the state dict as this format will write it (by default as is;
        a format that writes whole tensors gathers them here, before the state is staged)."""
        return state_dict

    def save_shards(self, state_dict: dict[str, Any], writer: "FolderWriter", rel: str,
                    ctx: ShardContext) -> dict[str, str]:
        raise ConfigError(f"the {self.name} format cannot hold a model inside a step directory")

    def load_shards(self, target: dict[str, Any], folder: "Folder", *, strict: bool, ctx: ShardContext) -> None:
        raise ConfigError(f"the {self.name} format cannot be loaded into live tensors")

    # a whole state (tensors and small values, possibly nested): the optimizer's --------------------------
    def save_state(self, state: dict[str, Any], writer: "FolderWriter", rel: str, ctx: ShardContext) -> dict[str, str]:
        """Write one rank's part of a state holding tensors and plain values (collective)."""
        raise ConfigError(f"the {self.name} format cannot hold a training state")

    def state_index(self, folder: "Folder") -> dict[str, TensorInfo | None]:
        """Every key of a saved state, dotted (``optim.state.<fqn>.exp_avg``); ``None`` for plain values."""
        raise ConfigError(f"the {self.name} format cannot hold a training state")

    def read_state(self, folder: "Folder") -> dict[str, Any]:
        """Every entry of a saved state, whole, on this process alone, keyed by dotted names (no live objects
        needed: what ``convert`` uses to carry an optimizer to another format)."""
        raise ConfigError(f"the {self.name} format cannot hold a training state")

    def state_values(self, folder: "Folder") -> dict[str, Any]:
        """Every entry of a saved state that is not a tensor (hyper-parameters, counters), keyed by dotted names; its
        tensors are then read one at a time through :meth:`open` of the folder (what streams a whole state)."""
        import torch

        return {k: v for k, v in self.read_state(folder).items() if not isinstance(v, torch.Tensor)}

    def load_state(self, target: dict[str, Any], folder: "Folder", ctx: ShardContext) -> None:
        """Collective: fill ``target`` (nested like the saved state) in place: its tensors (local shards)
        from the stored chunks, its other entries with the stored values."""
        raise ConfigError(f"the {self.name} format cannot hold a training state")

    def checkpoint_summary(self, path: Path) -> dict[str, Any]:
        """One checkpoint of this format as a line of ``ckptio list`` says it: ``label`` (what it is), ``step``
        (``None`` when it records none) and ``carries`` (what a restore from it loads)."""
        opened = self.open(path)
        try:
            step = opened.step or None
        finally:
            opened.close()
        adam = type(self).open_adam is not Format.open_adam
        return {"label": self.summary.split(" (")[0], "step": step,
                "carries": "weights and Adam state where it has them" if adam else "weights only"}

    def describe(self, path: Path) -> dict[str, Any]:
        """A JSON-ready description; by default the index of what :meth:`open` finds."""
        from dataclasses import asdict

        from .common import summarize_index

        opened = self.open(path)
        try:
            index = opened.source.index()
        finally:
            opened.close()
        files = _files(path)
        out = {"path": str(path), "kind": self.name, "label": self.summary,
               "tensors": asdict(summarize_index(index)), "files": files, "total_bytes": sum(files.values())}
        if path.is_dir() and "config.json" in files:
            architecture = architecture_of(path / "config.json")
            if architecture:
                out["architecture"] = architecture
        return out

    @property
    def has_index(self) -> bool:
        return type(self).index is not Format.index

    @property
    def readable(self) -> bool:
        return type(self).open is not Format.open

    @property
    def writable(self) -> bool:
        return type(self).write is not Format.write


def architecture_of(config_json: Path) -> str | None:
    """The model class a Hugging Face ``config.json`` names (``architectures[0]``, else ``model_type``)."""
    from ..errors import CheckpointError
    from .common import read_json

    try:
        config = read_json(config_json, max_size=16 << 20)
    except CheckpointError:
        return None  # describing must not fail on a side file; loading reports it
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    return config["model_type"] if isinstance(config.get("model_type"), str) else None


def _files(path: Path) -> dict[str, int]:
    from ..storage.confined import Folder

    if path.is_file():
        return {path.name: path.stat().st_size}
    return {e.name: e.size for e in Folder(path).listdir() if e.kind == "file"}


_REGISTRY: dict[str, Format] = {}
_loaded = False


def register(fmt: Format) -> Format:
    """Add ``fmt`` to the registry (once per name)."""
    if not fmt.name:
        raise ConfigError(f"{type(fmt).__name__} has no name")
    if fmt.name in _REGISTRY and type(_REGISTRY[fmt.name]) is not type(fmt):
        raise ConfigError(f"a format named {fmt.name!r} is already registered ({type(_REGISTRY[fmt.name]).__name__})")
    _REGISTRY[fmt.name] = fmt
    return fmt


def _load_builtins() -> None:
    """Import the format modules that ship with ckptio (each registers itself)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    from . import BUILTIN_FORMATS

    for module in BUILTIN_FORMATS:
        importlib.import_module(f"{__package__}.{module}")


def get(name: str) -> Format:
    """The registered format called ``name``; a :class:`~ckptio.errors.ConfigError` listing the known ones otherwise."""
    _load_builtins()
    fmt = _REGISTRY.get(name)
    if fmt is None:
        raise ConfigError(f"unknown format {name!r}; ckptio knows {names()}")
    return fmt


def names(*, readable: bool = False, writable: bool = False) -> list[str]:
    """Registered format names in detection order (only those that can be read / written, when asked)."""
    _load_builtins()
    return [f.name for f in sorted(_REGISTRY.values(), key=lambda f: (f.priority, f.name))
            if (not readable or f.readable) and (not writable or f.writable)]


def detect(path: str | Path) -> Format:
    """The format of ``path``, from its layout alone; an error naming the path when none fits."""
    _load_builtins()
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise CheckpointNotFoundError(f"{path}: no such file or folder")
    for fmt in sorted(_REGISTRY.values(), key=lambda f: (f.priority, f.name)):
        if fmt.detect(path):
            return fmt
    if path.is_dir():
        from ..engine.manifest import MANIFEST_NAME

        if any(p.is_dir() and (p / MANIFEST_NAME).is_file() for p in path.iterdir()):
            raise CheckpointError(f"{path} is a checkpoint folder holding several checkpoints; "
                                  f"use 'ckptio list {path}'")
        raise CheckpointError(f"{path}: not a checkpoint folder ckptio knows (no manifest, DCP metadata, "
                              ".safetensors files, adapter or model_config.yaml)")
    raise CheckpointError(f"{path}: unknown file type (ckptio reads {', '.join(names(readable=True))})")
