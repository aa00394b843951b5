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
    "RestoreInfo": "engine.restoring",
    "Stateful": "manager",
    "load_pretrained": "adopt.pretrained",
    "save_nemo": "formats.nemo.model",
    "restore_nemo": "formats.nemo.model",
    "NemoModel": "formats.nemo.model",
    "megatron_schedule": "formats.megatron.schedule",
    "MegatronLRScheduler": "formats.megatron.schedule",
    "export_qnemo": "formats.nemo.qnemo",
    "load_qnemo": "formats.nemo.qnemo",
    "ModelState": "state",
    "OptimizerState": "state",
    "RNGState": "state",
    "ResumableDataLoader": "data",
    "ResumableSampler": "data",
    "LoadReport": "engine.partial",
    "StepScheduler": "step_scheduler",
    "Manifest": "engine.manifest",
    "read_manifest": "engine.manifest",
    "committed_checkpoints": "engine.layout",
    "newest_checkpoint": "engine.layout",
    "CheckpointError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointMismatchError": "errors",
    "CheckpointCorruptError": "errors",
    "ConfigError": "errors",
    "NoUsableCheckpointError": "errors",
}

__all__ = [  # the same names as _EXPORTS (tests/test_packaging.py keeps them in step)
    "__version__", "CheckpointConfig", "CheckpointManager", "RestoreInfo", "Stateful", "load_pretrained", "save_nemo",
    "restore_nemo", "NemoModel", "megatron_schedule", "MegatronLRScheduler", "export_qnemo", "load_qnemo",
    "ModelState", "OptimizerState", "RNGState", "ResumableDataLoader", "ResumableSampler",
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
    from .engine.partial import LoadReport
    from .errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointNotFoundError,
                         ConfigError, NoUsableCheckpointError)
    from .formats.nemo.model import NemoModel, restore_nemo, save_nemo
    from .formats.nemo.qnemo import export_qnemo, load_qnemo
    from .formats.megatron.schedule import MegatronLRScheduler, megatron_schedule
    from .engine.layout import committed_checkpoints, newest_checkpoint
    from .manager import CheckpointManager, Stateful
    from .engine.manifest import Manifest, read_manifest
    from .adopt.pretrained import load_pretrained
    from .engine.restoring import RestoreInfo
    from .state import ModelState, OptimizerState, RNGState
    from .step_scheduler import StepScheduler
