"""How bytes are laid out: one module per checkpoint format, each a :class:`~ckptio.formats.registry.Format`
registered once (see :mod:`ckptio.formats.registry` and docs/architecture.md)."""

from .common import TensorInfo

__all__ = ["TensorInfo"]
