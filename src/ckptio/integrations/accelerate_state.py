"""What ``CkptioAccelerator`` (:mod:`ckptio.accelerate`) writes and reads through accelerate's own code: the states
loaded by accelerate's reader, the folder committed with its manifest (:func:`committer`), the writes of a background
save split from the copies it takes (:func:`staged_writer`), and ``save_state()`` into object storage with
``ckptio_checkpoint_dir`` (:func:`save_state`; :mod:`ckptio.integrations.framework_bucket`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from .framework_bucket import BucketRun

__all__ = ["NAME", "load_accelerate_state", "committer", "states_of", "staged_writer", "save_state"]

NAME = re.compile(r"^checkpoint_(\d+)$")
"""accelerate's checkpoint folder name (automatic naming); its group is the iteration."""


def load_accelerate_state(self: Any, path: Path, load_kwargs: dict | None, kwargs: dict[str, Any]) -> None:
    """What ``Accelerator.load_state`` loads for a DDP or single-process run (``self``: the ``CkptioAccelerator``):
    models, optimizers, schedulers, dataloaders, scaler, RNG, ``step``, through accelerate's own reader, which reads
    them with ``weights_only``; the registered objects, which it would unpickle without restriction, are left out."""
    import inspect

    from accelerate import __version__ as accelerate_version
    from accelerate.checkpointing import load_accelerator_state
    from accelerate.utils import DistributedType

    models = list(self._models)
    for hook in self._load_model_state_pre_hook.values():
        hook(models, str(path))
    map_location = kwargs.pop("map_location", None)
    if map_location is None:
        # as accelerate decides it (older releases have no multi_device: the accelerator types they listed)
        multi = getattr(self, "multi_device", str(self.distributed_type.value) in (
            "MULTI_GPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_NPU"))
        map_location = "on_device" if self.num_processes > 1 and multi and \
            self.distributed_type != DistributedType.MULTI_XPU else "cpu"
    if "load_kwargs" in inspect.signature(load_accelerator_state).parameters:  # newer accelerate
        kwargs["load_kwargs"] = load_kwargs
    elif load_kwargs:
        raise ValueError(f"load_kwargs needs a newer accelerate than {accelerate_version}")
    override = load_accelerator_state(str(path), models, self._optimizers, self._schedulers, self._dataloaders,
                                      self.state.process_index, self.scaler, map_location, **kwargs)
    if "step" in override:
        self.step = override["step"]


def committer(accelerator: Any, final: Path, tmp: Path, auto: bool) -> Any:
    """The main process's commit of ``tmp`` as ``final`` and ``total_limit`` after it (with automatic naming), with
    what they need of the accelerator read now (a background save commits while training goes on)."""
    from .framework_dirs import commit, remove_oldest
    from ..storage.local import LocalFolderWriter

    step, world = accelerator.project_configuration.iteration, accelerator.num_processes
    steps = accelerator.ckptio_steps.step  # the optimizer steps done (the resume audit's count)
    limit, complete = accelerator.project_configuration.total_limit, accelerator._ckptio_complete

    def run() -> None:
        writer = LocalFolderWriter(final, tmp)
        commit(writer, step=step, epoch=0, world_size=world, states=states_of(writer.files()),
               counters={"steps": steps})
        if auto:
            remove_oldest(final.parent, NAME, limit, check=complete, saved=final.name, setting="total_limit")

    return run


def states_of(files: dict[str, int]) -> dict[str, Any]:
    """The manifest's states of a folder of accelerate's holding ``files`` (each file one state, under its stem)."""
    from ..engine.manifest import StateEntry

    return {name.split(".")[0]: StateEntry("object" if name.startswith(("custom", "scheduler")) else
                                           "optimizer" if name.startswith("optimizer") else "model",
                                           "safetensors" if name.endswith(".safetensors") else "pt", name)
            for name in files if not name.startswith("random_states_")}


def staged_writer(acc: Any, tmp: Path, safe: bool) -> Any:
    """What ``Accelerator.save_state`` writes for a DDP or single-process run, split for a background save: the
    samplers, the scaler and the RNG states (small, of this instant) written now through accelerate's own
    ``save_accelerator_state``; the models, optimizers, schedulers and registered objects copied now and written by
    the returned function through accelerate's ``save``, under accelerate's names."""
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, WEIGHTS_NAME, save

    from .framework_async import reached_writing

    each_node = acc.project_configuration.save_on_each_node
    weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, weights, str(tmp))
    save_accelerator_state(str(tmp), [], [], [], acc._dataloaders, acc.state.process_index, acc.step, acc.scaler,
                           save_on_each_node=each_node, safe_serialization=safe)
    weights, others = acc._ckptio_saves.stage(weights, acc._models,
                                              optimizers=[o.state_dict() for o in acc._optimizers],
                                              schedulers=[s.state_dict() for s in acc._schedulers],
                                              custom=[obj.state_dict() for obj in acc._custom_objects])

    def write() -> None:
        for i, state in enumerate(weights):
            name = SAFE_WEIGHTS_NAME if safe else WEIGHTS_NAME
            save(state, tmp / (name.replace(".", f"_{i}.") if i else name), save_on_each_node=each_node,
                 safe_serialization=safe)
        reached_writing()
        for what, prefix in (("optimizers", OPTIMIZER_NAME), ("schedulers", SCHEDULER_NAME)):
            for i, state in enumerate(others[what]):
                save(state, tmp / f"{prefix}{f'_{i}' if i else ''}.bin", save_on_each_node=each_node)
        for i, state in enumerate(others["custom"]):
            save(state, tmp / f"custom_checkpoint_{i}.pkl", save_on_each_node=each_node)

    return write


def save_state(acc: Any, run: BucketRun, safe_serialization: bool, save: Callable[[str], Any]) -> str:
    """``CkptioAccelerator.save_state()`` into ``run``: every process writes what accelerate writes into its own local
    spool (``save``: accelerate's ``save_state`` into a folder; in the background with ``async_save``, the staged
    writer) and uploads it;
    the main process commits the folder and applies ``total_limit`` there. Returns the folder's URL."""
    from .framework_dirs import commit

    config = acc.project_configuration
    name = f"checkpoint_{acc.save_iteration}"
    acc.ckptio_steps.flush()
    acc._ckptio_audited(run.url).saved(acc.ckptio_steps.step, key=config.iteration)
    timer = acc.ckptio_numbers.start(step=config.iteration, folder=run.location(name))
    main, saves = acc.is_main_process, acc._ckptio_saves
    writer = run.begin(name, main, acc.wait_for_everyone)
    tmp = writer.local_path()
    if saves is not None:
        write = staged_writer(acc, tmp, safe_serialization)
        config.iteration += 1
    else:
        auto, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
        try:
            save(str(tmp))
        finally:
            config.automatic_checkpoint_naming = auto
    sums: dict[str, str] = {}
    step, world, steps, limit = config.iteration, acc.num_processes, acc.ckptio_steps.step, config.total_limit

    def commit_now() -> None:
        commit(writer, step=step, epoch=0, world_size=world, states=states_of(writer.files()),
               counters={"steps": steps}, name=name, sums=sums)
        run.rotate(limit, frozenset(), name)

    wrapped = timer.wrap(commit_now if main else None, background=saves is not None)
    if saves is not None:
        run.save_in_background(saves, writer, write, main, wrapped, sums)
        timer.returned()
        return run.location(name)
    sums.update(run.publish(writer, tmp, main))
    if wrapped is not None:
        wrapped()
    acc.wait_for_everyone()  # committed before any process reads it
    acc._ckptio_log()
    return run.location(name)
