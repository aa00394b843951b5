"""A ZeRO-3 folder of many ranks and many frozen parameters resumes with each file opened a few times, whatever the
number of parameters (issue 67, row 12: 8 ranks and 300 frozen parameters ended in ``OSError [Errno 24] Too many open files``, every
rank's model-states file reopened for each frozen parameter).

The folder is synthetic, in DeepSpeed's ZeRO-3 layout (what ``tests/ds_run.py`` has the real DeepSpeed write, whose
values ``test_deepspeed.py`` compares bitwise): the real DeepSpeed cannot run 64 ranks on this machine."""

from __future__ import annotations

import math
import os
import collections
import resource
import sys

import torch

from ckptio import CheckpointConfig, CheckpointManager

RANKS, FROZEN = 64, 1000
SHAPE = (3, 7)


def _zero3_folder(root, ranks: int, frozen: int) -> dict[str, torch.Tensor]:
    """``root/global_step3/`` as DeepSpeed's ZeRO-3 writes it on ``ranks`` ranks: one trainable ``w`` and ``frozen``
    frozen parameters ``f<i>``, each split in ``ceil(numel / ranks)`` pieces, one per rank's model-states file (the
    last ones padded). Returns the whole values."""
    tag = root / "global_step3"
    tag.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    values = {f"f{i}": torch.randn(SHAPE, generator=g) for i in range(frozen)}
    values["w"] = torch.randn(ranks * 2, generator=g)
    part = math.ceil(math.prod(SHAPE) / ranks)
    padded = {n: torch.cat([v.flatten(), torch.zeros(part * ranks - v.numel())]) for n, v in values.items() if n != "w"}
    for r in range(ranks):
        torch.save({
            "module": {}, "buffer_names": [], "param_shapes": [{"w": (ranks * 2,)}], "shared_params": {},
            "frozen_param_shapes": {n: SHAPE for n in padded},
            "frozen_param_fragments": {n: v[r * part:(r + 1) * part].clone() for n, v in padded.items()},
            "lr_scheduler": None, "global_steps": 3, "dp_world_size": ranks, "mp_world_size": 1,
            "ds_config": {"zero_optimization": {"stage": 3}},
        }, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        w = values["w"][2 * r:2 * r + 2].clone()
        torch.save({"optimizer_state_dict": {
            "zero_stage": 3, "partition_count": ranks, "fp32_flat_groups": [w],
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2),
                                                   "exp_avg_sq": torch.zeros(2)}},
                                     "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8,
                                                       "weight_decay": 0.0, "params": [0]}]}}},
            tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("global_step3")
    return values


class _Model(torch.nn.Module):
    def __init__(self, frozen: int, ranks: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(ranks * 2))
        for i in range(frozen):
            self.register_parameter(f"f{i}", torch.nn.Parameter(torch.zeros(SHAPE), requires_grad=False))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


_OPENS: collections.Counter[str] | None = None
"""While set, the names of the ZeRO files this process opens (an audit hook: the real ``open`` calls counted)."""


def _count_opens(event: str, args: tuple) -> None:
    if _OPENS is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        name = os.fsdecode(args[0]).rsplit("/", 1)[-1]
        if name.startswith("zero_pp_rank_"):
            _OPENS[name] += 1


sys.addaudithook(_count_opens)


def test_many_ranks_and_frozen_parameters_resume_opening_each_file_a_few_times_under_a_low_open_file_limit(tmp_path):
    global _OPENS
    values = _zero3_folder(tmp_path / "run", RANKS, FROZEN)
    model = _Model(FROZEN, RANKS)
    opt = torch.optim.AdamW([model.w], lr=0.01)
    manager = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model, optimizer=opt)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = _open_fds()
    # each rank's two files open at once, never one per rank and frozen parameter: a limit far below the default
    # 1024 of most systems (the reader that reopened the files ran out of descriptors under 1024 with 8 ranks)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(before + 2 * RANKS + 32, hard), hard))
    try:
        _OPENS = collections.Counter()
        info = manager.restore(str(tmp_path / "run"))
        opens = _OPENS
    finally:
        _OPENS = None
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    manager.close()
    assert info.step == 3 and info.counters["source_format"] == "deepspeed"
    for name, value in values.items():
        assert torch.equal(getattr(model, name).detach(), value), name
    assert _open_fds() <= before + 2  # all closed again
    # every rank's two files, each opened a few times (checked, read), never once per frozen parameter: the
    # quadratic reader opened each model-states file 1000 times here and took minutes for 8 ranks and 600 parameters
    assert len(opens) == 2 * RANKS, sorted(opens)
    assert max(opens.values()) <= 4, opens.most_common(3)
