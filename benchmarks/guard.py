"""The performance goals in one command: every row of the table on 1 and 2 ranks, each ratio against its goal.

    .venv/bin/python benchmarks/guard.py                                  # 1.8 GB state, 1, 2 and 4 ranks
    .venv/bin/python benchmarks/guard.py --size 300MB --worlds 1 --repeats 3   # a quick look
    $AM_VENV/bin/python benchmarks/guard.py                                # + the rows against NeMo AutoModel

Each world runs ``benchmarks/save_load.py`` once (the default layout: safetensors model + DCP optimizer,
``verify: full``; on 2 ranks an FSDP2-sharded state over gloo), and every row is a ratio to a baseline
measured in the same round of that run: contenders are interleaved in a shuffled order and each row is the
median over rounds of (contender ÷ baseline in that round), because this machine's disk varies ±2x from run to
run. The rows against AutoModel appear when ``nemo_automodel`` is importable (its own virtual environment, see
``../shared/bench/README.md``). The cold rows need root (to drop the page cache); without it they say so.

A world with more ranks than the machine has cores (4 ranks on this 2-core machine) is oversubscribed: its table
says so and none of its rows is judged (``--strict`` ignores them); its ratios still show a cost that grows with the
number of ranks before a user finds it.

One more row runs ``benchmarks/shared_reads.py`` (``--replicated-worlds``): a DDP-replicated restore on 2 ranks from
a bucket (a local S3 server), where each byte is to be read once in all.

A row above its goal prints ``ABOVE``; ``--strict`` then exits with 1 (for a scheduled run on a quiet machine:
the same command re-run decides whether a regression is real). ``--json FILE`` keeps the rows and the raw samples.
The last results, and the reasons for the rows that stay above their goals, are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

SAVE, ASYNC, WARM, COLD = ("durable save", "background save: time training is blocked", "load (warm page cache)",
                           "load (cold page cache)")

ROWS: list[tuple[str, str, str, str, float]] = [
    # (row, table, contender, baseline, goal: the ratio must stay at or below it)
    ("durable save ÷ raw write + fsync of the same bytes", SAVE, "ckptio (safetensors)", "raw write + fsync", 1.1),
    ("durable save ÷ AutoModel's save, same format", SAVE, "ckptio (safetensors)", "AutoModel (safetensors)", 0.9),
    ("background save() blocked ÷ a torch copy of the same bytes", ASYNC, "ckptio async (safetensors): save() blocked",
     "memory copy of the state", 1.2),
    ("warm restore ÷ raw warm read", WARM, "ckptio restore (safetensors)", "raw read", 2.5),
    ("cold restore ÷ raw cold read", COLD, "ckptio restore (safetensors)", "raw read", 1.2),
]
"""The issue's table (performance round three). Context rows (no goal) follow each world's table."""

CONTEXT: list[tuple[str, str, str, str]] = [
    ("DCP FileSystemWriter ÷ raw write + fsync", SAVE, "DCP FileSystemWriter", "raw write + fsync"),
    ("warm restore ÷ raw read into new memory (the floor of a fresh optimizer)", WARM, "ckptio restore (safetensors)",
     "raw read, optimizer part into new memory"),
    ("cold restore without the prefetch (CKPTIO_PREFETCH=0) ÷ raw cold read", COLD,
     "ckptio restore (safetensors), no prefetch", "raw read"),
]

SKIP = r"HF|consolidated|torch_save|io_threads|torch\.save|torch\.load|safetensors\.|ckptio sync"
"""Contenders of save_load.py the table does not use (the raw baselines always run)."""


def ratio(samples: dict, table: str, contender: str, baseline: str) -> tuple[float, list[float]] | None:
    """Median over rounds of contender ÷ baseline of the same round (``None``: one of them did not run)."""
    rows = samples.get(table, {})
    if contender not in rows or baseline not in rows:
        return None
    per_round = [c[0] / b[0] for c, b in zip(rows[contender], rows[baseline]) if b[0] > 0]
    return (statistics.median(per_round), per_round) if per_round else None


def run_world(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckptio-guard-") as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [sys.executable, str(HERE / "save_load.py"), "--size", args.size, "--repeats", str(args.repeats),
               "--world", str(world), "--skip", SKIP, "--json", str(out), "--seed", str(args.seed)]
        if args.dir:
            cmd += ["--dir", args.dir]
        print(f"\n== {world} rank(s): {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, stdout=None if args.verbose else subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"save_load.py on {world} rank(s) failed (exit {done.returncode}); rerun with --verbose")
        return json.loads(out.read_text())


def report(world: int, data: dict) -> list[dict]:
    samples = data["samples"]
    cold_ok = COLD in samples
    rows = []
    over = world > (os.cpu_count() or 1)
    print(f"\n{world} rank(s), {data['size_bytes'] / 1e9:.2f} GB of state"
          f"{'' if data.get('automodel') else ' (AutoModel not importable: its rows are skipped)'}"
          + (f"; OVERSUBSCRIBED: {world} ranks on {os.cpu_count()} cores, ratios only, no row judged" if over else ""))
    print(f"  {'row':<62} {'goal':>6} {'ratio':>6}  rounds")
    for name, table, contender, baseline, goal in ROWS:
        got = ratio(samples, table, contender, baseline)
        if got is None:
            why = "page cache not dropped (needs root)" if table == COLD and not cold_ok else "not measured"
            print(f"  {name:<62} {'≤' + str(goal):>6} {'n/a':>6}  {why}")
            rows.append({"world": world, "row": name, "goal": goal, "ratio": None})
            continue
        med, per_round = got
        verdict = "(oversubscribed)" if over else "ok" if med <= goal else "ABOVE"
        print(f"  {name:<62} {'≤' + str(goal):>6} {med:6.2f}  {' '.join(f'{x:.2f}' for x in per_round)}  {verdict}")
        rows.append({"world": world, "row": name, "goal": goal, "ratio": med, "rounds": per_round,
                     "ok": None if over else med <= goal, "oversubscribed": over})
    for name, table, contender, baseline in CONTEXT:
        got = ratio(samples, table, contender, baseline)
        if got is not None:
            print(f"  {name:<62} {'':>6} {got[0]:6.2f}  (context)")
    return rows


REPLICATED_GOAL = 1.05
"""Bytes a DDP restore reads from storage, summed over the ranks, ÷ the checkpoint's data bytes (each byte once; the
DCP reader's look-ahead at each record's ends is the rest)."""


def run_replicated(world: int, args: argparse.Namespace) -> list[dict]:
    """``benchmarks/shared_reads.py`` on ``world`` ranks from a bucket (where the reads are shared by default): the
    bytes read against the checkpoint's size, and the time against every rank reading all it restores."""
    with tempfile.TemporaryDirectory(prefix="ckptio-guard-") as tmp:
        out = Path(tmp) / "shared.json"
        cmd = [sys.executable, str(HERE / "shared_reads.py"), "--world", str(world), "--size", args.replicated_size,
               "--repeats", str(args.repeats), "--s3", "--json", str(out), "--seed", str(args.seed)]
        print(f"\n== replicated (DDP) restore, {world} ranks, from a bucket: {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, stdout=None if args.verbose else subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"shared_reads.py on {world} ranks failed (exit {done.returncode}); rerun with --verbose")
        data = json.loads(out.read_text())
    shared, alone = data["rows"]["bucket, share_reads=True"], data["rows"]["bucket, share_reads=False"]
    name = f"DDP restore: bytes read ÷ checkpoint size ({world} ranks, bucket)"
    ok = shared["read"] <= REPLICATED_GOAL
    print(f"  {name:<62} {'≤' + str(REPLICATED_GOAL):>6} {shared['read']:6.2f}  {'ok' if ok else 'ABOVE'}")
    print(f"  {'  the same, every rank reading all it restores':<62} {'':>6} {alone['read']:6.2f}  (context)")
    print(f"  {'  restore time ÷ every rank reading all it restores':<62} {'':>6} {shared['time_vs_unshared']:6.2f}"
          "  (context)")
    return [{"world": world, "row": name, "goal": REPLICATED_GOAL, "ratio": shared["read"], "ok": ok,
             "time_vs_unshared": shared["time_vs_unshared"]}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.8GB", help="state size (model + AdamW), all ranks together")
    p.add_argument("--worlds", default="1,2,4", help="comma-separated rank counts (more than the cores: not judged)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per world (after one warm-up round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where save_load.py writes (default: a temporary folder on /var/tmp)")
    p.add_argument("--json", default=None, help="write the rows and samples here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row is above its goal")
    p.add_argument("--verbose", action="store_true", help="show save_load.py's own tables")
    p.add_argument("--replicated-worlds", default="2", help="rank counts of the replicated (DDP) restore row ('' none)")
    p.add_argument("--replicated-size", default="600MB", help="state size of the replicated restore (each rank all)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows, raw = [], {}
    for world in (int(w) for w in args.worlds.split(",") if w):
        data = run_world(world, args)
        raw[world] = data
        rows += report(world, data)
    for world in (int(w) for w in args.replicated_worlds.split(",") if w):
        rows += run_replicated(world, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "runs": raw}, indent=1))
    above = [r for r in rows if r.get("ok") is False]
    print(f"\n{len(above)} row(s) above their goal" + (": " + "; ".join(f"{r['row']} on {r['world']} rank(s)"
                                                                       for r in above) if above else ""))
    return 1 if above and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
