"""What ckptio logs names the step directories a user can open: the final ones, never the temporary
folder a save writes into before it is renamed (only a leftover of an interrupted save, which is
removed and never renamed, is named by its temporary name)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from ckptio import CheckpointConfig, CheckpointManager, committed_checkpoints
from ckptio.engine.layout import TMP_PREFIX
from toy import llama_config


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines():
    handler = _Lines()
    logger = logging.getLogger("ckptio")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_log_lines_name_final_step_directories(tmp_path, lines, async_save):
    root = tmp_path / "ckpt"
    root.mkdir()
    leftover = root / f"{TMP_PREFIX}epoch_0_step_1-deadbeef"  # what a killed save leaves behind
    leftover.mkdir()
    (leftover / "half.bin").write_bytes(b"x" * 10)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = CheckpointConfig(checkpoint_dir=root, save_consolidated=True, keep_latest=2, async_save=async_save)
    with CheckpointManager(config, model=model, optimizer=opt) as mgr:
        for step in (2, 4, 6):
            model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step=step, epoch=0)
        mgr.wait()
    kept = {p.name for p in committed_checkpoints(root)}
    assert kept == {"epoch_0_step_4", "epoch_0_step_6"}

    # a restore that meets a damaged newest checkpoint says which one it skipped and which it used
    (root / "epoch_0_step_6" / "model" / "consolidated" / "config.json").unlink()
    (root / "epoch_0_step_6" / "ckptio_manifest.json").write_text("{ torn")
    model2 = _model()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=root), model=model2) as again:
        again.restore()

    text = "\n".join(lines)
    step_names = set(re.findall(r"(?<![-.\w])epoch_\d+_step_\d+[^\s/,;:)'\"]*", text))
    assert step_names, text
    for line in lines:
        if TMP_PREFIX in line or ".tmp-" in line:
            assert line.startswith("Removed leftover of an interrupted save") and leftover.name in line, line
    for name in step_names:  # every step directory named is one that was committed (kept or pruned)
        assert name in {"epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_6"}, (name, text)
    saved = re.findall(r"Saved checkpoint (\S+)", text)
    assert [Path(p).name for p in saved] == ["epoch_0_step_2", "epoch_0_step_4", "epoch_0_step_6"], text
    assert all(Path(p).parent == root for p in saved)
    consolidated = [line for line in lines if line.startswith("Consolidated")]
    assert len(consolidated) == 3 and all(str(root / "epoch_0_step_") in line for line in consolidated), consolidated
    assert any("damaged" in line and str(root / "epoch_0_step_6") in line for line in lines), text
    assert any(line.startswith("Loading checkpoint from") and line.endswith("epoch_0_step_4") for line in lines), text
    assert not leftover.exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_large_restore_reports_progress_as_log_lines(tmp_path, lines, monkeypatch, fmt):
    """Piped (as under pytest), a large restore logs a line per tenth of each state, ending at 100%; a small
    one says nothing beyond its usual lines."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path, model_save_format=fmt), model=model,
                           optimizer=opt) as mgr:
        mgr.save(step=1, epoch=0)

    def restore() -> list[str]:
        lines.clear()
        m = _model()
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with CheckpointManager(CheckpointConfig(checkpoint_dir=tmp_path), model=m, optimizer=o) as again:
            again.restore()
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), model.state_dict().values()))
        return [line for line in lines if line.startswith("restoring the")]

    assert restore() == []  # well under the default threshold (1 GiB)
    monkeypatch.setenv("CKPTIO_PROGRESS_MIN_BYTES", "1")
    progress = restore()
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # the tied head counts once
    model_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    for what in ("model", "optimizer"):
        mine = [line for line in progress if line.startswith(f"restoring the {what} of epoch_0_step_1: ")]
        assert [line.split(": ")[1].split("%")[0] for line in mine] == [str(p) for p in range(10, 101, 10)], progress
    assert f"({_human(model_bytes)} of {_human(model_bytes)}," in [line for line in progress if "model" in line][-1]


def _human(n: int) -> str:
    from ckptio.cli._fmt import human_bytes

    return human_bytes(n)
