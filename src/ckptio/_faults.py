"""Named points on the save, commit and delete paths where a test can simulate a crash.

``point(name)`` does nothing unless a test installed a hook with :func:`set_hook`; a hook that raises a
``BaseException`` there leaves the disk exactly as a process killed at that instant would (the manager
cleans up after ordinary exceptions only). Production code never installs a hook.
"""

from __future__ import annotations

from typing import Callable

_hook: Callable[[str], None] | None = None

POINTS = (
    "save.staging_copies",
    "save.states_written",
    "save.before_link",
    "commit.before_manifest",
    "commit.before_rename",
    "commit.after_exchange",
    "commit.after_moving_old",
    "commit.before_pointer",
    "commit.before_retention",
    "retention.before_delete",
    "retention.optimizer_after_manifest",
    "delete.after_hide",
    "sweep.before_remove",
    "s3.hand_over.copied",
    "s3.swap.uncommitted",
    "s3.swap.copied",
    "memory.states_written",
    "memory.replicating",
    "memory.replicated",
    "memory.committed",
    "framework.background_write",
    "dcp.item_written",
)


def set_hook(hook: Callable[[str], None] | None) -> None:
    global _hook
    _hook = hook


def point(name: str) -> None:
    if _hook is not None:
        _hook(name)
