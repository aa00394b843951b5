"""Hostile tar archives (for .nemo / .qnemo) are refused before anything is written."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from ckptio import CheckpointError
from ckptio.storage.archive import safe_extract


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_a_plain_archive_unpacks(tmp_path):
    arc = _tar(tmp_path / "m.nemo", [_file("model_config.yaml", b"a: 1\n"), _file("weights/w.bin", b"\1" * 100),
                                     _link("alias.yaml", "model_config.yaml", tarfile.SYMTYPE)])
    out = safe_extract(arc, tmp_path / "out")
    assert (out / "model_config.yaml").read_bytes() == b"a: 1\n" and (out / "weights" / "w.bin").stat().st_size == 100
    assert (out / "alias.yaml").read_text() == "a: 1\n"


HOSTILE = {
    "absolute path": [_file("/tmp/ckptio-evil")],
    "dot-dot": [_file("../evil")],
    "nested dot-dot": [_file("a/../../evil")],
    "symlink out": [_link("link", "/etc/passwd", tarfile.SYMTYPE)],
    "relative symlink out": [_link("d/link", "../../outside", tarfile.SYMTYPE)],
    "hard link out": [_link("hl", "../../outside", tarfile.LNKTYPE)],
    "device": [_link("dev", "", tarfile.CHRTYPE)],
    "fifo": [_link("fifo", "", tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_members_are_refused_and_nothing_is_written(tmp_path, case):
    arc = _tar(tmp_path / "evil.nemo", [_file("ok.txt")] + HOSTILE[case])
    with pytest.raises(CheckpointError, match="evil.nemo"):
        safe_extract(arc, tmp_path / "work" / "out")
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())
    assert not (tmp_path / "evil").exists() and not Path("/tmp/ckptio-evil").exists()


def test_decompression_bomb_is_refused(tmp_path):
    zeros = b"\0" * (80 * 1024 * 1024)
    arc = _tar(tmp_path / "bomb.nemo", [_file("zeros.bin", zeros)], gz=True)
    assert arc.stat().st_size < 1024 * 1024
    with pytest.raises(CheckpointError, match="decompression bomb"):
        safe_extract(arc, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_garbage_is_a_clear_error(tmp_path):
    (tmp_path / "junk.nemo").write_bytes(gzip.compress(b"not a tar"))
    with pytest.raises(CheckpointError, match="junk.nemo"):
        safe_extract(tmp_path / "junk.nemo", tmp_path / "out")
