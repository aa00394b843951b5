"""Reading a folder in object storage: listings, sizes and ranged reads, like the local confined Folder."""

from __future__ import annotations

from typing import Any, Iterator

from ...errors import CheckpointCorruptError, CheckpointNotFoundError
from ..confined import Entry, FolderReads, ReadHandle, UnsafePathError, check_relative
from ._common import S3Path, _call, client

class S3ReadHandle(ReadHandle):
    """An object of known size read with ranged ``GET`` requests (positional, thread-safe)."""

    def __init__(self, bucket: str, key: str, path: S3Path, size: int) -> None:
        super().__init__(-1, path, size)  # type: ignore[arg-type]
        self.bucket, self.key = bucket, key

    def close(self) -> None:
        pass

    def _pread(self, view: memoryview, offset: int) -> None:
        n = view.nbytes
        if n == 0:
            return
        response = _call("reading", self.path, client().get_object, Bucket=self.bucket, Key=self.key,
                         Range=f"bytes={offset}-{offset + n - 1}")
        body = response["Body"]
        try:
            done = 0
            while done < n:
                chunk = body.read(min(n - done, 8 << 20))
                if not chunk:
                    break
                view[done:done + len(chunk)] = chunk
                done += len(chunk)
        finally:
            body.close()
        if done != n:
            raise CheckpointCorruptError(f"{self.path}: truncated (a read of {n} bytes at {offset} returned {done}; "
                                         f"expected {self.size} bytes in all)")


class S3Folder(FolderReads):
    """Read access to the objects under one prefix, with the methods of the local confined ``Folder``."""

    def __init__(self, bucket: str, prefix: str, *, verifier: Any = None,
                 listings: "dict[str, tuple[dict[str, int], set[str], set[str]]] | None" = None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.path = S3Path(bucket, *(p for p in self.prefix.split("/") if p))
        self.links = False
        self.verifier = verifier
        self._listings = {} if listings is None else listings  # rel -> (files, dirs, others), cached

    def __repr__(self) -> str:
        return f"S3Folder({str(self.path)!r})"

    def display(self, rel: str = "") -> S3Path:
        return self.path / rel if rel else self.path  # type: ignore[return-value]

    def plain(self) -> "S3Folder":
        """The same folder without a verifier."""
        return S3Folder(self.bucket, self.prefix, listings=self._listings)

    def _key(self, rel: str) -> str:
        parts = check_relative(rel, self.path) if rel not in ("", ".") else ()
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    def sub(self, rel: str) -> "S3Folder":
        if rel in ("", "."):
            return self
        if self.kind(rel) != "dir":
            raise CheckpointNotFoundError(f"{self.path / rel}: no such folder")
        return S3Folder(self.bucket, self._key(rel), verifier=self.verifier)

    def _listing(self, rel: str) -> tuple[dict[str, int], set[str], set[str]]:
        """(files -> size, sub-prefixes, unusable names) directly below ``rel``."""
        if rel in self._listings:
            return self._listings[rel]
        base = self._key(rel)
        prefix = f"{base}/" if base else ""
        files: dict[str, int] = {}
        dirs: set[str] = set()
        others: set[str] = set()
        paginator = client().get_paginator("list_objects_v2")
        pages = _call("listing", self.display(rel), lambda: list(
            paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/")))
        for page in pages:
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(prefix):].rstrip("/")
                (dirs if _plain(name) else others).add(name)
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix):]
                if name == "":
                    continue  # a "folder marker" object some tools write
                (files.__setitem__(name, int(obj["Size"])) if _plain(name) else others.add(name))
        self._listings[rel] = (files, dirs, others)
        return files, dirs, others

    def kind(self, rel: str) -> str | None:
        parts = check_relative(rel, self.path)
        files, dirs, others = self._listing("/".join(parts[:-1]))
        name = parts[-1]
        if name in files:
            return "file"
        if name in dirs:
            return "dir"
        return "other" if name in others else None

    def size(self, rel: str) -> int:
        parts = check_relative(rel, self.path)
        files, _, _ = self._listing("/".join(parts[:-1]))
        if parts[-1] not in files:
            kind = self.kind(rel)
            if kind is None:
                raise CheckpointNotFoundError(f"{self.path / rel}: missing")
            raise UnsafePathError(f"{self.path / rel}: is a {'folder' if kind == 'dir' else 'key that is not a plain name'}, "
                                  "not a file")
        return files[parts[-1]]

    def listdir(self, rel: str = "") -> list[Entry]:
        if rel not in ("", ".") and self.kind(rel) != "dir":
            raise CheckpointNotFoundError(f"{self.path / rel}: no such folder")
        files, dirs, others = self._listing("" if rel in ("", ".") else rel)
        out = [Entry(n, "file", s) for n, s in files.items()] + [Entry(n, "dir", 0) for n in dirs] + \
              [Entry(n, "other", 0) for n in others if n not in files and n not in dirs]
        return sorted(out, key=lambda e: e.name)

    def open(self, rel: str, *, size: int | None = None) -> ReadHandle:
        actual = self.size(rel)
        if size is not None and actual != size:
            raise CheckpointCorruptError(f"{self.path / rel}: size {actual} bytes, expected {size}")
        handle = S3ReadHandle(self.bucket, self._key(rel), self.display(rel), actual)
        if self.verifier is not None:
            self.verifier._attach(self, rel, handle)
        return handle

def _plain(name: str) -> bool:
    try:
        check_relative(name, "")
    except UnsafePathError:
        return False
    return True


