"""Where bytes go: one storage interface (:mod:`.base`), local POSIX storage (:mod:`.local`), the confined
reader every read goes through (:mod:`.confined`), safe archives and the folder lock."""

from .local import LocalFileWriter, LocalFolderWriter, LocalStorage, LocalWriteStream
from .posix import (
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
    "LocalStorage",
    "LocalFolderWriter",
    "LocalFileWriter",
    "LocalWriteStream",
    "open_storage",
    "atomic_write_bytes",
    "commit_directory",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "read_pointer",
    "remove_tree",
    "write_pointer",
]


def open_storage(location: "str | object") -> LocalStorage:
    """The storage behind a checkpoint folder given as a path (local POSIX today)."""
    return LocalStorage(location)  # type: ignore[arg-type]
