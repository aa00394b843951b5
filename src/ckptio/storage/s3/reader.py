"""Reading a folder in S3: the object store's reader (:mod:`ckptio.storage.objstore.reader`), under its S3 names."""

from ..objstore.reader import CACHE_BYTES, WINDOW, WINDOW_GAP, ObjectFolder, ObjectReadHandle, WindowCache

__all__ = ["S3Folder", "S3ReadHandle", "WindowCache", "WINDOW", "WINDOW_GAP", "CACHE_BYTES"]

S3Folder = ObjectFolder
S3ReadHandle = ObjectReadHandle
