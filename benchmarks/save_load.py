"""Durable save, background-save pause, cold and warm load of a training state, against baselines and peers
measured in the same run.

    .venv/bin/python benchmarks/save_load.py --size 300MB --repeats 5
    .venv/bin/python benchmarks/save_load.py --size 1.8GB --world 2        # 2 gloo ranks, FSDP2-sharded state
    $AM_VENV/bin/python benchmarks/save_load.py --size 1.8GB               # + NeMo AutoModel 0.7's checkpointer

The state is a Llama (built from a config) plus its AdamW state after one step, about ``--size`` bytes in
all. Every contender writes the same state durably (every file fsynced before the clock stops) into a
fresh folder, and loads it into the live model and a *fresh* optimizer (no state yet), as a resumed
process does. AutoModel joins as a contender when ``nemo_automodel`` is importable (it needs its own
virtual environment: ``../shared/bench/setup_automodel_venv.sh``, then ``pip install --no-deps -e .``).

Fairness: one untimed warm-up round; then every round runs every contender once, in an order shuffled
per round (seeded, the same on every rank); cold loads follow a dropped page cache (needs root; the
table says when it could not); peak memory is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each call) read after the call, so nothing samples memory inside the
timed region. Reported: median and min–max over the rounds, GB/s of the whole state, and the ratio of
the median to a baseline of the same table (raw write + fsync, memory copy, raw read), because this
machine's disk varies ±2x from run to run. On several ranks, times are the slowest rank's and memory the
largest rank's; baselines without a sharded form (torch.save, safetensors.save_file, HF) run on 1 rank only.
``--json FILE`` keeps every sample for the README table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
    from ckptio.formats.safetensors.hf_bundle import parse_size

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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Largest rise of resident memory over its level at entry: the kernel's high-water mark, reset at entry
    and read at exit (nothing runs during the call); a sampling thread where the reset is not allowed."""

    def __enter__(self) -> "PeakRSS":
        self.base = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5\n")  # reset VmHWM to the current RSS
            self._thread = None
        except OSError:
            self.peak = self.base
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_kib("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            self.peak = _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


LOADED_FROM = {
    "raw read": "raw write + fsync",
    "DCP load (+ set_optimizer_state_dict)": "DCP FileSystemWriter",
    "ckptio restore (safetensors)": "ckptio (safetensors)",
    "ckptio restore (torch_save/DCP)": "ckptio (torch_save/DCP)",
    "ckptio restore (safetensors), no prefetch": "ckptio (safetensors)",
    "torch.load": "torch.save",
    "safetensors.load_file": "safetensors.save_file",
    "AutoModel load (safetensors)": "AutoModel (safetensors)",
    "AutoModel load (torch_save)": "AutoModel (torch_save)",
}
"""Each loader's saver; the folders of the other savers are deleted as soon as they are timed."""


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
        self.model_bytes = sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k.startswith("model."))
        self.copy_targets: dict[str, torch.Tensor] = {}  # the async phase's, allocated there (memory)
        self.read_buffer: torch.Tensor | None = None  # the raw read's destination, allocated by the load phase
        try:
            import nemo_automodel  # noqa: F401

            self.automodel = True
        except ImportError:
            self.automodel = False
        self.samples: dict[str, dict[str, list]] = {}

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
        d = self.base / f"{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}-{r}"  # one folder per contender
        if self.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        os.sync()  # earlier contenders' deletes and write-back are not charged to this one
        self.sync()
        return d

    def order(self, names: list[str], r: int) -> list[str]:
        shuffled = list(names)
        random.Random(self.args.seed * 1000 + r).shuffle(shuffled)  # the same order on every rank
        return shuffled

    def fresh_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def am(self, root: Path, fmt: str, consolidated: bool):
        """NeMo AutoModel's checkpointer through its public configuration (no hub: an empty cache)."""
        from nemo_automodel.components.checkpoint.config import CheckpointingConfig

        cache = root / "_empty_hf_cache"
        cache.mkdir(parents=True, exist_ok=True)
        cfg = CheckpointingConfig(checkpoint_dir=str(root), model_save_format=fmt, save_consolidated=consolidated,
                                  model_repo_id=None, model_cache_dir=str(cache))
        return cfg.build(dp_rank=self.rank, tp_rank=0, pp_rank=0)

    # -------------------------------------------------------------- contenders
    def savers(self) -> dict[str, Callable[[Path], object]]:
        import safetensors.torch as st
        import torch.distributed.checkpoint as dcp

        from ckptio import CheckpointConfig, CheckpointManager
        from ckptio.storage import fsync_tree

        model, opt, rank = self.model, self.opt, self.rank

        def raw_save(d: Path) -> None:
            # the state's own bytes, straight from the tensors' memory, in 8 MiB writes, one file: the disk's limit
            chunk = 8 << 20
            with open(d / f"raw{rank}.bin", "wb", buffering=0) as fh:
                for t in self.tensors.values():
                    view = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
                    for off in range(0, len(view), chunk):
                        fh.write(view[off:off + chunk])
                os.fsync(fh.fileno())

        def dcp_save(d: Path) -> None:  # torch's state-dict API, as torchtitan uses it
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                     storage_writer=dcp.FileSystemWriter(str(d / "dcp"), sync_files=True), no_dist=self.world == 1)

        def ckptio_save(fmt: str, threads: int | None = None, consolidated: bool = False) -> Callable[[Path], None]:
            def run(d: Path) -> None:  # io_threads=None: the default
                extra = {} if threads is None else {"io_threads": threads}
                cfg = CheckpointConfig(checkpoint_dir=str(d / "ck"), model_save_format=fmt,
                                       save_consolidated=consolidated, **extra)
                with CheckpointManager(cfg, model=model, optimizer=opt, rng=False) as mgr:
                    mgr.save(step=1)
            return run

        def am_save(fmt: str, consolidated: bool) -> Callable[[Path], None]:
            def run(d: Path) -> None:
                ck = self.am(d / "am", fmt, consolidated)
                ck.save_model(model, str(d / "am" / "step"))
                ck.save_optimizer(opt, model, str(d / "am" / "step"))
                ck.async_wait()
                ck.close()
                self.sync()
                if rank == 0:
                    fsync_tree(d / "am")  # AutoModel leaves some files to the page cache: durable, like the others
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
        savers["ckptio (safetensors) + consolidated"] = ckptio_save("safetensors", consolidated=True)
        if self.automodel:
            savers["AutoModel (safetensors)"] = am_save("safetensors", False)
            savers["AutoModel (torch_save)"] = am_save("torch_save", False)
            savers["AutoModel (safetensors) + consolidated"] = am_save("safetensors", True)
        for threads in self.args.io_threads:
            if threads != CheckpointConfig().io_threads:  # the row above runs the default
                savers[f"ckptio (safetensors, io_threads={threads})"] = ckptio_save("safetensors", threads)
                savers[f"ckptio (torch_save/DCP, io_threads={threads})"] = ckptio_save("torch_save", threads)
        return {k: v for k, v in savers.items() if not self.skipped(k)}

    def skipped(self, name: str) -> bool:
        """A contender left out by ``--skip`` (the raw baselines always run)."""
        return bool(self.args.skip) and not name.startswith(("raw ", "memory copy")) and re.search(self.args.skip, name) is not None

    # -------------------------------------------------------------- phases
    def run_saves(self) -> dict[str, Path]:
        savers = self.savers()
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in savers}
        kept: dict[str, Path] = {}
        for r in range(self.args.repeats + 1):
            for name in self.order(list(savers), r):
                d = self.folder(name, r)
                res = self.measure(lambda: savers[name](d))
                if r > 0:
                    results[name].append(res)
                if name in kept and self.rank == 0:
                    shutil.rmtree(kept[name], ignore_errors=True)
                if name in LOADED_FROM.values():
                    kept[name] = d
                elif self.rank == 0:  # nothing loads it: its disk space goes back at once (the large state)
                    shutil.rmtree(d, ignore_errors=True)
            self.say(f"  save round {r}{' (warm-up)' if r == 0 else ''} done")
        self.report("durable save", results, "raw write + fsync")
        return kept

    def run_async(self) -> None:
        from ckptio import CheckpointConfig, CheckpointManager

        self.copy_targets = {k: torch.empty_like(v).fill_(0) for k, v in self.tensors.items()}
        managers = {}
        for fmt in ("safetensors", "torch_save"):
            d = self.folder(f"async-{fmt}", 0)
            cfg = CheckpointConfig(checkpoint_dir=str(d / "ck"), model_save_format=fmt, async_save=True, save_top_k=1)
            managers[fmt] = CheckpointManager(cfg, model=self.model, optimizer=self.opt, rng=False)

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
        step = 0
        for r in range(self.args.repeats + 1):
            for name in self.order(list(contenders), r):
                step += 1
                res = self.measure(lambda: contenders[name](step))
                for mgr in managers.values():
                    mgr.wait()  # the blocked-time rows leave the write running; it must not overlap the next row
                if r > 0:
                    results[name].append(res)
            self.say(f"  async round {r}{' (warm-up)' if r == 0 else ''} done")
        for mgr in managers.values():
            mgr.close()
        self.copy_targets = {}
        self.report("background save: time training is blocked", results, "memory copy of the state")

    def _sync_save(self, fmt: str, step: int) -> None:
        from ckptio import CheckpointConfig, CheckpointManager

        d = self.base / f"sync-{fmt}"
        cfg = CheckpointConfig(checkpoint_dir=str(d), model_save_format=fmt, save_top_k=1)
        with CheckpointManager(cfg, model=self.model, optimizer=self.opt, rng=False) as mgr:
            mgr.save(step=step)

    def loaders(self, kept: dict[str, Path]) -> dict[str, Callable[[], object]]:
        import safetensors.torch as st
        import torch.distributed.checkpoint as dcp

        from ckptio import CheckpointConfig, CheckpointManager

        model, rank = self.model, self.rank

        def read_raw_into(*targets: torch.Tensor) -> None:
            """The raw file, in 8 MiB reads, filling ``targets`` one after the other."""
            with open(kept["raw write + fsync"] / f"raw{rank}.bin", "rb", buffering=0) as fh:
                for target in targets:
                    view = memoryview(target.numpy())
                    done = 0
                    while done < len(view):
                        n = fh.readinto(view[done:done + (8 << 20)])
                        if not n:
                            break
                        done += n

        def raw_read() -> None:
            assert self.read_buffer is not None
            read_raw_into(self.read_buffer)

        def raw_read_new_memory() -> None:
            """The raw read with the optimizer's share landing in newly allocated memory, as it must in a
            restore into a new optimizer: the kernel's cost of first touching pages is in this floor."""
            assert self.read_buffer is not None
            read_raw_into(self.read_buffer[:self.model_bytes],
                          torch.empty(self.nbytes - self.model_bytes, dtype=torch.uint8))

        def dcp_load() -> None:
            opt = self.fresh_optimizer()
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

            sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(kept["DCP FileSystemWriter"] / "dcp")),
                     no_dist=self.world == 1)
            set_optimizer_state_dict(model, opt, sd["optim"])

        def ckptio_load(name: str, fmt: str) -> Callable[[], None]:
            return lambda: CheckpointManager(CheckpointConfig(checkpoint_dir=str(kept[name] / "ck"),
                                                              model_save_format=fmt),
                                             model=model, optimizer=self.fresh_optimizer(), rng=False).restore()

        def no_prefetch(load: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:  # the restore without its prefetch of each rank's own files (CKPTIO_PREFETCH=0)
                before = os.environ.get("CKPTIO_PREFETCH")
                os.environ["CKPTIO_PREFETCH"] = "0"
                try:
                    load()
                finally:
                    os.environ.pop("CKPTIO_PREFETCH") if before is None else os.environ.update(CKPTIO_PREFETCH=before)
            return run

        def am_load(name: str, fmt: str) -> Callable[[], None]:
            def run() -> None:
                ck = self.am(kept[name] / "am", fmt, False)
                step = kept[name] / "am" / "step"
                opt = self.fresh_optimizer()
                ck.load_model(model, str(step / "model"))
                ck.load_optimizer(opt, model, str(step))
                ck.close()
            return run

        out: dict[str, Callable[[], object]] = {
            "raw read": raw_read,
            "raw read, optimizer part into new memory": raw_read_new_memory,
            "DCP load (+ set_optimizer_state_dict)": dcp_load,
            "ckptio restore (safetensors)": ckptio_load("ckptio (safetensors)", "safetensors"),
            "ckptio restore (torch_save/DCP)": ckptio_load("ckptio (torch_save/DCP)", "torch_save"),
            "ckptio restore (safetensors), no prefetch": no_prefetch(ckptio_load("ckptio (safetensors)", "safetensors")),
        }
        if self.world == 1:
            out["torch.load"] = lambda: torch.load(kept["torch.save"] / "ckpt.pt", weights_only=True)
            out["safetensors.load_file"] = lambda: st.load_file(kept["safetensors.save_file"] / "ckpt.safetensors")
        if self.automodel:
            out["AutoModel load (safetensors)"] = am_load("AutoModel (safetensors)", "safetensors")
            out["AutoModel load (torch_save)"] = am_load("AutoModel (torch_save)", "torch_save")
        out = {k: v for k, v in out.items() if not self.skipped(k) and LOADED_FROM.get(k, "raw write + fsync") in kept}
        for name, pattern in (("ckptio (safetensors)", "ck/*/model/*.safetensors"), ("ckptio (torch_save/DCP)", "ck/*/model/*.distcp"),
                              ("AutoModel (safetensors)", "am/step/model/*.safetensors"),
                              ("AutoModel (torch_save)", "am/step/model/*.distcp")):
            if name in kept and not list(kept[name].glob(pattern)):  # each loader reads its own format
                raise AssertionError(f"{kept[name]} holds no {pattern}: the {name} save is not where its loader looks")
        return out

    def run_loads(self, kept: dict[str, Path]) -> None:
        self.read_buffer = torch.ones(self.nbytes, dtype=torch.uint8)  # touched, like the model it fills
        loaders = self.loaders(kept)
        for warm in (False, True):
            results: dict[str, list[tuple[float, int]]] = {k: [] for k in loaders}
            cold = not warm
            for r in range(self.args.repeats + 1):
                for name in self.order(list(loaders), r):
                    self.sync()
                    if warm:
                        loaders[name]()  # the same files, just read: in the page cache
                    elif self.rank == 0:
                        cold = drop_caches() and cold
                    self.sync()
                    res = self.measure(loaders[name])
                    if r > 0:
                        results[name].append(res)
            what = "warm page cache" if warm else ("cold page cache" if cold else "WARM page cache: could not drop it")
            self.report(f"load ({what})", results, "raw read")

    # -------------------------------------------------------------- output
    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def report(self, title: str, results: dict[str, list[tuple[float, int]]], ref: str) -> None:
        ref_t = statistics.median(t for t, _ in results[ref])
        self.samples[title] = {k: v for k, v in results.items()}
        self.say(f"\n{title} ({self.args.repeats} rounds; median, min-max; x = median / median of {ref}; "
                 f"{self.world} rank(s))")
        self.say(f"  {'':<44} {'median':>8} {'min-max':>13} {'GB/s':>6} {'x':>6} {'peak +RSS':>10}")
        for name, runs in results.items():
            times = [t for t, _ in runs]
            med = statistics.median(times)
            rss = max(m for _, m in runs)
            gbs = self.nbytes * self.world / med / 1e9
            self.say(f"  {name:<44} {med:7.3f}s {min(times):6.3f}-{max(times):.3f} {gbs:6.2f} {med / ref_t:6.2f} "
                     f"{rss / 2**20:7.0f} MiB")


def run(args: argparse.Namespace, base: Path) -> None:
    bench = Bench(args, base)
    total = bench.nbytes * bench.world
    bench.say(f"state: {len(bench.tensors)} tensors per rank, {total / 1e9:.2f} GB in all on {bench.world} rank(s)"
              f" (model + AdamW){', AutoModel present' if bench.automodel else ''}; writing under {base}")
    phases = args.phases
    kept = bench.run_saves() if "save" in phases or "load" in phases else {}
    if "async" in phases:
        bench.run_async()
    if "load" in phases:
        bench.run_loads(kept)
    bench.sync()
    if args.json and bench.rank == 0:
        Path(args.json).write_text(json.dumps({"size_bytes": total, "world": bench.world, "automodel": bench.automodel,
                                               "samples": bench.samples}, indent=1))


def rank_main(rank: int, world: int, store: str, fn: Callable[..., None], *fn_args: object) -> None:
    """One spawned rank: a gloo group through ``store``, the environment torchrun gives a rank, then ``fn(*fn_args)``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # what torchrun tells each rank (ckptio's io_threads default counts the ranks on the node)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(*fn_args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
    os._exit(0)  # see tests/distributed.py: a rare abort at interpreter teardown must not fail the run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="300MB", help="approximate bytes of model + optimizer state (all ranks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=1, help="ranks (gloo on CPU, FSDP2-sharded state)")
    p.add_argument("--io-threads", default="1", help="comma-separated io_threads values to compare, e.g. 1,2,4")
    p.add_argument("--phases", default="save,async,load", help="any of save, async, load")
    p.add_argument("--dir", default=None,
                   help="where to write: a new folder inside it, removed at the end (default: inside /var/tmp)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle of contenders")
    p.add_argument("--json", default=None, help="write every sample here (rank 0)")
    p.add_argument("--skip", default="", help="regular expression: leave out the contenders it matches (the raw "
                                              "baselines always run), e.g. 'HF|io_threads' for the large state's disk")
    args = p.parse_args()
    args.io_threads = [int(x) for x in args.io_threads.split(",")]
    args.phases = set(args.phases.split(","))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    # a folder of its own, inside --dir: only that is removed at the end, never --dir itself (/var/tmp)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="ckptio-bench-", dir=args.dir or "/var/tmp"))
    try:
        if args.world == 1:
            torch.set_num_threads(1)
            run(args, base)
        else:
            import torch.multiprocessing as mp

            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(rank_main, args=(args.world, os.path.join(tmp, "store"), run, args, base),
                                   nprocs=args.world, start_method="spawn")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
