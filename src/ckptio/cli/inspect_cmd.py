"""``ckptio inspect PATH``: format, position, metrics, ranks, files and tensors of a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.describe import inspect_path
from ._fmt import human_bytes, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio inspect``."""
    p = sub.add_parser("inspect", help="describe any checkpoint ckptio reads (step directory, DCP, safetensors, HF, "
                                       "PEFT, .nemo, Lightning .ckpt, .pt)",
                       description="Describe a checkpoint without loading its tensors.")
    p.add_argument("path", help="a step directory, a DCP/HF/PEFT/safetensors folder, a .safetensors, .nemo, .ckpt or "
                                ".pt file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--files", action="store_true", help="list every file with its size")
    p.add_argument("--tensors", action="store_true", help="list every tensor with its dtype and shape")
    p.set_defaults(run=run)


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _tensor_lines(t: dict, indent: str) -> list[str]:
    elements = f", {_count(t['elements'])} elements" if "elements" in t else ""
    lines = [f"{indent}tensors: {t['tensors']}, {human_bytes(t['bytes'])}{elements}"]
    for dtype, d in sorted(t["dtypes"].items()):
        lines.append(f"{indent}  {dtype:<10} {d['tensors']:>6} tensors  {human_bytes(d['bytes']):>10}")
    return lines


def _tensor_list(path: str) -> dict[str, dict]:
    """Name -> dtype and shape of every tensor the format's reader offers (a step directory: the model)."""
    from ..formats import registry
    from ..formats.common import natural_key
    from ..storage import url_scheme

    if url_scheme(path) is not None:  # a step directory in a bucket: its model's index, no tensor read
        from ..engine.manifest import read_manifest
        from ..storage.confined import as_folder

        root = as_folder(path)
        entry = read_manifest(root).states.get("model")
        index: dict = {} if entry is None else {
            k: v for k, v in registry.get(entry.format).index(root.sub(entry.path)).items() if v is not None}
    else:
        opened = registry.detect(path).open(Path(path))
        try:
            index = opened.source.index()
        finally:
            opened.close()
    return {k: {"dtype": index[k].dtype, "shape": list(index[k].shape)} for k in sorted(index, key=natural_key)}


def run(args: argparse.Namespace) -> int:
    """Print what a checkpoint holds, without loading its tensors."""
    info = inspect_path(args.path)
    if args.tensors:
        info["tensor_list"] = _tensor_list(args.path)
    if args.json:
        print_json(info)
        return 0
    lines = [f"{info['path']}"] + describe_lines(info)
    if args.files:
        lines.append("  file list:")
        lines += [f"    {human_bytes(size):>10}  {name}" for name, size in info["files"].items()]
    if args.tensors:
        lines.append("  tensor list:")
        width = max((len(k) for k in info["tensor_list"]), default=0)
        lines += [f"    {k:<{width}}  {t['dtype']:<9} {t['shape']}" for k, t in info["tensor_list"].items()]
    print("\n".join(lines))
    return 0


def describe_lines(info: dict) -> list[str]:
    """Human lines for a description, from what it holds (every format's ``describe`` fills some of these)."""
    lines = []
    if "resume" in info:  # a checkpoint folder: what a resume takes, and what else is there
        resume = info["resume"]
        lines.append(f"  a resume takes {resume['takes']} ({resume['why']})")
        others = [f"{o['name']} ({o['label']}" + ("" if o["step"] is None else f", step {o['step']}") + ")"
                  for o in resume["others"]]
        if others:
            lines.append(f"  also here: {', '.join(others)}")
    if "step" in info:
        metrics = ", ".join(f"{k}={v:g}" for k, v in sorted(info["metrics"].items())) or "none"
        lines += [
            f"  checkpoint: {info['name']}  (step {info['step']}, epoch {info['epoch']})",
            f"  format: model {info['model_save_format']}{' (PEFT)' if info['is_peft'] else ''}"
            + (f", optimizer {info['states']['optim']['format']}" if "optim" in info.get("states", {}) else ""),
            f"  saved on: {info['world_size']} rank(s), {info['created']}",
            f"  metrics: {metrics}",
        ]
    else:
        weights = f", weights {info['weights']}" if "weights" in info else ""
        lines.append(f"  format: {info.get('label') or info['kind']}{weights}")
        if "checkpoint" in info:  # a run folder: the checkpoint in it a restore reads
            lines.append(f"  checkpoint: {info['checkpoint']}")
        lines += [f"  {what}: {value}" for what, value in info.get("holds", {}).items()]
    if "architecture" in info:
        lines.append(f"  architecture: {info['architecture']}")
    if "artifacts" in info:
        lines.append(f"  artifacts: {', '.join(info['artifacts']) or 'none'}")
    if "config_keys" in info:
        lines.append(f"  config keys: {', '.join(info['config_keys'])}")
    if "tensors" in info:
        lines += _tensor_lines(info["tensors"], "  ")
    shares = f" (owns {human_bytes(info['owned_bytes'])}, shares {human_bytes(info['shared_bytes'])} with other " \
        "steps)" if info.get("shared_bytes") else ""
    lines.append(f"  files: {len(info['files'])}, {human_bytes(sum(info['files'].values()))}{shares}")
    if "states" in info:
        lines.append("  states:")
        for name, st in sorted(info["states"].items()):
            where = f"{st['path']}{'/ (per rank)' if st['per_rank'] else ''}"
            lines.append(f"    {name:<16} {st['format']:<12} {where}")
            if "tensors" in st:
                lines += _tensor_lines(st["tensors"], "      ")
    if info.get("versions"):
        lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(info["versions"].items())))
    if "lightning" in info.get("states", {}):  # a folder CkptioCheckpointIO wrote: the one line a script needs
        lines.append("  load it in a script without the plugin: from ckptio.lightning import install_loader; "
                     "install_loader(); then YourModule.load_from_checkpoint(path) as usual")
    return lines
