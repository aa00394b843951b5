"""Durable save, background-save pause and cold load of a training state, against baselines measured in
the same run.

    .venv/bin/python benchmarks/save_load.py --size 256MiB --repeats 5
    .venv/bin/python benchmarks/save_load.py --size 256MiB --world 2     # the same on 2 gloo ranks (FSDP2)

The state is a Llama (built from a config) plus its AdamW state after one step, about ``--size`` bytes
in all. Every contender writes the same state durably (files fsynced) into a fresh folder. Contenders
are interleaved across repeats after one warm-up round (this VM returns freed memory to its host, so
first writes from fresh memory are slow), and medians are printed with their ratio to a reference
measured in the same run:

* durable saves against a raw sequential write + fsync of the same bytes (the disk's limit);
* the time an async save blocks training against a plain copy of the same tensors into preallocated
  buffers (the limit for staging), and against the sync save;
* loads (after dropping the page cache, when root) against a raw read of the same bytes.

``peak +RSS`` is the largest rise of the process's resident memory above its level before the call,
sampled every 2 ms (on 2 ranks, the largest over ranks). On 2 ranks each rank holds half the state
(FSDP2 shards) and times are those of the slowest rank; the single-file baselines (torch.save,
safetensors, HF) have no sharded equivalent and are left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch


def _size(text: str) -> int:
    from ckptio.formats.hf_bundle import parse_size

    return parse_size(text)


def build_state(target_bytes: int, shard: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, vocab = 1024, 2816, 8192
    per_layer = (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) * 4
    layers = max(1, round((target_bytes / 3 - vocab * hidden * 4) / per_layer))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _local_tensors(model, opt) -> dict[str, torch.Tensor]:
    """This rank's bytes of the state: local shards of parameters and optimizer tensors."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    out = {f"model.{k}": local(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"optim.{i}.{k}"] = local(v)
    return out


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Largest rise of this process's RSS above its level at entry, sampled on a thread."""

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


class Bench:
    """One process's (rank's) contenders and measurements."""

    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        import logging

        logging.getLogger("ckptio").setLevel(logging.WARNING)
        from ckptio import _dist
        from ckptio.storage.checksum import bytes_checksum  # noqa: F401  (loads the crc32c extension up front)

        self.args, self.base = args, base
        self.rank, self.world = _dist.rank(), _dist.world_size()
        self.model, self.opt = build_state(_size(args.size), shard=self.world > 1)
        self.tensors = _local_tensors(self.model, self.opt)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.copy_targets = {k: torch.empty_like(v).fill_(0) for k, v in self.tensors.items()}

    # -------------------------------------------------------------- helpers
    def sync(self) -> None:
        from ckptio import _dist

        _dist.barrier()

    def gather_max(self, value: float) -> float:
        from ckptio import _dist

        return max(_dist.all_gather_object(value))

    def measure(self, fn: Callable[[], object]) -> tuple[float, int]:
        self.sync()
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        return self.gather_max(dt), int(self.gather_max(rss.extra))

    def folder(self, name: str, r: int) -> Path:
        d = self.base / f"{name.split()[0].replace('.', '_').replace('(', '')}-{r}"
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        os.sync()  # earlier contenders' deletes and write-back are not charged to this one
        self.sync()
        return d

    # -------------------------------------------------------------- contenders
    def savers(self) -> dict[str, Callable[[Path], object]]:
        import safetensors.torch as st
        import torch.distributed.checkpoint as dcp

        from ckptio import CheckpointConfig, CheckpointManager
        from ckptio.storage import fsync_tree

        model, opt, rank = self.model, self.opt, self.rank

        def raw_save(d: Path) -> None:
            # the state's own bytes, straight from the tensors' memory, in 8 MiB writes, one file: the
            # disk's limit. (A separate pre-built copy of the bytes measured 1.5-2.5x slower inside this
            # process on this VM, though not alone; the tensors themselves are what every contender writes.)
            chunk = 8 << 20
            with open(d / f"raw{rank}.bin", "wb", buffering=0) as fh:
                for t in self.tensors.values():
                    view = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
                    for off in range(0, len(view), chunk):
                        fh.write(view[off:off + chunk])
                os.fsync(fh.fileno())

        def dcp_save(d: Path) -> None:
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                     storage_writer=dcp.FileSystemWriter(str(d / "dcp"), sync_files=True), no_dist=self.world == 1)

        def ckptio_save(fmt: str, threads: int | None = None) -> Callable[[Path], None]:
            def run(d: Path) -> None:  # io_threads=None: the default
                extra = {} if threads is None else {"io_threads": threads}
                cfg = CheckpointConfig(checkpoint_dir=str(d / "ck"), model_save_format=fmt, **extra)
                with CheckpointManager(cfg, model=model, optimizer=opt) as mgr:
                    mgr.save(step=1)
            return run

        savers: dict[str, Callable[[Path], object]] = {"raw write + fsync": raw_save}
        if self.world == 1:
            def torch_save(d: Path) -> None:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, d / "ckpt.pt")
                fsync_tree(d)

            def safetensors_save(d: Path) -> None:
                st.save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(d / "ckpt.safetensors"))
                fsync_tree(d)

            def hf_trainer_save(d: Path) -> None:
                model.save_pretrained(d / "hf")
                torch.save(opt.state_dict(), d / "hf" / "optimizer.pt")
                fsync_tree(d)

            savers.update({"torch.save": torch_save, "safetensors.save_file": safetensors_save,
                           "HF save_pretrained + torch.save(optim)": hf_trainer_save})
        savers["DCP FileSystemWriter"] = dcp_save
        savers["ckptio (safetensors)"] = ckptio_save("safetensors")
        savers["ckptio (torch_save/DCP)"] = ckptio_save("torch_save")
        for threads in self.args.io_threads:
            if threads != CheckpointConfig().io_threads:  # the row above runs the default
                savers[f"ckptio (safetensors, io_threads={threads})"] = ckptio_save("safetensors", threads)
        return savers

    # -------------------------------------------------------------- phases
    def run_saves(self) -> dict[str, Path]:
        savers = self.savers()
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in savers}
        kept: dict[str, Path] = {}
        names = list(savers)
        for r in range(self.args.repeats + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                d = self.folder(name, r)
                res = self.measure(lambda: savers[name](d))
                if r > 0:
                    results[name].append(res)
                if name in kept and self.rank == 0:
                    shutil.rmtree(kept[name], ignore_errors=True)
                kept[name] = d
            self.say(f"  save round {r}{' (warm-up)' if r == 0 else ''} done")
        self.report("durable save", results, "raw write + fsync", rate=True)
        return kept

    def run_async(self) -> None:
        from ckptio import CheckpointConfig, CheckpointManager

        managers = {}
        for fmt in ("safetensors", "torch_save"):
            d = self.folder(f"async-{fmt}", 0)
            cfg = CheckpointConfig(checkpoint_dir=str(d / "ck"), model_save_format=fmt, async_save=True, save_top_k=1)
            managers[fmt] = CheckpointManager(cfg, model=self.model, optimizer=self.opt)

        def copy() -> None:
            for k, v in self.tensors.items():
                self.copy_targets[k].copy_(v)

        contenders: dict[str, Callable[[int], object]] = {"memory copy of the state": lambda step: copy()}
        for fmt, mgr in managers.items():
            contenders[f"ckptio async ({fmt}): save() blocked"] = lambda step, mgr=mgr: mgr.save(step=step)
            contenders[f"ckptio async ({fmt}): until committed"] = (
                lambda step, mgr=mgr: (mgr.save(step=step), mgr.wait()))
            contenders[f"ckptio sync ({fmt})"] = lambda step, mgr=mgr, fmt=fmt: self._sync_save(fmt, step)
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in contenders}
        names = list(contenders)
        step = 0
        for r in range(self.args.repeats + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                step += 1
                res = self.measure(lambda: contenders[name](step))
                for mgr in managers.values():
                    mgr.wait()  # the blocked-time rows leave the write running; it must not overlap the next row
                if r > 0:
                    results[name].append(res)
            self.say(f"  async round {r}{' (warm-up)' if r == 0 else ''} done")
        for mgr in managers.values():
            mgr.close()
        self.report("background save: time training is blocked", results, "memory copy of the state", rate=True)

    def _sync_save(self, fmt: str, step: int) -> None:
        from ckptio import CheckpointConfig, CheckpointManager

        d = self.base / f"sync-{fmt}"
        cfg = CheckpointConfig(checkpoint_dir=str(d), model_save_format=fmt, save_top_k=1)
        with CheckpointManager(cfg, model=self.model, optimizer=self.opt) as mgr:
            mgr.save(step=step)

    def run_loads(self, kept: dict[str, Path]) -> None:
        import safetensors.torch as st
        import torch.distributed.checkpoint as dcp

        from ckptio import CheckpointConfig, CheckpointManager

        model, opt, rank = self.model, self.opt, self.rank
        loaders: dict[str, Callable[[], object]] = {
            "raw read": lambda: (kept["raw write + fsync"] / f"raw{rank}.bin").read_bytes(),
            "DCP load": lambda: dcp.load({"model": model.state_dict(), "optim": opt.state_dict()},
                                         storage_reader=dcp.FileSystemReader(str(kept["DCP FileSystemWriter"] / "dcp")),
                                         no_dist=self.world == 1),
            "ckptio restore (safetensors)": lambda: CheckpointManager(
                CheckpointConfig(checkpoint_dir=str(kept["ckptio (safetensors)"] / "ck")), model=model, optimizer=opt,
                rng=False).restore(),
            "ckptio restore (torch_save/DCP)": lambda: CheckpointManager(
                CheckpointConfig(checkpoint_dir=str(kept["ckptio (torch_save/DCP)"] / "ck"),
                                 model_save_format="torch_save"), model=model, optimizer=opt, rng=False).restore(),
        }
        if self.world == 1:
            loaders["torch.load"] = lambda: torch.load(kept["torch.save"] / "ckpt.pt", weights_only=True)
            loaders["safetensors.load_file"] = lambda: st.load_file(kept["safetensors.save_file"] / "ckpt.safetensors")
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in loaders}
        cold = True
        names = list(loaders)
        for r in range(self.args.repeats + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                self.sync()
                if rank == 0:
                    cold = drop_caches() and cold
                res = self.measure(loaders[name])
                if r > 0:
                    results[name].append(res)
        self.report(f"load ({'cold page cache' if cold else 'WARM page cache: could not drop it'})", results,
                    "raw read", rate=True)

    # -------------------------------------------------------------- output
    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def report(self, title: str, results: dict[str, list[tuple[float, int]]], ref: str, rate: bool) -> None:
        ref_t = statistics.median(t for t, _ in results[ref])
        self.say(f"\n{title} ({self.args.repeats} repeats, median; x = time / {ref}; {self.world} rank(s))")
        self.say(f"  {'':<52} {'time':>8} {'GB/s':>7} {'x':>6} {'peak +RSS':>10}")
        for name, runs in results.items():
            med = statistics.median(t for t, _ in runs)
            rss = max(m for _, m in runs)
            gbs = self.nbytes * self.world / med / 1e9 if rate else float("nan")
            self.say(f"  {name:<52} {med:7.3f}s {gbs:7.2f} {med / ref_t:6.2f} {rss / 2**20:7.0f} MiB")


def run(args: argparse.Namespace, base: Path) -> None:
    bench = Bench(args, base)
    total = bench.nbytes * bench.world
    bench.say(f"state: {len(bench.tensors)} tensors per rank, {total / 2**20:.0f} MiB in all on {bench.world} rank(s)"
              f" (model + AdamW); writing under {base}")
    phases = args.phases
    kept = bench.run_saves() if "save" in phases or "load" in phases else {}
    if "async" in phases:
        bench.run_async()
    if "load" in phases:
        bench.run_loads(kept)
    bench.sync()


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, base: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run(args, base)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB", help="approximate bytes of model + optimizer state (all ranks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=1, help="ranks (gloo on CPU, FSDP2-sharded state)")
    p.add_argument("--io-threads", default="1", help="comma-separated io_threads values to compare, e.g. 1,2,4")
    p.add_argument("--phases", default="save,async,load", help="any of save, async, load")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder on this disk)")
    args = p.parse_args()
    args.io_threads = [int(x) for x in args.io_threads.split(",")]
    args.phases = set(args.phases.split(","))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ.setdefault("TQDM_DISABLE", "1")
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckptio-bench-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        if args.world == 1:
            run(args, base)
        else:
            import torch.multiprocessing as mp

            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_rank_main, args=(args.world, os.path.join(tmp, "store"), args, base),
                                   nprocs=args.world, start_method="spawn")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
