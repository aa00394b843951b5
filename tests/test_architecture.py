"""The shape of the code stays what docs/architecture.md says: checked, so that it does not drift.

* no import cycles between ckptio's modules, counting imports inside functions and type-only imports under
  ``if TYPE_CHECKING:`` too (a late or type-only import still ties the two modules together);
* no module over 450 lines and no class over 250 (the targets are ~400 and ~250);
* the orchestrators (manager, saving, restoring, convert, describe, the CLI) never branch on a
  format's name: they ask the format registry;
* every format the registry knows can be found by ``detect`` from what it writes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "ckptio"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):  # module level, inside functions and under TYPE_CHECKING alike
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ importing its own submodules is how packages work; not a cycle of design
    for name in graph:
        graph[name] = {d for d in graph[name] if not (d.startswith(name + ".") and modules[name].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_modules_and_classes_stay_small():
    too_big = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        lines = text.count("\n")
        if lines > 450:
            too_big.append(f"{path.relative_to(SRC)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > 250:
                    too_big.append(f"{path.relative_to(SRC)}: class {node.name} has {size} lines")
    assert not too_big, too_big


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                if node.end_lineno - start + 1 > 60:  # type: ignore[operator]
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}")
    assert not long, f"split these into named steps: {long}"


def test_every_module_and_public_name_says_what_it_is_for():
    """The API reference is generated from docstrings: every module, and every public class and function at module
    level (outside private modules), has one."""
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if any(part.startswith("_") and part != "__init__.py" for part in rel.parts):
            continue
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            missing.append(f"{rel} (the module)")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and not node.name.startswith("_") and not ast.get_docstring(node):
                missing.append(f"{rel}: {node.name}")
    assert not missing, missing


ORCHESTRATORS = ["manager.py", "engine/saving.py", "engine/restoring.py", "engine/describe.py", "convert/formats.py", "cli"]
FORMAT_NAMES = ["safetensors", "dcp", "peft", "hf", "torch", "nemo", "lightning", "step_dir", "torch_save"]


def test_orchestrators_do_not_branch_on_format_names():
    pattern = re.compile(r"(==|!=|\bin\b)\s*\(?\s*['\"](" + "|".join(FORMAT_NAMES) + r")['\"]")
    offenders = []
    for entry in ORCHESTRATORS:
        paths = sorted((SRC / entry).rglob("*.py")) if (SRC / entry).is_dir() else [SRC / entry]
        for path in paths:
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "ask the format registry instead:\n" + "\n".join(offenders)


def test_every_writable_format_detects_what_it_writes(tmp_path):
    from ckptio.convert import convert
    from ckptio.formats import registry

    import torch

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a model with its config: some targets (megatron) lay weights out from it
    src = tmp_path / "src"
    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(src)
    for name in registry.names(writable=True):
        fmt = registry.get(name)
        out = convert(src, tmp_path / f"out-{name}{fmt.file_suffix}", name)
        assert registry.detect(out).name == name, f"{name}: its output is detected as {registry.detect(out).name}"


# --- the map of the folders (docs/architecture.md, "The map") and what users import -------------------------------

ROOT = SRC.parents[1]

# What users are told to import: every name of ``ckptio.__all__`` plus the module paths docs/, README.md and
# examples/ name (docs/api.md, the migration guides, docs/formats.md, docs/memory-tier.md, docs/retention.md,
# docs/converters.md, the ``ckptio`` entry point of pyproject.toml).
DOCUMENTED = {
    "ckptio.lightning": ["CkptioCheckpointIO", "last_checkpoint", "install_loader"],
    "ckptio.hf_trainer": ["CkptioTrainer", "CkptioTrainerMixin", "last_checkpoint", "usable_checkpoints"],
    "ckptio.accelerate": ["CkptioAccelerator", "usable_checkpoints"],
    "ckptio.errors": ["CheckpointError", "CheckpointNotFoundError", "CheckpointMismatchError", "CheckpointCorruptError",
                      "ConfigError", "NoUsableCheckpointError", "MissingDependencyError"],
    "ckptio.config": ["CheckpointConfig", "AUTOMODEL_ONLY"],
    "ckptio.convert": ["Converter", "Rule", "register", "check_invertible", "get_converter"],
    "ckptio.storage": ["url_scheme"],
    "ckptio.cli": ["main", "build_parser"],
    "ckptio.formats.lightning": ["load_lightning", "save_lightning"],
    "ckptio.formats.nemo.qnemo": ["export_qnemo", "load_qnemo"],
    "ckptio.tier.placement": ["place"],
    "ckptio.engine.layout": ["parse_step_name"],
}


def test_every_documented_import_resolves():
    import importlib

    import ckptio

    missing = [name for name in ckptio.__all__ if getattr(ckptio, name, None) is None]
    for module, names in DOCUMENTED.items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{name}" for name in names if not hasattr(mod, name)]
    assert not missing, missing


def test_every_module_path_the_docs_name_exists():
    """A dotted ``ckptio.…`` path in the docs, the README or the examples names a module or something in one."""
    import importlib

    found = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.py")]:
        found.update(re.findall(r"(?<![\w.])ckptio(?:\.[A-Za-z_]\w*)+", path.read_text()))
    stale = []
    for dotted in sorted(found):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            if obj is None:
                stale.append(dotted)
            break
    assert not stale, f"the docs name what does not exist: {stale}"


def test_the_top_level_shows_the_parts():
    public = sorted(p.stem for p in SRC.glob("*.py") if not p.name.startswith("_"))
    assert len(public) <= 12, f"{len(public)} public modules at the top of ckptio/: {public}"


def test_no_folder_holds_more_than_fifteen_modules():
    crowded = {str(d.relative_to(SRC)): n for d in [SRC, *SRC.rglob("*")] if d.is_dir() and d.name != "__pycache__"
               and (n := len(list(d.glob("*.py")))) > 15}
    assert not crowded, f"split these folders: {crowded}"


def _folders() -> set[str]:
    return {"./" if d == SRC else d.relative_to(SRC).as_posix() + "/"
            for d in [SRC, *SRC.rglob("*")] if d.is_dir() and any(d.glob("*.py"))}


def _map() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start, end = text.index("<!-- the map"), text.index("<!-- end of the map -->")
    return text[start:end]


def test_the_map_comes_first_and_names_every_folder():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert re.findall(r"^## (.+)$", text, re.M)[0] == "The map", "the map opens the document"
    named = set(re.findall(r"^- `([\w./]+/)`", _map(), re.M))
    assert named == _folders(), f"not in the map: {_folders() - named}; in the map, not in src: {named - _folders()}"


# The shared pieces every folder may import (docs/architecture.md says which), then what the map allows each folder.
SHARED = {"ckptio", "ckptio.errors", "ckptio._dist", "ckptio._faults", "ckptio._log", "ckptio._memory", "ckptio._progress",
          "ckptio.engine.manifest", "ckptio.engine.plan"}
FAMILIES = {"formats/dcp/", "formats/safetensors/", "formats/megatron/", "formats/nemo/", "formats/deepspeed/"}
ALLOWED = {
    "engine/": {"ckptio.config", "state/", "formats/", *FAMILIES, "storage/", "adopt/"},
    "state/": {"formats/"},
    "formats/": {"formats/safetensors/", "storage/"},
    "formats/dcp/": {"formats/", "formats/safetensors/", "storage/"},
    "formats/safetensors/": {"formats/", "formats/dcp/", "storage/"},
    "formats/megatron/": {"formats/", "formats/dcp/", "storage/"},
    "formats/deepspeed/": {"formats/", "storage/"},
    "formats/nemo/": {"formats/", *FAMILIES, "state/", "storage/"},
    "storage/": {"storage/objstore/", "storage/s3/", "storage/gcs/", "storage/azure/"},
    "storage/objstore/": {"storage/"},
    "storage/s3/": {"storage/", "storage/objstore/"},
    "storage/gcs/": {"storage/", "storage/objstore/"},
    "storage/azure/": {"storage/", "storage/objstore/"},
    "tier/": {"engine/", "formats/", "formats/safetensors/", "storage/"},
    "goodput/": {"storage/", "engine/", "ckptio.config_checks"},
    "adopt/": {"state/", "formats/", "formats/dcp/", "formats/safetensors/", "storage/"},
    "integrations/": {"engine/", "formats/", "formats/safetensors/", "storage/", "storage/objstore/", "storage/s3/",
                      "goodput/", "ckptio.config_checks"},
    "convert/": {"formats/", "storage/"},
    "cli/": {"engine/", "convert/", "formats/", *FAMILIES, "storage/", "storage/s3/", "goodput/"},
}


def test_each_folder_imports_only_what_the_map_allows():
    modules = _modules()

    def folder(name: str) -> str:
        parent = modules[name].parent
        return "./" if parent == SRC else parent.relative_to(SRC).as_posix() + "/"

    assert set(ALLOWED) == _folders() - {"./"}, "every folder but the top level has its line in ALLOWED"
    wrong = []
    for name, path in modules.items():
        here = folder(name)
        if here == "./":
            continue  # the top level may import everything
        for dep in _imports(name, path, modules):
            there = folder(dep)
            if dep in SHARED or there == here or dep in ALLOWED[here] or (there != "./" and there in ALLOWED[here]):
                continue
            wrong.append(f"{name} imports {dep}")
    assert not wrong, "not in docs/architecture.md's map (fix the import, or the map and ALLOWED together):\n" + \
        "\n".join(wrong)
