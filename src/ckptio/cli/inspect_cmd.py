"""``ckptio inspect PATH``: format, position, metrics, ranks, files and tensors of a checkpoint."""

from __future__ import annotations

import argparse

from ..describe import inspect_path
from ._fmt import human_bytes, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a step directory, DCP folder, safetensors file or .nemo archive",
                       description="Describe a checkpoint without loading its tensors.")
    p.add_argument("path", help="a step directory, a DCP folder, a folder of .safetensors files, one such file, or a .nemo")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--files", action="store_true", help="list every file with its size")
    p.set_defaults(run=run)


def _tensor_lines(t: dict, indent: str) -> list[str]:
    lines = [f"{indent}tensors: {t['tensors']}, {human_bytes(t['bytes'])}"]
    for dtype, d in sorted(t["dtypes"].items()):
        lines.append(f"{indent}  {dtype:<10} {d['tensors']:>6} tensors  {human_bytes(d['bytes']):>10}")
    return lines


def run(args: argparse.Namespace) -> int:
    info = inspect_path(args.path)
    if args.json:
        print_json(info)
        return 0
    lines = [f"{info['path']}"]
    if info["kind"] == "step_dir":
        metrics = ", ".join(f"{k}={v:g}" for k, v in sorted(info["metrics"].items())) or "none"
        lines += [
            f"  checkpoint: {info['name']}  (step {info['step']}, epoch {info['epoch']})",
            f"  format: model {info['model_save_format']}{' (PEFT)' if info['is_peft'] else ''}, optimizer dcp",
            f"  saved on: {info['world_size']} rank(s), {info['created']}",
            f"  metrics: {metrics}",
            f"  files: {len(info['files'])}, {human_bytes(info['total_bytes'])}",
            "  states:",
        ]
        for name, s in sorted(info["states"].items()):
            where = f"{s['path']}{'/ (per rank)' if s['per_rank'] else ''}"
            lines.append(f"    {name:<16} {s['format']:<12} {where}")
            if "tensors" in s:
                lines += _tensor_lines(s["tensors"], "      ")
        if info["versions"]:
            lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in sorted(info["versions"].items())))
    elif info["kind"] == "nemo":
        lines += [
            f"  format: .nemo archive, weights {info['weights']}",
            f"  architecture: {info['architecture']}",
            f"  artifacts: {', '.join(info['artifacts']) or 'none'}",
            f"  config keys: {', '.join(info['config_keys'])}",
        ]
        lines += _tensor_lines(info["tensors"], "  ")
        lines.append(f"  files: {len(info['files'])}, {human_bytes(info['total_bytes'])}")
    else:
        kind = {"dcp": "PyTorch DCP folder", "safetensors": "safetensors folder",
                "safetensors_file": "safetensors file"}[info["kind"]]
        lines.append(f"  format: {kind}")
        lines += _tensor_lines(info["tensors"], "  ")
        lines.append(f"  files: {len(info['files'])}, {human_bytes(sum(info['files'].values()))}")
    if args.files:
        lines.append("  file list:")
        lines += [f"    {human_bytes(size):>10}  {name}" for name, size in info["files"].items()]
    print("\n".join(lines))
    return 0
