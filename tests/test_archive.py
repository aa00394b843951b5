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


# Link attacks that a member-by-member check misses: each link looks harmless alone, the chain does not.
LINK_ATTACKS = {
    "chain of symlinks out": [_link("a", ".", tarfile.SYMTYPE), _link("b", "a/..", tarfile.SYMTYPE),
                              _link("c", "b/..", tarfile.SYMTYPE), _file("c/escaped")],
    "symlink to a symlink out": [_link("d/inner", "../..", tarfile.SYMTYPE), _link("outer", "d/inner", tarfile.SYMTYPE),
                                 _file("outer/escaped")],
    "hard link through a symlink": [_link("up", "..", tarfile.SYMTYPE), _link("hl", "up/outside", tarfile.LNKTYPE)],
    "symlink to a folder": [_file("sub/x"), _link("dirlink", "sub", tarfile.SYMTYPE)],
    "file written below a symlink": [_file("real/x"), _link("alias", "real", tarfile.SYMTYPE), _file("alias/y")],
    "cycle": [_link("p", "q", tarfile.SYMTYPE), _link("q", "p", tarfile.SYMTYPE)],
    "dangling": [_link("ghost", "nothing-here", tarfile.SYMTYPE)],
    "name listed twice": [_file("model_config.yaml", b"a: 1\n"), _file("model_config.yaml", b"a: 2\n")],
    "absolute hard link": [_link("hl", "/etc/passwd", tarfile.LNKTYPE)],
}


@pytest.mark.parametrize("case", sorted(LINK_ATTACKS))
def test_link_chains_are_refused_and_nothing_lands_outside(tmp_path, case):
    work = tmp_path / "work"
    work.mkdir()
    arc = _tar(tmp_path / "evil.nemo", [_file("ok.txt")] + LINK_ATTACKS[case])
    with pytest.raises(CheckpointError, match="evil.nemo"):
        safe_extract(arc, work / "out")
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.nemo", "work"]


def test_links_inside_become_plain_copies(tmp_path):
    arc = _tar(tmp_path / "m.nemo", [_file("w.bin", b"\1\2\3"), _link("hard", "w.bin", tarfile.LNKTYPE),
                                     _link("sym", "hard", tarfile.SYMTYPE), _link("d/rel", "../sym", tarfile.SYMTYPE)])
    out = safe_extract(arc, tmp_path / "out")
    for name in ("hard", "sym", "d/rel"):
        p = out / name
        assert not p.is_symlink() and p.read_bytes() == b"\1\2\3"
        assert p.stat().st_ino != (out / "w.bin").stat().st_ino  # a copy, not a hard link
    # the system tar reads the same archive
    import subprocess

    listing = subprocess.run(["tar", "tf", str(arc)], capture_output=True, text=True, check=True).stdout.split()
    assert set(listing) == {"w.bin", "hard", "sym", "d/rel"}


def test_member_count_limit(tmp_path):
    arc = _tar(tmp_path / "many.nemo", [_file(f"f{i}") for i in range(50)])
    with pytest.raises(CheckpointError, match="more than the 10 allowed"):
        safe_extract(arc, tmp_path / "out", max_members=10)
    assert not (tmp_path / "out").exists()
