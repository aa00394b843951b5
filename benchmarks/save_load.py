"""Durable save and cold load of a training state, against the baselines, measured in the same run.

    .venv/bin/python benchmarks/save_load.py --size 256MiB --repeats 3

The state is a Llama (from a config) plus AdamW state after one step, about ``--size`` bytes in all.
Every contender writes the same state durably (files fsynced) into a fresh folder; contenders are
interleaved across repeats after one warm-up round, and the medians are printed with their ratio to a
raw sequential write (or read) of the same number of bytes — the disk's own limit on this machine.
Loads run after dropping the page cache when the machine allows it (root: /proc/sys/vm/drop_caches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch


def _size(text: str) -> int:
    from ckptio.formats.hf_bundle import parse_size

    return parse_size(text)


def build_state(target_bytes: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, vocab = 1024, 2816, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    layers = max(1, round((target_bytes / 3 - vocab * hidden * 4) / per_layer))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _fsync_tree(path: Path) -> None:
    from ckptio.storage import fsync_tree

    fsync_tree(path)


def _tensors(model, opt) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i, (p, st) in enumerate(opt.state.items()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{i}.{k}"] = v
    return out


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB", help="approximate bytes of model + optimizer state")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder on this disk)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging

    logging.getLogger("ckptio").setLevel(logging.WARNING)
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    from ckptio import CheckpointConfig, CheckpointManager
    from ckptio.storage.checksum import bytes_checksum  # noqa: F401  (imports the crc32c extension up front)

    model, opt = build_state(_size(args.size))
    tensors = _tensors(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"state: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB (model {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.0f} MiB + AdamW)")
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckptio-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)

    # the raw baseline writes one pre-built, already touched buffer: this VM returns freed memory to its
    # host, and first-touch page faults would otherwise be charged to the disk
    raw_buffer = bytearray(nbytes)
    offset = 0
    for t in tensors.values():
        view = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        raw_buffer[offset:offset + view.nbytes] = view
        offset += view.nbytes

    def raw_save(d: Path) -> None:
        with open(d / "raw.bin", "wb") as fh:
            fh.write(raw_buffer)
            fh.flush()
            os.fsync(fh.fileno())

    def torch_save(d: Path) -> None:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, d / "ckpt.pt")
        _fsync_tree(d)

    def safetensors_save(d: Path) -> None:
        st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "ckpt.safetensors"))
        _fsync_tree(d)

    def dcp_save(d: Path) -> None:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_writer=dcp.FileSystemWriter(str(d / "dcp"), sync_files=True), no_dist=True)

    def hf_trainer_save(d: Path) -> None:
        model.save_pretrained(d / "hf")
        torch.save(opt.state_dict(), d / "hf" / "optimizer.pt")
        _fsync_tree(d)

    def ckptio_save(fmt: str) -> Callable[[Path], None]:
        def run(d: Path) -> None:
            with CheckpointManager(CheckpointConfig(checkpoint_dir=str(d / "ck"), model_save_format=fmt),
                                   model=model, optimizer=opt) as mgr:
                mgr.save(step=1)
        return run

    savers: dict[str, Callable[[Path], None]] = {
        "raw write + fsync": raw_save, "torch.save": torch_save, "safetensors.save_file": safetensors_save,
        "DCP FileSystemWriter": dcp_save, "HF save_pretrained + torch.save(optim)": hf_trainer_save,
        "ckptio (safetensors)": ckptio_save("safetensors"), "ckptio (torch_save/DCP)": ckptio_save("torch_save"),
    }
    times: dict[str, list[float]] = {k: [] for k in savers}
    kept: dict[str, Path] = {}
    names = list(savers)
    for r in range(args.repeats + 1):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            d = base / f"{name.split()[0].replace('.', '_').replace('(', '')}-{r}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            t0 = time.perf_counter()
            savers[name](d)
            dt = time.perf_counter() - t0
            if r > 0:
                times[name].append(dt)
            if name in kept:
                shutil.rmtree(kept[name], ignore_errors=True)
            kept[name] = d
        print(f"  save round {r}{' (warm-up)' if r == 0 else ''} done", flush=True)

    def report(title: str, results: dict[str, list[float]], ref: str) -> None:
        ref_t = statistics.median(results[ref])
        print(f"\n{title} ({args.repeats} repeats, median; ratio = time / {ref})")
        for name, ts in results.items():
            med = statistics.median(ts)
            print(f"  {name:<42} {med:7.2f} s  {nbytes / med / 1e9:6.2f} GB/s  x{med / ref_t:5.2f}")

    report("durable save", times, "raw write + fsync")

    loaders: dict[str, Callable[[], object]] = {
        "raw read": lambda: (kept["raw write + fsync"] / "raw.bin").read_bytes(),
        "torch.load": lambda: torch.load(kept["torch.save"] / "ckpt.pt", weights_only=True),
        "safetensors.load_file": lambda: st.load_file(kept["safetensors.save_file"] / "ckpt.safetensors"),
        "DCP load": lambda: dcp.load({"model": model.state_dict(), "optim": opt.state_dict()},
                                     storage_reader=dcp.FileSystemReader(str(kept["DCP FileSystemWriter"] / "dcp")),
                                     no_dist=True),
        "ckptio restore (safetensors)": lambda: CheckpointManager(
            CheckpointConfig(checkpoint_dir=str(kept["ckptio (safetensors)"] / "ck")), model=model, optimizer=opt,
            rng=False).restore(),
        "ckptio restore (torch_save/DCP)": lambda: CheckpointManager(
            CheckpointConfig(checkpoint_dir=str(kept["ckptio (torch_save/DCP)"] / "ck"), model_save_format="torch_save"),
            model=model, optimizer=opt, rng=False).restore(),
    }
    load_times: dict[str, list[float]] = {k: [] for k in loaders}
    cold = True
    lnames = list(loaders)
    for r in range(args.repeats + 1):
        for name in lnames[r % len(lnames):] + lnames[: r % len(lnames)]:
            cold = drop_caches() and cold
            t0 = time.perf_counter()
            loaders[name]()
            dt = time.perf_counter() - t0
            if r > 0:
                load_times[name].append(dt)
    report(f"load ({'cold page cache' if cold else 'WARM page cache: could not drop it'})", load_times, "raw read")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
