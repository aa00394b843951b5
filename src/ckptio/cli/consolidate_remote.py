"""``ckptio consolidate s3://…/step`` (or ``gs://``): the Hugging Face bundle of a checkpoint kept in a bucket.

Into the checkpoint (the default): under the bucket folder's lease, the step is checked against its
manifest, the bundle's objects are uploaded under ``model/consolidated/`` (names the manifest does not
list yet, so the committed checkpoint is untouched while they go up), then the manifest is replaced by
one that lists them — a write conditional on the old manifest's version (S3's ETag, GCS's generation), the
single step that publishes
the new version. A crash before it leaves the old checkpoint, plus unlisted objects that a retry
overwrites. A step that already holds a bundle is left alone (delete the step's ``model/consolidated/``
objects and its manifest entry yourself, or consolidate into another folder with ``--out``).

With ``--out`` (a local folder) the bundle is streamed from the bucket into it.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError
from ..engine.manifest import MANIFEST_NAME, check_files, read_manifest

__all__ = ["consolidate_in_bucket", "model_folder"]


def model_folder(url: str) -> tuple[Any, Any, str]:
    """(storage, step folder, the model's folder name) of a step directory in a bucket."""
    from ..formats import registry
    from ..storage import open_storage

    parent, _, name = url.rstrip("/").rpartition("/")
    storage = open_storage(parent)
    step = storage.folder(name)
    manifest = read_manifest(step)
    entry = manifest.states.get("model")
    if entry is None or not registry.get(entry.format).full_model:
        raise CheckpointError(f"{url} holds no whole model to consolidate")
    return storage, step, entry.path


def consolidate_in_bucket(url: str, source: Any, plan: Any, bar: Any, *, force: bool) -> str:
    """Add the bundle to the checkpoint at ``url`` as a new version of it; returns the bundle's location."""
    from ..formats.safetensors import hf_bundle

    storage, step, model_rel = model_folder(url)
    name = url.rstrip("/").rpartition("/")[2]
    lease = storage.lock()
    lease.acquire(force=force)
    try:
        manifest = read_manifest(step)
        problems = check_files(step, manifest)
        if problems:
            raise CheckpointCorruptError(f"{url} is damaged, not rewriting it: " + "; ".join(problems[:3]))
        rel_out = f"{model_rel}/consolidated"
        if any(rel == rel_out or rel.startswith(rel_out + "/") for rel in manifest.files):
            raise CheckpointError(f"{url} already holds a consolidated bundle ({rel_out}/); consolidate into another "
                                  "folder with --out")
        key = f"{storage._key(name)}/{MANIFEST_NAME}"
        head = storage.store.head(key)
        if head is None:
            raise CheckpointError(f"{step.display(MANIFEST_NAME)}: missing (removed meanwhile)")
        writer: Any = storage.attach_step(name, name)  # adds objects to the committed step; never commits it
        try:
            written = hf_bundle.write_bundle(source, plan, writer, rel_out, progress=bar.update)
            files = writer.files()
        finally:
            writer.abort_spool()
        manifest.files = {rel: size for rel, size in files.items()
                          if rel in manifest.files or rel in written}
        manifest.checksums = {**manifest.checksums, **written}
        storage.store.put(key, manifest.to_json().encode(), if_token=head.token)
    finally:
        lease.release()
    return f"{url.rstrip('/')}/{rel_out}"
