"""``ckptio inspect``, ``list``, ``verify``, ``prune``, ``consolidate`` and ``convert``: what they print and return
(in this process, ``cli_here``), and the installed console script itself on a terminal and as a user types it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_here import ckptio_here

from ckptio import CheckpointConfig, CheckpointManager

CKPTIO = [str(Path(sys.executable).parent / "ckptio")]


cli = ckptio_here


def test_the_installed_console_script_runs_a_command(ckpts):
    """The entry point a user types: a fresh interpreter, its exit codes and its streams."""
    out = subprocess.run(CKPTIO + ["list", str(ckpts), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["latest"] == "epoch_1_step_20"
    out = subprocess.run(CKPTIO + ["inspect", str(ckpts / "nope")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "checkpoints"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    model[1].float()
    opt = torch.optim.AdamW(model.parameters())
    # the optimizer as DCP (the model as safetensors shards): inspect meets both kinds of folder
    mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=str(root), optimizer_save_format="torch_save"),
                            model=model, optimizer=opt)
    mgr.save(step=10, metrics={"val_loss": 1.5})
    mgr.save(step=20, epoch=1, metrics={"val_loss": 1.25})
    (root / ".tmp-epoch_1_step_30-deadbeef").mkdir()  # an interrupted save
    return root


def test_list_human_and_json(ckpts):
    out = cli("list", str(ckpts))
    assert out.returncode == 0, out.stderr
    assert "epoch_1_step_20 <- LATEST" in out.stdout and "epoch_0_step_10" in out.stdout
    assert "NOT USABLE" in out.stdout and "2 committed" in out.stdout
    data = json.loads(cli("list", str(ckpts), "--json").stdout)
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert data["latest"] == "epoch_1_step_20"
    assert rows["epoch_1_step_20"]["step"] == 20 and rows["epoch_1_step_20"]["committed"]
    assert rows["epoch_1_step_20"]["metrics"] == {"val_loss": 1.25}
    assert not rows[".tmp-epoch_1_step_30-deadbeef"]["committed"]


def test_inspect_step_dir(ckpts):
    out = cli("inspect", str(ckpts / "epoch_1_step_20"))
    assert out.returncode == 0, out.stderr
    for text in ("step 20, epoch 1", "val_loss=1.25", "1 rank(s)", "bfloat16", "float32", "optim"):
        assert text in out.stdout
    data = json.loads(cli("inspect", str(ckpts / "epoch_1_step_20"), "--json").stdout)
    model = data["states"]["model"]["tensors"]
    assert model["tensors"] == 4
    assert model["dtypes"]["bfloat16"] == {"tensors": 2, "bytes": (8 * 16 + 16) * 2}
    assert model["dtypes"]["float32"] == {"tensors": 2, "bytes": (16 * 4 + 4) * 4}
    assert data["world_size"] == 1 and data["model_save_format"] == "safetensors"
    assert sum(data["files"].values()) == data["total_bytes"] > 0


def test_inspect_dcp_folder_and_single_file(ckpts):
    out = cli("inspect", str(ckpts / "epoch_1_step_20" / "optim"), "--json")
    assert json.loads(out.stdout)["kind"] == "dcp"
    files = sorted((ckpts / "epoch_1_step_20" / "model").glob("shard-00001-*.safetensors"))  # one rank's files
    datas = [json.loads(cli("inspect", str(f), "--json").stdout) for f in files]
    assert all(d["kind"] == "safetensors_file" for d in datas)
    assert sum(d["tensors"]["tensors"] for d in datas) == 4


def test_bad_input_gives_a_clear_error_not_a_traceback(ckpts, tmp_path):
    out = cli("inspect", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr and "Traceback" not in out.stderr
    out = cli("inspect", str(ckpts))
    assert out.returncode == 2 and "ckptio list" in out.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}     ")
    out = cli("inspect", str(bad))
    assert out.returncode == 2 and "bad.safetensors" in out.stderr and "Traceback" not in out.stderr
    out = cli("list", str(tmp_path / "nope"))
    assert out.returncode == 2 and "nope" in out.stderr


def _fresh(root: Path) -> Path:
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(root)), model=model) as mgr:
        for step in (1, 2, 3):
            mgr.save(step=step, metrics={"val_loss": 1.0 / step})
    return root


def test_every_reporting_command_speaks_json(tmp_path):
    root = _fresh(tmp_path / "ck")
    step = root / "epoch_0_step_3"
    verify = cli("verify", str(root), "--json")
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"] is True
    assert len(json.loads(verify.stdout)["checkpoints"]) == 3
    prune = cli("prune", str(root), "--keep-latest", "1", "--dry-run", "--json")
    data = json.loads(prune.stdout)
    assert prune.returncode == 0 and data["dry_run"] and sorted(data["delete"]) == ["epoch_0_step_1", "epoch_0_step_2"]
    assert "epoch_0_step_3" in data["keep"] and all((root / n).is_dir() for n in data["delete"])
    cons = cli("consolidate", str(step), "--out", str(tmp_path / "hf"), "--json")
    assert cons.returncode == 0, cons.stderr
    data = json.loads(cons.stdout)
    assert data["out"] == str(tmp_path / "hf") and data["tensors"] == 2 and data["bytes"] == (64 + 8) * 4
    conv = cli("convert", str(step), str(tmp_path / "w.pt"), "--to", "torch", "--json")
    assert conv.returncode == 0, conv.stderr
    data = json.loads(conv.stdout)
    assert data["source_format"] == "step_dir" and data["format"] == "torch" and data["bytes"] == (64 + 8) * 4
    for out in (verify, prune, cons, conv):
        assert "%" not in out.stdout  # progress never mixes into the JSON


def test_progress_is_plain_lines_when_piped(tmp_path, monkeypatch):
    """Issue 52, row 7: a script's ``verify`` of an 872 KiB checkpoint printed ten lines, 40 %-90 % all reading the
    same bytes. Short work shows no progress (the library's threshold, CKPTIO_PROGRESS_MIN_BYTES); long work a line
    for each tenth reached, each percentage that of the bytes it shows."""
    root = _fresh(tmp_path / "ck")
    out = cli("verify", str(root / "epoch_0_step_3"))
    assert out.returncode == 0 and "%" not in out.stderr, out.stderr  # small: nothing
    monkeypatch.setenv("CKPTIO_PROGRESS_MIN_BYTES", "0")  # as if it were large
    out = cli("verify", str(root / "epoch_0_step_3"))
    assert out.returncode == 0 and "100%" in out.stderr and "\r" not in out.stderr
    shown = [line.split(": ", 1)[1] for line in out.stderr.splitlines() if "% (" in line]
    assert len(shown) == len(set(shown)), shown  # never two lines for the same bytes
    out = cli("verify", str(root / "epoch_0_step_3"), "--no-progress")
    assert "%" not in out.stderr


def test_a_progress_line_is_the_tenth_its_bytes_reached():
    from ckptio._progress import _Lines

    lines: list[str] = []
    bar = _Lines(1000, "verifying", lines.append)
    for n in (50, 880, 20, 50):
        bar.update(n)
    assert [line.split(" (")[0] for line in lines] == ["verifying: 90%", "verifying: 100%"], lines


def test_progress_is_a_redrawn_bar_on_a_terminal(tmp_path, monkeypatch):
    """The same command with its stderr on a terminal (a pseudo-terminal here) draws a bar that redraws itself
    in place, and its stdout still holds only the report."""
    import os
    import pty

    root = _fresh(tmp_path / "ck")
    monkeypatch.setenv("CKPTIO_PROGRESS_MIN_BYTES", "0")  # a tiny checkpoint shown as if it were large
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(CKPTIO + ["verify", str(root / "epoch_0_step_3")], stdout=subprocess.PIPE,
                              stderr=follower, text=True, timeout=120)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0 and "100%" in terminal and "\r" in terminal, terminal
    assert "%" not in proc.stdout and "ok" in proc.stdout.lower(), proc.stdout


@pytest.mark.parametrize("args", [
    ("list", "{missing}"), ("inspect", "{missing}"), ("verify", "{missing}"),
    ("prune", "{missing}", "--keep-latest", "1"), ("consolidate", "{missing}"),
    ("convert", "{missing}", "{tmp}/out", "--to", "hf"), ("nemo", "unpack", "{missing}", "{tmp}/out"),
    ("prune", "{root}", "--keep-latest", "0"), ("prune", "{root}", "--save-top-k", "2"),
    ("prune", "{root}"), ("convert", "{root}", "{tmp}/out", "--to", "nonsense"),
])
def test_missing_input_and_nonsense_options_are_errors_everywhere(tmp_path, args):
    root = tmp_path / "ck"
    root.mkdir()
    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path, root=root) for a in args]
    out = cli(*argv)
    assert out.returncode == 2, (argv, out.returncode, out.stdout, out.stderr)
    assert "error" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()


def test_convert_help_lists_every_target_the_docs_use_from_the_registry():
    """Issue 71 row 3: ``--to``'s help lists the formats ckptio writes (the registry's), so every ``--to X`` of the
    docs is there (``deepspeed-universal`` was only under ``--list-formats``)."""
    import re

    from ckptio.formats import registry

    root = Path(__file__).resolve().parents[1]
    used = {m for page in [*(root / "docs").rglob("*.md"), root / "README.md"]
            for m in re.findall(r"--to ([a-z_][a-z_-]*)", page.read_text())}
    out = cli("convert", "--help")
    assert out.returncode == 0
    help_to = " ".join(out.stdout.split("\n  --to FORMAT", 1)[1].split("\n  --")[0].split())
    listed = {name.strip(",") for name in help_to.split()}
    assert "deepspeed-universal" in used
    assert used <= listed, (sorted(used - listed), help_to)
    assert set(registry.names(writable=True)) <= listed, help_to
    from ckptio.cli.convert_cmd import TARGETS

    assert sorted(TARGETS) == sorted(registry.names(writable=True))  # the help's list is the registry's


@pytest.mark.parametrize("command,target,options", [("list", "", []), ("list", "", ["--json"]),
                                                    ("inspect", "LATEST", ["--tensors"]),
                                                    ("verify", "", ["--no-progress"])])
def test_a_reader_that_stops_early_leaves_the_command_quiet(ckpts, command, target, options):
    """Issue 71, row 15: ``ckptio inspect … | head -8`` printed ``ckptio inspect: error: [Errno 32] Broken pipe``.
    Here the reader is gone before the command writes (a pipe whose reading end is closed): nothing on stderr, and
    the status of a Unix tool killed by SIGPIPE (141)."""
    import os

    args = [command, str(ckpts / target), *options]
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(CKPTIO + args, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == "", (args, out.returncode, out.stderr)
