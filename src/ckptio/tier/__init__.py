"""The memory tier: frequent snapshots in node-local memory, replicated on a peer node, restored before the
durable tier when they are newer (see :mod:`ckptio.tier.memory`)."""

from .memory import MemoryTier

__all__ = ["MemoryTier"]
