"""``restore(restore_from=...)`` from a checkpoint ckptio did not write: its weights into the live model.

Any format ckptio reads (a Megatron-LM or Megatron-Core run folder, a ``.nemo`` archive, a Hugging Face
folder, a DCP folder, a Lightning ``.ckpt``...) can start a run: the source is opened through the format
registry under Hugging Face names, and every rank copies into its own part of each parameter (a plain
tensor whole, an FSDP/TP shard its slice) the matching slice of the source tensor. Strictness follows
``CheckpointConfig.strict``; dtypes must match. Weights travel, and Adam's moments and step where the
source has them in a form ckptio maps (a Megatron-Core distributed checkpoint); the scheduler and data
position start fresh (said in the log), and the step is the source's iteration where it records one.

Call sequence: collective (every rank calls it at the same point); each rank reads the source itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _dist
from .automodel import NAME, adopt, ckptio_mark
from ..errors import CheckpointError, CheckpointMismatchError
from ..formats import registry
from ..formats.common import TensorInfo, check_compatible, dtype_name
from ..engine.manifest import MANIFEST_NAME
from ..engine.plan import local_view
from ..state import hyper
from ..storage.confined import Folder

__all__ = ["is_foreign", "foreign_run", "unreadable_error", "restore_foreign", "restore_foreign_adam"]


def is_foreign(restore_from: str | None) -> bool:
    """Whether ``restore_from`` is a path to a checkpoint of another kind than a ckptio step directory."""
    if restore_from is None or "://" in restore_from:
        return False
    path = Path(restore_from)
    if not path.exists() or (path / MANIFEST_NAME).is_file():
        return False
    if path.is_dir() and ((path / "model").is_dir() or (path / "optim").is_dir()):
        # a step directory: a NeMo AutoModel step is resumed whole, like a ckptio step; one ckptio wrote that lost
        # its manifest is damaged, never another tool's checkpoint: the step-directory path reports both
        try:
            folder = Folder(path)
            if NAME.fullmatch(path.name) and adopt(folder, path.name) is not None or ckptio_mark(folder) is not None:
                return False
        except CheckpointError:
            return False  # the step-directory path reports what is wrong with it
    try:
        fmt = registry.detect(path)
    except Exception:  # not a format at all: the step-directory path reports it
        return False
    return fmt.name != "step_dir" and fmt.readable


UNREADABLE = (
    ("Orbax", lambda files, dirs: "_CHECKPOINT_METADATA" in files or any((d / "_CHECKPOINT_METADATA").is_file()
                                                                        for d in dirs)),
    ("DeepSpeed (a global_stepN folder without its model-states file)", lambda files, dirs: any(
        d.name.startswith("global_step") and any(d.glob("*optim_states.pt")) for d in dirs)),
    ("Megatron (an iter_N folder)", lambda files, dirs: any(d.name.startswith("iter_") for d in dirs)),
    ("Hugging Face Trainer (checkpoint-N folders)", lambda files, dirs: any(d.name.startswith("checkpoint-") for d in dirs)),
    ("PyTorch Lightning (.ckpt files)", lambda files, dirs: any(f.endswith(".ckpt") for f in files)),
)
"""Checkpoints of kinds an automatic resume cannot continue, recognised by the names in the folder (its files, its
folders): a folder holding them is refused by name instead of a run starting from scratch beside them."""


def foreign_run(root: Any) -> tuple[Path | None, list[str]]:
    """What an automatic resume finds in a checkpoint folder that holds no ckptio checkpoint: the folder itself when
    it is a training run of another tool that a resume continues (a format with ``resumes_runs``: DeepSpeed), else
    the kinds of the checkpoints it holds that ckptio cannot resume from (``[]``: none, a fresh start)."""
    if not isinstance(root, Path) or not root.is_dir():
        return None, []  # a bucket holds ckptio's steps only
    try:
        fmt = registry.detect(root)
    except CheckpointError:
        fmt = None
    if fmt is not None and fmt.resumes_runs:
        return root, []
    try:
        entries = [e for e in root.iterdir() if not e.is_symlink()]
        files, dirs = {e.name for e in entries if e.is_file()}, [e for e in entries if e.is_dir()]
        kinds = [name for name, test in UNREADABLE if test(files, dirs)]
    except OSError:
        kinds = []
    if fmt is not None and fmt.name != "step_dir":
        kinds.insert(0, f"{fmt.summary} ({fmt.name})")
    return None, kinds


def unreadable_error(root: Any, kinds: list[str]) -> Exception:
    """The error of an automatic resume in ``root``, which holds checkpoints of ``kinds`` and none of ckptio's."""
    from ..errors import NoUsableCheckpointError

    return NoUsableCheckpointError(
        f"{root} holds no ckptio checkpoint but holds checkpoints of another kind: {'; '.join(kinds)}. An automatic "
        "resume does not start from scratch beside them: name one with restore_from= (ckptio reads "
        f"{', '.join(registry.names(readable=True))}), or use an empty checkpoint_dir", [(str(root), kinds[0])])


def _slice_of(full: Any, view: Any) -> Any:
    """The part of a whole source tensor that a rank's local view (``plan.local_view``) covers."""
    return full[tuple(slice(o, o + n) for o, n in zip(view.offsets, view.local.shape))]


def _fill_moments(path: Path, model_state: Any, optimizer: Any, step: float, moments: dict[str, Any]) -> None:
    """Every optimized parameter's Adam state: the source's moments (this rank's slice of each) and step."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..formats.live_experts import as_live

    names = {id(p): model_state._strip(n) for n, p in model_state.model.named_parameters()}
    moments = {m: as_live(source, set(names.values())) for m, source in moments.items()}  # fused experts
    indexes = {moment: source.index() for moment, source in moments.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
            view = local_view(p.detach())
            for moment, source in moments.items():
                if names[id(p)] not in indexes[moment]:
                    raise CheckpointMismatchError(f"{path}: no {moment} for {names[id(p)]!r}")
                local = _slice_of(source.read(names[id(p)]), view).to(view.local.dtype).clone()
                # the parameter's own global shape and stride: inferred from the local shard, an uneven split
                # (a [1, N] gate over 2 ranks: 1 row and 0) would give each rank another global shape
                state[moment] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride()) \
                    if isinstance(p, DTensor) else local
            optimizer.state[p] = state


def restore_foreign_adam(path: Path, model_state: Any, optimizer: Any, scheduler: Any, log: Any) -> tuple[bool, bool]:
    """Collective: give ``optimizer`` (Adam or AdamW) the source's moments and step, each rank its slices, and the
    hyper-parameters and ``scheduler`` (may be ``None``) the state the run had reached, where the format saves them
    (:meth:`~ckptio.formats.registry.Format.training_extras`). Returns whether the source had the Adam state and
    whether the scheduler's was loaded; any other optimizer, or a source without them, starts fresh."""
    fmt = registry.detect(path)
    if not all("betas" in group for group in optimizer.param_groups):
        if _dist.rank() == 0:
            log.warning("%s: only Adam/AdamW state is carried over; %s starts fresh", path, type(optimizer).__name__)
        return False, False

    def fill() -> tuple[bool, bool]:
        found = fmt.open_adam(path)
        if found is None:
            return False, False
        step, moments = found
        try:
            # the hyper-parameters the run had reached (its lr) and the scheduler's state, checked against the live
            # objects before anything (the moments included) is applied
            extras = fmt.training_extras(path)
            groups = extras.get("param_groups") or []
            groups = [{k: v for k, v in saved.items() if k in live and k != "params"}
                      for live, saved in zip(optimizer.param_groups, groups)] \
                if len(groups) == len(optimizer.param_groups) else []
            if groups:
                hyper.check_groups(optimizer.param_groups, groups, f"{path} (its optimizer's parameter groups)")
            schedule = extras.get("lr_scheduler") if scheduler is not None else None
            if schedule is not None:
                hyper.check(scheduler, schedule, f"{path} (its LR scheduler state)")
            _fill_moments(path, model_state, optimizer, step, moments)
        finally:
            for source in moments.values():
                source.close()
        for live, saved in zip(optimizer.param_groups, groups):
            live.update(saved)
        if schedule is None:
            return True, False
        scheduler.load_state_dict(schedule)
        return True, True

    carried, scheduled = _dist.run_collectively(f"loading the optimizer state of {path}", fill)
    if _dist.rank() == 0:
        log.info("%s the Adam state (moments and step)%s of %s", "Loaded" if carried else "Found no",
                 " and the LR scheduler state" if scheduled else "", path)
    return carried, scheduled


def restore_foreign(path: Path, model_state: Any, *, strict: bool, log: Any) -> tuple[int, str]:
    """Collective: fill the live model from ``path``; returns the source's step (0 if it has none) and format."""
    fmt = registry.detect(path)
    target = model_state.state_dict()

    def fill() -> int:
        opened = fmt.open(path)
        masters = None
        try:
            from ..formats.live_experts import as_live

            source = as_live(opened.source, target)  # a Mixtral's experts, fused in memory by transformers 5
            index = source.index()
            live = {k: TensorInfo(tuple(v.shape), dtype_name(v.dtype)) for k, v in target.items()}
            check_compatible(index, live, f"{path} ({fmt.name})", strict=strict)
            if any(index[k].dtype != live[k].dtype for k in live) and \
                    all(live[k].dtype == "float32" for k in live):  # a 16-bit run into an fp32 model: its masters
                masters = fmt.open_masters(path)
                if masters is not None:
                    source = as_live(masters, target)
                    index = source.index()
                    check_compatible(index, live, f"{path} ({fmt.name}, fp32 master copies)", strict=strict)
            wrong = [f"{k}: {index[k].dtype} in the checkpoint, {live[k].dtype} in the model" for k in live
                     if index[k].dtype != live[k].dtype]
            if wrong:
                raise CheckpointMismatchError(f"{path}: dtypes differ ({'; '.join(wrong[:3])}); build the model in "
                                              "the checkpoint's dtype, or convert the checkpoint with --dtype")
            for key, value in target.items():
                view = local_view(value)
                if view.local.numel() == 0:
                    continue
                view.local.copy_(_slice_of(source.read(key), view))
            return opened.step
        finally:
            opened.close()
            if masters is not None:
                masters.close()

    step = _dist.run_collectively(f"loading the weights of {path}", fill)
    _dist.run_collectively("applying the weights", lambda: model_state.load_state_dict(target))
    if _dist.rank() == 0:
        log.info("Loaded the weights of %s (%s, step %d); the data position starts fresh",
                 path, fmt.summary, step)
    return step, fmt.name
