"""YAML for files that may come from anywhere: bounded in size, no aliases, plain values only.

PyYAML's ``safe_load`` builds no Python objects beyond plain ones, but it still expands aliases: a few
hundred bytes of nested anchors (a "billion laughs" document) expand to gigabytes of lists. Checkpoint
configs (``model_config.yaml`` of a ``.nemo``, recipe configs) never need aliases, so a document that
uses one is refused, as is one larger than :data:`MAX_BYTES` or nested deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import CheckpointCorruptError

__all__ = ["load", "MAX_BYTES", "MAX_DEPTH"]

MAX_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 100


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that refuses aliases and deep nesting while composing the document."""

    def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases are not allowed (*{event.anchor} {event.start_mark})")
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load(data: str | bytes, where: object, *, max_bytes: int = MAX_BYTES) -> Any:
    """Parse one YAML document; a refused or malformed one is a :class:`~ckptio.CheckpointCorruptError`
    naming ``where``."""
    size = len(data.encode() if isinstance(data, str) else data)
    if size > max_bytes:
        raise CheckpointCorruptError(f"{where}: {size} bytes of YAML, more than the {max_bytes} allowed")
    try:
        return yaml.load(data, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader without aliases
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"{where}: not valid YAML for ckptio ({exc})") from exc
