"""One node's folder of the memory tier: where its snapshots live, and what it holds of each.

Layout, inside ``memory_dir`` (RAM-backed: ``/dev/shm`` by default, so it outlives the training processes but
not the machine)::

    <memory_dir>/run-<key>/              # one per run: key = a hash of the run's checkpoint_dir
        node-id                          # this node's identity (a random id, made once by the first rank here)
        epoch_0_step_40/                 # a committed snapshot: its manifest, and the files this node holds
        .tmp-epoch_0_step_45-1a2b3c4d/   # a snapshot being written (never read)
        .view-5e6f7a8b/epoch_0_step_40/  # a restore in progress: links, fetched files, empty stand-ins

A committed snapshot folder holds the full manifest (every file of every rank, with sizes and checksums) but
only some of the files: those of this node's ranks and those of the ranks whose replicas it keeps. Which ones
it holds is what is found there (a regular file of the recorded size); their bytes are checked against the
manifest when a restore reads them. Every file here is read through the one gate (:class:`Folder` and
:mod:`ckptio.storage.parse`): a snapshot that fails a check is skipped with its reason.

After each commit the leader drops what no restore needs (:meth:`NodeFolder.drop_except`): only committed
snapshots are ranked (by step) and counted; the newest of them and the one just written stay, and a torn write
is never what is kept.

The folders are private to the user that runs the job: each one ckptio makes is created ``0700``, and an
existing one that is a link, belongs to someone else or can be written by others is refused, since anyone
who can write there could hand the next restart a state of their choosing.

Which rank touches what: every rank creates the folders and the node id (safely concurrent); only the node's
leader (its lowest rank) commits, drops, builds views and frees.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import stat
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, ConfigError
from ..engine.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, read_manifest
from ..storage.checksum import RunningChecksum, bytes_checksum
from ..storage.confined import Folder
from ..storage.parse import as_int, parsing, read_json
from ..storage.parse import field as typed
from ..storage.posix import remove_tree

__all__ = ["NodeFolder", "Held", "damaged_copies", "default_memory_dir", "failure_domain", "run_key", "snapshot_manifest", "tier_record", "TIER_FILE",
           "VIEW_PREFIX"]

NODE_ID = "node-id"
TIER_FILE = "memory_tier.json"
"""Written into every snapshot by rank 0 (and listed in its manifest): the run it belongs to and the newest
durable checkpoint when it was taken."""
VIEW_PREFIX = ".view-"
MAX_TIER_BYTES = 1 << 22
"""Cap on a snapshot's ``memory_tier.json`` (what ckptio writes there: about 100 bytes per node)."""
MAX_NODES = 1 << 16
_ID = re.compile(r"[0-9a-f]{32}")


def default_memory_dir() -> Path:
    """``$CKPTIO_MEMORY_DIR``, else ``/dev/shm/ckptio-<uid>``, else the same name in the temporary folder."""
    env = os.environ.get("CKPTIO_MEMORY_DIR")
    if env:
        return Path(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"ckptio-{os.geteuid() if hasattr(os, 'geteuid') else 'user'}"


def failure_domain() -> str:
    """This node's failure domain: ``$CKPTIO_FAILURE_DOMAIN`` (a rack, a switch, a power feed); empty when unset
    (the node is then a domain of its own)."""
    return os.environ.get("CKPTIO_FAILURE_DOMAIN", "").strip()


def run_key(checkpoint_dir: str) -> str:
    """The run's identity: a hash of where its durable checkpoints go (an absolute path, or the ``s3://`` URL)."""
    where = checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
    return hashlib.sha256(where.encode()).hexdigest()[:16]


@dataclass
class Held:
    """What a node holds of one committed snapshot."""
    step: int
    digest: str
    """Checksum of the manifest's bytes: two nodes hold the same snapshot when these agree."""
    world_size: int
    files: list[str]
    info: dict[str, Any] | None = None
    """The snapshot's ``memory_tier.json`` when this node holds it."""
    extra: dict[str, Any] = field(default_factory=dict)


class NodeFolder:
    """The run's folder on this node (see the module's docstring)."""

    def __init__(self, memory_dir: str | os.PathLike, checkpoint_dir: str) -> None:
        self.key = run_key(checkpoint_dir)
        self.parent = Path(memory_dir)
        self.root = self.parent / f"run-{self.key}"

    # ------------------------------------------------------------------------------------------ identity
    def open(self) -> str:
        """Create (or check) the run's folder and return this node's id; every rank of the node may call it at once."""
        for path in (self.parent, self.root):
            try:
                path.mkdir(mode=0o700, exist_ok=True)
            except FileNotFoundError as exc:
                raise ConfigError(f"memory_dir: cannot create {path}: its parent does not exist") from exc
            except OSError as exc:
                raise ConfigError(f"memory_dir: cannot create {path}: {exc.strerror}") from exc
            _check_private(path)
        id_path = self.root / NODE_ID
        if not id_path.exists() and not id_path.is_symlink():
            tmp = self.root / f".{NODE_ID}-{uuid.uuid4().hex[:8]}"
            tmp.write_text(uuid.uuid4().hex)
            try:
                os.link(tmp, id_path)  # atomic, and refused if another rank of this node got there first
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        text = Folder(self.root).read_text(NODE_ID, max_size=64).strip()
        if not _ID.fullmatch(text):
            raise CheckpointCorruptError(f"{id_path}: not a node id ({text[:40]!r}); remove the file")
        return text

    # ------------------------------------------------------------------------------------------ contents
    def inventory(self, log: Any) -> dict[str, Held]:
        """Every committed snapshot here, with the files this node holds of it (a snapshot that fails a check is
        skipped, its reason said in the log)."""
        out: dict[str, Held] = {}
        if not self.root.is_dir():
            return out
        top = Folder(self.root)
        for entry in top.listdir():
            if entry.kind != "dir" or entry.name.startswith("."):
                continue
            try:
                out[entry.name] = _held(top.sub(entry.name))
            except (CheckpointError, OSError) as exc:
                log.warning("Memory tier: skipping snapshot %s on this node: %s", self.root / entry.name, exc)
        return out

    def drop_except(self, keep: set[str]) -> list[str]:
        """Leader, once ``keep`` (the snapshot just written) is committed: remove what no restore needs; returns
        what was removed.

        Only committed snapshots (a manifest that reads) are ranked, by step, and counted: the newest of them and
        every name in ``keep`` stay, every other one goes. A folder that is not a committed snapshot (an unfinished
        or torn write, a damaged snapshot, a restore's view) is never what is kept: it goes too, unless ``keep``
        names it, and then the newest committed snapshot stays beside it."""
        if not self.root.is_dir():
            return []
        top = Folder(self.root)
        steps: dict[str, int | None] = {}
        for entry in top.listdir():
            if entry.kind == "dir":  # the node id, links and other files are left alone
                steps[entry.name] = None if entry.name.startswith(".") else _committed_step(top, entry.name)
        ranked = sorted((step, name) for name, step in steps.items() if step is not None)
        spared = set(keep) | ({ranked[-1][1]} if ranked else set())
        removed = [name for name in sorted(steps) if name not in spared]
        for name in removed:
            remove_tree(self.root / name)
        return removed

    def free(self) -> None:
        """Leader: remove the run's folder on this node with everything in it."""
        if self.root.is_dir() and not self.root.is_symlink():
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)

    def used_bytes(self) -> int:
        """Memory the run's folder takes on this node (allocated blocks: empty stand-ins count nothing)."""
        total = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    continue
        return total

    def free_bytes(self) -> int:
        """Room left in the filesystem that holds the folder."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    # ------------------------------------------------------------------------------------------ restore views
    def make_view(self, token: str, name: str, files: list[str]) -> Path:
        """Leader: ``.view-<token>/<name>/`` holding this node's ``files`` of snapshot ``name`` as hard links."""
        view = self.root / f"{VIEW_PREFIX}{token}" / name
        view.mkdir(parents=True, mode=0o700)
        src = self.root / name
        for rel in files:
            (view / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / rel, view / rel, follow_symlinks=False)
            except OSError:  # a filesystem without hard links: a copy (the inventory found a regular file there)
                import shutil

                shutil.copyfile(src / rel, view / rel, follow_symlinks=False)
        return view

    def view(self, token: str, name: str) -> Path:
        return self.root / f"{VIEW_PREFIX}{token}" / name


def stand_ins(view: Path, files: dict[str, int]) -> int:
    """Leader: an empty (sparse: no memory) file of the recorded size for every file of the snapshot this node did
    not fetch, so that checks of presence and size pass; none of their bytes is meant to be read, and a read of
    one would fail the checksum. Returns how many were made."""
    made = 0
    for rel, size in files.items():
        path = view / rel
        if path.exists() or path.is_symlink():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as fh:
            fh.truncate(size)
        made += 1
    return made


def damaged_copies(view: Path, files: dict[str, tuple[int, str]]) -> list[tuple[str, str]]:
    """Of ``files`` (rel -> (size, checksum)) in the restore view ``view``, those whose bytes do not match, with
    why; each one found damaged is removed from the view, so that a good copy can take its place."""
    out = []
    folder = Folder(view)
    for rel, (size, digest) in sorted(files.items()):
        crc = RunningChecksum()
        try:
            with folder.open(rel, size=size) as handle:
                if size:
                    with mmap.mmap(handle.fd, size, access=mmap.ACCESS_READ) as mapped:
                        crc.update(mapped)
            why = None if crc.digest == digest else f"checksum {crc.digest}, the manifest records {digest}"
        except (CheckpointError, OSError) as exc:
            why = str(exc)
        if why is not None:
            out.append((rel, f"{view / rel}: this node's copy is damaged ({why})"))
            (view / rel).unlink(missing_ok=True)
    return out


def _holds(folder: Folder, rel: str, size: int) -> bool:
    try:
        return folder.kind(rel) == "file" and folder.size(rel) == size
    except (CheckpointError, OSError):
        return False


def _held(folder: Folder) -> Held:
    """What this node holds of the snapshot in ``folder``, every byte of it read through the gate: the manifest
    (bounded, typed, checksummed), the files of the recorded size, and the tier record when held."""
    with parsing(folder.path, "memory snapshot"):
        raw = folder.read_bytes(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES)
        manifest = Manifest.from_json(raw, folder.display(MANIFEST_NAME))
        files = [rel for rel, size in manifest.files.items() if _holds(folder, rel, size)]
        info = tier_record(folder) if TIER_FILE in files else None
    return Held(manifest.step, bytes_checksum(raw), manifest.world_size, files, info,
                {"manifest_size": len(raw), "total": len(manifest.files)})


def snapshot_manifest(folder: Folder) -> Manifest:
    """The manifest of the snapshot (or restore view) ``folder``; whatever is wrong with it is a ckptio error."""
    with parsing(folder.path, "memory snapshot"):
        manifest = read_manifest(folder)
    return manifest


def _committed_step(top: Folder, name: str) -> int | None:
    """The step of the committed snapshot ``name`` (its manifest reads through the gate), else ``None``."""
    try:
        return snapshot_manifest(top.sub(name)).step
    except (CheckpointError, OSError):
        return None


def tier_record(folder: Folder) -> dict[str, Any]:
    """The snapshot's ``memory_tier.json``, read bounded and typed: ``{"run": str, "durable_step": int | None,
    "placement": dict | None}`` (the placement: ``replicas``, and by node number its id, domain and holders)."""
    where = folder.display(TIER_FILE)
    record = read_json(folder, TIER_FILE, max_size=MAX_TIER_BYTES, what="memory tier record ")
    run = typed(record, "run", str, where)
    base = typed(record, "durable_step", (int, type(None)), where)
    if base is not None:
        base = as_int(base, where, "'durable_step'")
    placement = typed(record, "placement", (dict, type(None)), where, default=None)
    return {"run": run, "durable_step": base, "placement": None if placement is None else _placement(placement, where)}


def _placement(value: Any, where: object) -> dict[str, Any]:
    """The placement a snapshot records, every field typed and bounded (a node number names a recorded node)."""
    nodes = typed(value, "nodes", list, where)
    count = len(nodes)
    if not 1 <= count <= MAX_NODES:
        raise CheckpointCorruptError(f"{where}: 'placement' names {count} nodes")
    replicas = as_int(typed(value, "replicas", int, where), where, "'placement.replicas'", lo=1, hi=count)
    domains, holders = typed(value, "domains", list, where), typed(value, "holders", list, where)
    if len(domains) != count or len(holders) != count:
        raise CheckpointCorruptError(f"{where}: 'placement' has {count} nodes but {len(domains)} domains and "
                                     f"{len(holders)} holder lists")
    for i, (node, domain, held) in enumerate(zip(nodes, domains, holders)):
        if not isinstance(node, str) or not isinstance(domain, str) or not isinstance(held, list) or len(held) != replicas:
            raise CheckpointCorruptError(f"{where}: 'placement' entry {i} is not a node id, a domain and {replicas} "
                                         "holders")
        for h in held:
            as_int(h, where, f"'placement.holders[{i}]'", lo=0, hi=count - 1)
    return {"replicas": replicas, "nodes": nodes, "domains": domains, "holders": holders}


def _check_private(path: Path) -> None:
    """Refuse a memory tier folder that someone else could write into (see the module's docstring)."""
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        why = f"belongs to user id {st.st_uid}, not to this process's ({os.geteuid()})"
    elif st.st_mode & 0o022:
        why = f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise ConfigError(f"memory_dir: {path} {why}; the memory tier keeps training state there and refuses a "
                          "folder others could write (remove it, or set memory_dir to a private folder)")
