"""Where bytes go: the local filesystem with durable, atomic commits."""

from .local import (
    atomic_write_bytes,
    commit_directory,
    fsync_dir,
    fsync_file,
    fsync_tree,
    read_pointer,
    remove_tree,
    write_pointer,
)

__all__ = [
    "atomic_write_bytes",
    "commit_directory",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "read_pointer",
    "remove_tree",
    "write_pointer",
]
