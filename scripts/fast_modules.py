"""Which of ckptio's modules the fast tests (``-m "not slow"``) exercise: a function of the module must run inside a
test process (a module only imported, or only run by a subprocess a test starts, does not count).

    .venv/bin/python scripts/fast_modules.py [pytest arguments ...]

A module that defines no function (a package's ``__init__`` that only gathers names) counts when it is imported.
Runs the fast suite with a global trace function that notes the source file of every Python call (about a third
slower than the plain run), then prints each module of ``src/ckptio`` no fast test exercised; the exit code is 1 if
there is one. Extra arguments go to pytest (e.g. ``tests/test_cli.py`` to look at a few files).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _defines_functions(path: Path) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(ast.parse(path.read_text())))


def main() -> int:
    src = ROOT / "src" / "ckptio"
    modules = {str(p) for p in src.rglob("*.py")}
    with tempfile.TemporaryDirectory(prefix="ckptio-fast-modules-") as out:
        args = sys.argv[1:] or ["tests"]
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-n", "2", "--dist", "loadfile",
                              "-p", "no:cacheprovider", "--exercised-modules", out, *args], cwd=ROOT)
        ran = {line for f in Path(out).glob("*.txt") for line in f.read_text().splitlines()}
    missing = sorted(str(Path(m).relative_to(ROOT)) for m in modules - ran
                     if _defines_functions(Path(m)) or f"imported {m}" not in ran)
    print(f"\n{len(modules) - len(missing)} of {len(modules)} modules of src/ckptio exercised by the fast tests"
          f"{' (the fast tests failed: see above)' if run.returncode else ''}")
    for m in missing:
        print(f"  not exercised: {m}")
    return 1 if missing or run.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
