"""The documentation site builds from the repository with warnings as errors: a broken link, a missing
page, an API name that moved or a docstring mkdocstrings cannot parse fails here, not on the website."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import launch

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.mark.skipif(not MKDOCS.exists() and shutil.which("mkdocs") is None,
                    reason="mkdocs is not installed (pip install 'ckptio[docs]'); CI installs it")
def test_docs_build_strict(tmp_path):
    exe = str(MKDOCS) if MKDOCS.exists() else shutil.which("mkdocs")
    out = subprocess.run([exe, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    cli = (site / "cli" / "index.html").read_text()
    for command in ("inspect", "list", "verify", "prune", "consolidate", "convert", "nemo", "quantize"):
        assert f"ckptio {command}" in cli, f"the generated CLI reference lacks {command}"
    api = (site / "api" / "index.html").read_text()
    assert "model_save_format" in api and "restore_from" in api  # fields documented from the docstrings
    for page in ("migrate-automodel", "migrate-lightning", "migrate-dcp", "migrate-hf-trainer"):
        assert (site / page / "index.html").is_file()
    assert not (site / "hooks.py").exists()


def test_the_readme_is_a_first_page_and_everything_else_is_in_the_docs():
    """The README opens with the two commands (set up + demo, set up + tests), stays short, and every page of
    the docs site is reachable from it through a link (directly or through docs/index.md)."""
    import re

    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail to docs/"
    assert lines[0] == "# ckptio" and lines[2] == "```bash"
    assert lines[3].startswith("bash scripts/demo.sh") and lines[4].startswith("bash scripts/test.sh")
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    index = (ROOT / "docs" / "index.md").read_text()
    linked |= set(re.findall(r"\]\(([\w-]+\.md)", index)) if "index.md" in linked else set()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked | {"index.md"}, f"not reachable from the README: {sorted(pages - linked)}"


def _block(page: str, heading: str) -> str:
    """The first ``python`` block after ``heading`` on ``page``, as it stands."""
    text = (ROOT / "docs" / page).read_text().split(heading, 1)[1]
    return text.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_accelerate_page_loop_resumes_where_a_straight_run_ends(tmp_path):
    """Issue 52, row 6: the page's snippet resumed, but not where the page said (skipping the batches seen was
    only in the proofs). The whole loop is on the page; run as it stands, stopped at step 17 and rerun, it ends
    where a straight run ends."""
    code = _block("migrate-accelerate.md", "### The whole resumable loop")
    assert "skip_first_batches" in code and "use_seedable_sampler=True" in code and "STEPS = 40" in code

    def run(folder, steps: int) -> str:
        folder.mkdir(exist_ok=True)
        script = folder / "loop.py"
        script.write_text(code.replace("STEPS = 40", f"STEPS = {steps}"))
        done = launch(str(script), cwd=str(folder), timeout=300)  # a process of its own (tests/distributed.py)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    straight = run(tmp_path / "straight", 40)
    stopped = run(tmp_path / "stopped", 17)  # mid-epoch (12 batches an epoch), after the save at step 15
    assert stopped.startswith("step 17")
    assert run(tmp_path / "stopped", 40) == straight and straight.startswith("step 40")


def test_the_first_checkpoint_page_runs_as_it_stands_and_resumes_exactly(tmp_path):
    """Issue 52, row 9: getting-started's loop left ``...`` and ``val_loss`` undefined. Run as it stands, stopped at
    step 50 and rerun, it ends with the loss of a straight run."""
    code = _block("getting-started.md", "## Your first checkpoint")
    assert "..." not in code.replace("# ...", "") and "max_steps=100" in code

    def run(folder: Path, steps: int) -> str:
        folder.mkdir(exist_ok=True)
        (folder / "train.py").write_text(code.replace("max_steps=100", f"max_steps={steps}"))
        done = launch(str(folder / "train.py"), cwd=str(folder), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    straight = run(tmp_path / "straight", 100)
    assert run(tmp_path / "stopped", 50).startswith("step 50")
    assert run(tmp_path / "stopped", 100) == straight and straight.startswith("step 100")


def test_the_cli_reference_is_on_the_page_and_equal_to_the_commands():
    """Issue 52, row 9: cli.md's "reference below is generated" was followed by nothing where the page is read as
    a file. The reference is written into the page and kept equal to the commands' own help."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    page = (ROOT / "docs" / "cli.md").read_text()
    assert hooks.with_reference(page) == page, "run: python docs/hooks.py"
    assert "## ckptio verify" in page and "## ckptio convert" in page


def test_the_index_links_every_migration_page():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted(p.name for p in (ROOT / "docs").glob("migrate-*.md")):
        assert f"({page})" in index, page
