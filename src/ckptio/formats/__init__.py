"""How bytes are laid out: one module per checkpoint format, each a :class:`~ckptio.formats.registry.Format`
registered once (see :mod:`ckptio.formats.registry` and docs/architecture.md)."""

from .common import TensorInfo

__all__ = ["TensorInfo", "BUILTIN_FORMATS"]

BUILTIN_FORMATS = ("dcp.format", "safetensors.hf_bundle", "lightning", "megatron.format", "deepspeed.format", "nemo.format",
                   "safetensors.peft_adapter", "safetensors.format", "step_dir", "torch_file")
"""The modules of the formats that ship with ckptio; each registers its :class:`~.registry.Format` when the
registry first loads them (data, so that the registry imports none of the modules that import it)."""
