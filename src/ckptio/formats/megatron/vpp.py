"""Virtual pipeline stages (Megatron-LM's ``--virtual-pipeline-model-parallel-size V``): V model chunks per stage.

With P pipeline stages of V chunks each, the model's L layers are cut into P × V chunks of L / (P × V) layers,
dealt out round-robin: chunk ``v`` of stage ``p`` holds the layers from ``v × L / V + p × L / (P × V)`` on
(megatron-core's ``get_transformer_layer_offset``), so stage 0 of a PP=2 × VPP=2 run of 4 layers holds layers 0
and 2. The embedding is on chunk 0 of the first stage, the final norm and output layer on the last chunk of the
last stage. A legacy rank file then holds ``model0``, ``model1``... instead of ``model``, each chunk's layers
numbered from 0; a torch_dist checkpoint numbers them globally and is the same as without chunks.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import CheckpointCorruptError, ConfigError

__all__ = ["apply", "chunk_layers", "chunk_models"]

_CHUNK = re.compile(r"^model(\d+)$")


def chunk_models(obj: dict[str, Any], where: object) -> list[Any]:
    """The model state dicts a legacy rank file holds, in chunk order: ``[model]``, or ``model0``, ``model1``...
    with virtual pipeline stages (``[]`` when there is neither); refuses both at once and missing chunks."""
    numbered = sorted(int(m.group(1)) for m in map(_CHUNK.match, (k for k in obj if isinstance(k, str))) if m)
    if "model" in obj:
        if numbered:
            raise CheckpointCorruptError(f"{where}: holds both 'model' and the model chunks "
                                         f"{[f'model{n}' for n in numbered[:3]]}")
        return [obj["model"]]
    if numbered != list(range(len(numbered))):
        raise CheckpointCorruptError(f"{where}: holds the model chunks {[f'model{n}' for n in numbered[:6]]}, not "
                                     "model0, model1... without a gap")
    return [obj[f"model{n}"] for n in numbered]


def check_chunks(info: dict[str, Any], found: int, where: object) -> None:
    """Every rank file holds as many model chunks as the first, the run's recorded number (in its args, which must
    be an object of arguments)."""
    args = info.get("args")  # the first rank file's: refused here when it is no object of arguments
    if args is not None and not isinstance(args, dict) and not hasattr(args, "__dict__"):
        raise CheckpointCorruptError(f"{where}: the run's args are a {type(args).__name__}, not its arguments")
    if info.setdefault("vpp", found) != found:
        raise CheckpointCorruptError(f"{where}: holds {found} model chunk(s), the first rank file {info['vpp']}")
    check_recorded(info.get("args"), found, where)


def check_recorded(args: Any, found: int, where: object) -> None:
    """The number of chunks found is the ``virtual_pipeline_model_parallel_size`` the run recorded (if any)."""
    value = getattr(args, "virtual_pipeline_model_parallel_size", None) if args is not None else None
    if value is None and found == 1:
        return
    if type(value) is int and value == found or value is None and not hasattr(args, "num_layers"):
        return
    raise CheckpointCorruptError(f"{where}: holds {found} model chunk(s), but the run's "
                                 f"virtual_pipeline_model_parallel_size is {str(value)[:20]}")


def chunk_layers(layers: int, pp: int, vpp: int, stage: int, chunk: int) -> range:
    """The global layer numbers of chunk ``chunk`` on pipeline stage ``stage``."""
    per = layers // (pp * vpp)
    start = chunk * (layers // vpp) + stage * per
    return range(start, start + per)


def apply(args: Any, vpp: int | None) -> int:
    """Record ``vpp`` virtual pipeline stages in a run's ``args`` (after checking that they split its layers
    evenly) as Megatron-LM does; the number of chunks per stage (1 without)."""
    if vpp is None or vpp == 1:
        args.virtual_pipeline_model_parallel_size = None
        return 1
    if type(vpp) is not int or vpp < 1:
        raise ConfigError(f"--vpp must be a positive integer, got {vpp!r}")
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if pp < 2:
        raise ConfigError(f"--vpp needs --pp of 2 or more (virtual pipeline stages interleave pipeline stages), "
                          f"got --pp {pp}")
    if layers % (pp * vpp):
        raise ConfigError(f"cannot split {layers} layers into PP={pp} x {vpp} virtual pipeline stages: "
                          f"{pp * vpp} chunks of equal size")
    args.virtual_pipeline_model_parallel_size = vpp
    args.num_layers_per_virtual_pipeline_stage = layers // (pp * vpp)
    return vpp
