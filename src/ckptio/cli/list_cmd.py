"""``ckptio list CHECKPOINT_DIR``: every checkpoint with step, size, state, and which is LATEST."""

from __future__ import annotations

import argparse

from ..engine.describe import list_checkpoints
from ._fmt import human_bytes, print_json, table


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio list``."""
    p = sub.add_parser("list", help="list the checkpoints of a checkpoint folder",
                       description="List step directories, committed or not, oldest step first, and the checkpoints "
                                   "of other tools a restore reads there (DeepSpeed, HF Trainer, Megatron, Lightning), "
                                   "each with its format and what a restore takes from it.")
    p.add_argument("checkpoint_dir", help="the folder holding step directories (checkpoint_dir)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the step directories of a checkpoint folder, committed or not."""
    info = list_checkpoints(args.checkpoint_dir)
    if args.json:
        print_json(info)
        return 0
    rows = info["checkpoints"]
    for problem in info["problems"]:
        print(f"warning: {problem}")
    if not rows:
        print(f"{info['checkpoint_dir']}: no checkpoints")
        return 0
    body = []
    sharing = any(r["shared_bytes"] for r in rows)  # unchanged files shared between steps: what each owns and shares
    for r in rows:
        foreign = r.get("foreign")
        status = "committed" if r["committed"] else foreign["status"] if foreign else f"NOT USABLE: {r['problem']}"
        if r["committed"] and r["pruned"]:
            status += f" ({', '.join(r['pruned'])} pruned: weights only)"
        metrics = ", ".join(f"{k}={v:g}" for k, v in sorted(r["metrics"].items()))
        marks = [m for m, on in (("LATEST", r["latest"]), ("BEST", r["best"]),
                                 ("RESUME", bool(foreign and foreign["resumed"]))) if on]
        if r["protected"] and not marks:
            marks.append("protected")
        body.append([r["name"] + (" <- " + ", ".join(marks) if marks else ""), "-" if r["step"] is None else str(r["step"]),
                     "-" if r["epoch"] is None else str(r["epoch"]), human_bytes(r["bytes"])]
                    + ([human_bytes(r["owned_bytes"]), human_bytes(r["shared_bytes"])] if sharing else []) + [metrics, status])
    print(table(body, ["checkpoint", "step", "epoch", "size", *(["owns", "shares"] if sharing else []), "metrics", "status"]))
    committed = sum(1 for r in rows if r["committed"])
    resumed = next((r for r in rows if r.get("foreign") and r["foreign"]["resumed"]), None)
    print(f"\n{committed} committed checkpoint(s) in {info['checkpoint_dir']}; LATEST -> {info['latest'] or 'none'}"
          + (f"; BEST -> {info['best']}" if info["best"] else "")
          + (f"; RESUME -> {resumed['name']} ({resumed['foreign']['label']}): an automatic resume takes it"
             if resumed else ""))
    return 0
