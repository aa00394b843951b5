"""``ckptio prune CHECKPOINT_DIR``: apply a retention policy by hand (``--dry-run`` to preview)."""

from __future__ import annotations

import argparse
from typing import Any
import re

import sys

from ..engine import policies
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from ..engine.layout import BEST, pointer_target, scan
from ..storage import open_storage
from ._fmt import human_bytes, print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio prune``."""
    p = sub.add_parser("prune", help="delete checkpoints a retention policy does not keep",
                       description="Keep what any given rule keeps, plus the newest and the best checkpoint; "
                                   "delete the other committed checkpoints (uncommitted folders are left alone).")
    p.add_argument("checkpoint_dir")
    p.add_argument("--save-top-k", "--keep-top-k", dest="top_k", type=int, help="keep the k best by --monitor")
    p.add_argument("--monitor", help="metric name recorded in the manifests, e.g. val_loss")
    p.add_argument("--mode", choices=["min", "max"], default="min")
    p.add_argument("--keep-latest", type=int, help="keep the n newest")
    p.add_argument("--keep-every", type=int, help="keep checkpoints whose step is a multiple of this")
    p.add_argument("--keep-newer-than", help="keep checkpoints younger than this: 90s, 30m, 12h, 7d")
    p.add_argument("--keep-optimizer-latest", type=int, metavar="N",
                   help="remove the optimizer state of every kept checkpoint but the N newest (they keep their "
                        "weights); also removes what an interrupted pass left")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument("--force", action="store_true",
                   help="go ahead when the folder's lock is held by a process that is gone (never over a live one)")
    p.set_defaults(run=run)


def _duration(text: str | None) -> float | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise ConfigError(f"--keep-newer-than {text!r}: use a number with s, m, h or d, e.g. 7d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value}")


def _print_decision(decision: Any, dry_run: bool) -> None:
    for e in decision.keep:
        print(f"keep    {e.name}  ({', '.join(decision.reasons.get(e.name, ['kept']))})")
    for e in decision.delete:
        size = e.manifest.total_bytes if e.manifest else 0
        print(f"{'would delete' if dry_run else 'delete '} {e.name}  ({human_bytes(size)})")


def _prune_optimizers(storage: Any, kept: list[Any], newest: int, dry_run: bool, quiet: bool) -> None:
    """Remove (``dry_run``: list) the optimizer state of every kept checkpoint but the ``newest``."""
    from ..engine.layout import LATEST
    from ..engine.prune_optim import prunable, prune_optimizers

    latest = pointer_target(storage, LATEST)
    ordered = sorted(kept, key=lambda e: (e.step or 0, e.name))
    spared = {e.name for e in ordered[-newest:]} | ({latest.name} if latest is not None else set())
    doomed = [e for e in ordered if e.name not in spared and e.manifest is not None and prunable(e.manifest)]
    if not quiet:
        for e in doomed:
            print(f"{'would remove' if dry_run else 'remove '} the optimizer state of {e.name}  "
                  f"({', '.join(prunable(e.manifest))})")
    if not dry_run:
        prune_optimizers(storage, ordered, newest, keep=frozenset(spared))


def _apply(storage: Any, decision: Any, quiet: bool) -> None:
    """Delete what the decision says, then what interrupted saves left and objects nothing refers to any more."""
    policies.apply(storage, decision)
    for leftover in storage.sweep():
        if not quiet:
            print(f"removed leftover {leftover}")


def _owned(storage: Any, entries: list[Any], doomed: list[Any]) -> int:
    """The bytes deleting ``doomed`` frees: what each owns, less what a step that stays refers to or links."""
    from ..engine.manifest import held_by

    names = {e.name for e in doomed}
    held = held_by(e.manifest.shared for e in entries if e.manifest and e.name not in names)
    return sum(e.manifest.ownership(storage.folder(e.name), held.get(e.name, set()))[0] for e in doomed if e.manifest)


def run(args: argparse.Namespace) -> int:
    """Delete the committed checkpoints a retention policy does not keep (``--dry-run`` only lists them)."""
    if args.top_k is not None and not args.monitor:
        raise ConfigError("--save-top-k needs --monitor (use --keep-latest to keep the newest)")
    _positive("--save-top-k", args.top_k)
    _positive("--keep-latest", args.keep_latest)
    _positive("--keep-every", args.keep_every)
    policy = policies.RetentionPolicy(top_k=args.top_k, monitor=args.monitor, mode=args.mode,
                                      keep_latest=args.keep_latest, keep_every_n_steps=args.keep_every,
                                      keep_newer_than_s=_duration(args.keep_newer_than))
    _positive("--keep-optimizer-latest", args.keep_optimizer_latest)
    if not policy.active and not args.keep_optimizer_latest:
        raise ConfigError("give at least one rule: --save-top-k, --keep-latest, --keep-every, --keep-newer-than or "
                          "--keep-optimizer-latest")
    storage = open_storage(args.checkpoint_dir)  # a local folder or s3://bucket/prefix
    root = storage.root
    try:
        storage.folder().listdir()
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{root}: no such checkpoint folder") from None
    lock = storage.lock()
    if not args.dry_run:  # deleting: no training job may be writing here meanwhile
        lock.acquire(force=args.force)
        if lock.forced_over:
            print(f"warning: going ahead although the lock names {lock.forced_over} (--force; that holder is gone)",
                  file=sys.stderr)
    try:
        entries = scan(storage)
        if args.monitor and not any(policies.metric_of(e, args.monitor) is not None for e in entries if e.committed):
            seen = sorted({m for e in entries if e.manifest for m in e.manifest.metrics})
            raise ConfigError(f"no checkpoint in {root} records the metric {args.monitor!r} (metrics recorded: "
                              f"{seen or 'none'}); nothing can be ranked by it")
        try:
            best = pointer_target(storage, BEST)
        except CheckpointError as exc:
            print(f"warning: {exc}; no checkpoint is protected as BEST", file=sys.stderr)
            best = None
        protected = {best.name} if best is not None else set()
        decision = policies.decide(entries, policy, protected=protected) if policy.active else \
            policies.RetentionDecision(keep=[e for e in entries if e.committed and not e.adopted])
        if not args.json:
            _print_decision(decision, args.dry_run)
        freed = _owned(storage, entries, decision.delete)  # a file another step shares is not freed
        if not args.dry_run:
            _apply(storage, decision, args.json)
        if args.keep_optimizer_latest:
            _prune_optimizers(storage, decision.keep, args.keep_optimizer_latest, args.dry_run, args.json)
    finally:
        lock.release()
    if args.json:
        print_json({"checkpoint_dir": str(root), "dry_run": args.dry_run, "freed_bytes": freed,
                    "keep": {e.name: decision.reasons[e.name] for e in decision.keep},
                    "delete": [e.name for e in decision.delete]})
        return 0
    verb = "would free" if args.dry_run else "freed"
    print(f"{len(decision.keep)} kept, {len(decision.delete)} {'to delete' if args.dry_run else 'deleted'}; "
          f"{verb} {human_bytes(freed)}")
    return 0
