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

from .config import CheckpointConfig  # noqa: E402
from .data import ResumableDataLoader  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigError,
)
from .layout import committed_checkpoints, newest_checkpoint  # noqa: E402
from .manager import CheckpointManager, RestoreInfo, Stateful  # noqa: E402
from .manifest import Manifest, read_manifest  # noqa: E402
from .formats.nemo_model import NemoModel, restore_nemo, save_nemo  # noqa: E402
from .pretrained import load_pretrained  # noqa: E402
from .state import ModelState, OptimizerState, RNGState  # noqa: E402
from .step_scheduler import StepScheduler  # noqa: E402

__all__ = [
    "__version__",
    "CheckpointConfig",
    "CheckpointManager",
    "RestoreInfo",
    "Stateful",
    "load_pretrained",
    "save_nemo",
    "restore_nemo",
    "NemoModel",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "ResumableDataLoader",
    "StepScheduler",
    "Manifest",
    "read_manifest",
    "committed_checkpoints",
    "newest_checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointMismatchError",
    "CheckpointCorruptError",
    "ConfigError",
]
