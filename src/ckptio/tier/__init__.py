"""The memory tier: frequent snapshots in node-local memory, each part held on ``memory_replicas`` nodes placed over
failure domains (:mod:`.placement`), restored before the durable tier when they are newer (see
:mod:`ckptio.tier.memory`)."""

from .memory import MemoryTier

__all__ = ["MemoryTier"]
