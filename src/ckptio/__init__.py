"""ckptio: checkpoint PyTorch training runs — whole state, any number of ranks, ecosystem formats.

Typical use, on every rank::

    from ckptio import CheckpointConfig, CheckpointManager

    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir="checkpoints"), model=model,
                            optimizer=opt, lr_scheduler=sched, dataloader=loader, step_scheduler=steps)
    mgr.restore()                      # resumes from the newest complete checkpoint, if any
    ...
    mgr.save()                         # at a checkpoint step
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

# Public names -> the module that defines them. They are imported on first use, so that ``import ckptio``
# (and the ``ckptio`` command's ``--help``) does not pay for torch, transformers or DCP until needed.
_EXPORTS = {
    "CheckpointConfig": "config",
    "CheckpointManager": "manager",
    "RestoreInfo": "restoring",
    "Stateful": "manager",
    "load_pretrained": "pretrained",
    "save_nemo": "formats.nemo_model",
    "restore_nemo": "formats.nemo_model",
    "NemoModel": "formats.nemo_model",
    "ModelState": "state",
    "OptimizerState": "state",
    "RNGState": "state",
    "ResumableDataLoader": "data",
    "ResumableSampler": "data",
    "LoadReport": "partial",
    "StepScheduler": "step_scheduler",
    "Manifest": "manifest",
    "read_manifest": "manifest",
    "committed_checkpoints": "layout",
    "newest_checkpoint": "layout",
    "CheckpointError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointMismatchError": "errors",
    "CheckpointCorruptError": "errors",
    "ConfigError": "errors",
    "NoUsableCheckpointError": "errors",
}

__all__ = [  # the same names as _EXPORTS (tests/test_packaging.py keeps them in step)
    "__version__", "CheckpointConfig", "CheckpointManager", "RestoreInfo", "Stateful", "load_pretrained", "save_nemo",
    "restore_nemo", "NemoModel", "ModelState", "OptimizerState", "RNGState", "ResumableDataLoader", "ResumableSampler",
    "StepScheduler", "LoadReport", "Manifest", "read_manifest", "committed_checkpoints", "newest_checkpoint", "CheckpointError",
    "CheckpointNotFoundError", "CheckpointMismatchError", "CheckpointCorruptError", "ConfigError", "NoUsableCheckpointError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptio' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what IDEs and type checkers see
    from .config import CheckpointConfig
    from .data import ResumableDataLoader, ResumableSampler
    from .partial import LoadReport
    from .errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                         ConfigError, NoUsableCheckpointError)
    from .formats.nemo_model import NemoModel, restore_nemo, save_nemo
    from .layout import committed_checkpoints, newest_checkpoint
    from .manager import CheckpointManager, Stateful
    from .manifest import Manifest, read_manifest
    from .pretrained import load_pretrained
    from .restoring import RestoreInfo
    from .state import ModelState, OptimizerState, RNGState
    from .step_scheduler import StepScheduler
