"""A frozen fine-tune saved often: what ckptio writes and keeps when unchanged tensors are stored once (issue 47).

    .venv/bin/python benchmarks/frozen_finetune.py                       # medium state (1.8 GB), local disk, 10 saves
    .venv/bin/python benchmarks/frozen_finetune.py --bucket-mb 160       # also in a bucket (moto's server, loopback)

The model is a Llama-shaped stack of fp32 tensors (embeddings, ``--layers`` blocks of four d×d and two d×4d
matrices, an output head) with AdamW; the embeddings, the head and the first half of the blocks are frozen
(``requires_grad=False``), as in a partial fine-tune. Each save follows one optimizer step, as a run saving every
N steps would; retention keeps 5 newest and the 3 best (8 checkpoints). Printed, medians over the saves after the
first:

* **bytes written per save** (``/proc/self/io`` ``wchar``: every byte the process passed to ``write``) against
  the changed bytes (trainable weights and their AdamW state): goal for the median ≤ 1.05 × changed + 1 MiB; the
  mean also counts the second copies of the frozen files (a copy is held by at most ``n - 1`` of the ``n`` kept
  steps and by fewer than the steps committed, so that one damaged file never holds every kept step's only copy);
* **bytes read per save** (``rchar``): what a save reads back before it shares a file (every shared file is hashed
  against the live tensors' digest first), the price of never linking bytes it has not checked;
* **durable save time** with sharing and without (``share_unchanged=False``), interleaved, and their ratio
  against changed ÷ full;
* **the folder with 8 kept checkpoints** as ``du -sb`` counts it (a hard-linked file once), against the same
  without sharing; and **with 5 kept** (the 5 newest): goal ≤ 0.5 × 5 full copies;
* **in a bucket** (``--bucket-mb``, a smaller state: the loopback server is slow): bytes PUT by the last save (the
  objects under the step's prefix) and bytes stored for the 8 kept, against 8 full copies (the same second copies
  as on disk, counted by the committed manifests that use each object);
* **nothing frozen**: the durable save with sharing on and off (what deciding "equal" costs when there is
  nothing to share): goal ≤ 5 %.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _model(dim: int, layers: int, vocab: int, frozen: bool, trained: int | None = None):
    import torch

    torch.manual_seed(0)
    blocks = [torch.nn.ModuleDict({n: torch.nn.Linear(dim, dim, bias=False) for n in ("q", "k", "v", "o")}
                                  | {"up": torch.nn.Linear(dim, 4 * dim, bias=False),
                                     "down": torch.nn.Linear(4 * dim, dim, bias=False)}) for _ in range(layers)]
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(vocab, dim), "blocks": torch.nn.ModuleList(blocks),
                                 "head": torch.nn.Linear(dim, vocab, bias=False)})
    if frozen:
        for p in [*model["embed"].parameters(), *model["head"].parameters(),
                  *[p for b in blocks[:layers - (layers // 2 if trained is None else trained)] for p in b.parameters()]]:
            p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    return model, opt, trainable


def _step(model, opt, trainable) -> None:
    import torch

    for p in trainable:  # a step's worth of change, without the cost of a forward pass
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad()


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def _du(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True).stdout.split()[0])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _run(root: str, args: argparse.Namespace, *, frozen: bool, share: bool, saves: int, best: bool = True) -> dict:
    from ckptio import CheckpointConfig, CheckpointManager

    model, opt, trainable = _model(args.dim, args.layers, args.vocab, frozen, args.trained_blocks)
    ranked = {"save_top_k": 3, "monitor": "loss"} if best else {}
    cfg = CheckpointConfig(checkpoint_dir=root, keep_latest=5, share_unchanged=share, **ranked)
    times, written, read = [], [], []
    with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as mgr:
        for step in range(1, saves + 1):
            _step(model, opt, trainable)
            before, got, start = _wchar(), _rchar(), time.perf_counter()
            mgr.save(step=step, metrics={"loss": float(abs(step - 2))})  # the best: steps 1-3
            times.append(time.perf_counter() - start)
            written.append(_wchar() - before)
            read.append(_rchar() - got)
    state = opt.state_dict()["state"]
    changed = _bytes(trainable) + sum(_bytes(v for v in s.values() if v.dim()) for s in state.values())
    full = _bytes(model.state_dict().values()) + changed - _bytes(trainable)
    return {"times": times[1:], "written": written[1:], "read": read[1:], "changed": changed, "full": full}


def local(args: argparse.Namespace) -> None:
    base = tempfile.mkdtemp(prefix="ckptio-frozen-", dir=args.dir)
    runs: dict[str, list[dict]] = {"shared": [], "whole": []}
    for r in range(args.rounds):  # interleaved: the disk's speed drifts
        for name, share in (("shared", True), ("whole", False)):
            root = f"{base}/{name}{r}"
            runs[name].append(_run(root, args, frozen=True, share=share, saves=args.saves))
            runs[name][-1]["du"] = _du(root)
            subprocess.run(["rm", "-rf", root], check=True)
    s, w = runs["shared"], runs["whole"]
    changed, full = s[0]["changed"], s[0]["full"]
    per_save = statistics.median(x for run in s for x in run["written"])
    mean_save = statistics.mean(x for run in s for x in run["written"])
    t_shared = statistics.median(x for run in s for x in run["times"])
    t_whole = statistics.median(x for run in w for x in run["times"])
    du = statistics.median(run["du"] for run in s)
    mib = 1 << 20
    print(f"state: {full / 1e6:.0f} MB in all, changed by a step {changed / 1e6:.0f} MB ({changed / full:.0%}); "
          f"{args.saves} saves x {args.rounds} rounds, 8 kept")
    print(f"bytes written per save (after the first): {per_save / 1e6:.1f} MB = "
          f"{per_save / changed:.3f} x changed (goal <= 1.05 x changed + 1 MiB: "
          f"{'met' if per_save <= 1.05 * changed + mib else 'NOT MET'})")
    print(f"bytes written per save, mean (a second copy of the frozen files now and then, so that no file holds "
          f"every kept step): {mean_save / 1e6:.1f} MB = {mean_save / changed:.3f} x changed, "
          f"{mean_save / full:.3f} x full")
    read = statistics.mean(x for run in s for x in run["read"])
    print(f"bytes read per save, mean (each shared file read back and hashed before it is linked): {read / 1e6:.1f} MB "
          f"= {read / (full - changed + 1):.3f} x the frozen bytes")
    print(f"durable save: {t_shared:.2f} s shared, {t_whole:.2f} s whole: ratio {t_shared / t_whole:.2f} "
          f"(changed / full = {changed / full:.2f}; the read-back is inside the shared time)")
    whole_du = statistics.median(r["du"] for r in w)
    print(f"folder with 8 kept (du -sb): {du / 1e6:.0f} MB; without sharing {whole_du / 1e6:.0f} MB: "
          f"x{du / whole_du:.2f} (one full + 7 x changed would be x{(full + 7 * changed) / (8 * full):.2f})")
    five: dict[str, list[int]] = {"shared": [], "whole": []}
    for r in range(args.rounds):  # 5 newest kept: at most half the disk of 5 full copies
        for name, share in (("shared", True), ("whole", False)):
            root = f"{base}/five-{name}{r}"
            _run(root, args, frozen=True, share=share, saves=args.saves, best=False)
            five[name].append(_du(root))
            subprocess.run(["rm", "-rf", root], check=True)
    ratio5 = statistics.median(five["shared"]) / statistics.median(five["whole"])
    print(f"folder with 5 kept (du -sb): {statistics.median(five['shared']) / 1e6:.0f} MB against "
          f"{statistics.median(five['whole']) / 1e6:.0f} MB for 5 full copies: x{ratio5:.2f} "
          f"(goal <= 0.5: {'met' if ratio5 <= 0.5 else 'NOT MET'})")
    on, off = [], []
    for r in range(args.rounds):
        for share, into in ((True, on), (False, off)):
            root = f"{base}/plain{r}{share}"
            into.append(statistics.median(_run(root, args, frozen=False, share=share, saves=4)["times"]))
            subprocess.run(["rm", "-rf", root], check=True)
    cost = statistics.median(on) / statistics.median(off) - 1
    print(f"nothing frozen: save {statistics.median(on):.2f} s with sharing on, {statistics.median(off):.2f} s off: "
          f"{cost:+.1%} (goal <= 5 %: {'met' if cost <= 0.05 else 'NOT MET'})")


def bucket(args: argparse.Namespace) -> None:
    import s3server

    from ckptio.storage.s3 import client

    proc, endpoint = s3server.start()
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, **s3server.ENV})
    try:
        s3 = client()
        s3.create_bucket(Bucket="frozen")
        scale = argparse.Namespace(**{**vars(args), "dim": args.bucket_dim, "vocab": args.bucket_vocab})
        result = _run("s3://frozen/run", scale, frozen=True, share=True, saves=args.saves)
        objects: dict[str, int] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="frozen", Prefix="run/"):
            objects.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        steps: dict[str, int] = {}
        for key, size in objects.items():
            steps[key.split("/")[1]] = steps.get(key.split("/")[1], 0) + size
        changed, full = result["changed"], result["full"]
        stored = sum(objects.values())
        last = steps[max((k for k in steps if k.startswith("epoch_")), key=lambda k: int(k.rsplit("_", 1)[1]))]
        print(f"bucket: state {full / 1e6:.0f} MB, changed {changed / 1e6:.0f} MB; bytes PUT by the last save "
              f"{last / 1e6:.1f} MB = {last / changed:.3f} x changed (a save that starts a second copy uploads the "
              f"frozen files too); stored for 8 kept {stored / 1e6:.0f} MB: x{stored / (8 * full):.2f} of 8 full copies")
    finally:
        proc.terminate()


def main() -> None:
    import logging

    logging.getLogger("ckptio").setLevel(logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--trained-blocks", type=int, default=None,
                   help="how many of the top blocks train (default: half; the rest, the embeddings and the head frozen)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temporary folder)")
    p.add_argument("--bucket-mb", type=int, default=0, help="also run in a bucket (0: not)")
    args = p.parse_args()
    args.bucket_dim, args.bucket_vocab = 256, max(1000, args.bucket_mb * (1 << 20) // (2 * 256 * 4))  # embeddings + head
    local(args)
    if args.bucket_mb:
        bucket(args)


if __name__ == "__main__":
    main()
