"""Every ``python`` block of the README and docs/ runs as it stands on the page (issue 52).

A block on a page assumes names a user's script already has (``model``, ``opt``, a trained Lightning run, a
checkpoint folder). For each block, :data:`RUNS` gives a *prelude* that makes exactly those (and nothing the block
defines itself) and a *check* that the block did what the page says. The block itself is pasted between them
unchanged, and the script runs in a process of its own in an empty folder: forked from the tests' preloaded server as
``python`` or ``torchrun`` would run it (``distributed.launch``), or in the NeMo AutoModel environment of
``tests/test_automodel.py``. A new block on a page fails
:func:`test_every_python_block_of_the_docs_is_run` until it has an entry here.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from distributed import launch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def blocks() -> dict[str, str]:
    """Every ``python`` block of README.md and docs/*.md, keyed ``"page: first line"``."""
    out = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in re.findall(r"```python\n(.*?)\n```", page.read_text(), re.S):
            out[f"{page.relative_to(ROOT)}: {code.splitlines()[0]}"] = code
    return out


@dataclass(frozen=True)
class Run:
    prelude: str = ""
    check: str = ""
    python: str = "here"  # "here", "automodel" (tests/test_automodel.py's environment) or "torchrun" (2 ranks)
    elsewhere: str = ""   # run by another test, named here


_MEGATRON_RUN = """
import shutil, subprocess, sys
subprocess.run([sys.executable, sys.path[0] + "/megatron_fixture.py", "--out", "made"], check=True, capture_output=True)
shutil.copytree("made/torch_dist", "megatron-run")  # megatron-core's torch_dist run: iteration 2, one Adam step
"""
_MEGATRON_RESTORED = """
assert info.step == 2 and info.counters["optimizer_restored"] is True
assert all(float(optimizer.state[p]["step"]) == 1.0 and optimizer.state[p]["exp_avg"].abs().sum() > 0
           for p in model.parameters())
"""


def blocks_of(page: str) -> list[str]:
    """The ``python`` blocks of one page, in order."""
    return re.findall(r"```python\n(.*?)\n```", (ROOT / page).read_text(), re.S)


_TINY = """
import torch
from toy import Counter
torch.manual_seed(0)
x = torch.randn(64, 4)
dataset = torch.utils.data.TensorDataset(x)
model = torch.nn.Linear(4, 1)
opt = optimizer = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
counter = Counter()
val_loss = 0.5
"""

_AUTOMODEL = """
import argparse, torch
from automodel_harness import _automodel_recipe, _gathered, _objects
from ckptio import CheckpointConfig, CheckpointManager

def objects(seed):
    torch.manual_seed(seed)
    args = argparse.Namespace(by="automodel", dir="checkpoints/", format="safetensors", peft=False, ckpt_every=4,
                              steps=1000)
    return args, _objects(args, 0, 1)

args, o = objects(0)
for batch in next(iter(o["step_scheduler"])):  # one step: the optimizer has state
    o["model"](input_ids=batch, labels=batch).loss.backward()
o["optimizer"].step()
o["lr_scheduler"].step()
o["step_scheduler"].step, o["step_scheduler"].epoch = 99, 0
WRITER
saved = _gathered(o)
args, o = objects(1)  # a new process's objects: other weights, no optimizer state
rank = 0
model, opt = o["model"], o["optimizer"]
optimizer, sched, scheduler = opt, o["lr_scheduler"], o["lr_scheduler"]
loader = dataloader = o["dataloader"]
steps = step_scheduler = o["step_scheduler"]
checkpointer = _automodel_recipe(args, o, 0).checkpointer
"""

_BY_CKPTIO = """CheckpointManager(CheckpointConfig(checkpoint_dir="checkpoints/"), model=o["model"],
                  optimizer=o["optimizer"], lr_scheduler=o["lr_scheduler"], dataloader=o["dataloader"],
                  step_scheduler=o["step_scheduler"]).save(step=99, epoch=0)"""

_SAME_AS_SAVED = """
got = _gathered(o)
for k, v in saved["model"].items():
    assert torch.equal(got["model"][k], v), k
for p, state in saved["optim"].items():
    for name, v in state.items():
        assert torch.equal(got["optim"][p][name], v) if isinstance(v, torch.Tensor) else got["optim"][p][name] == v
assert got["sched"] == saved["sched"]
"""

_STEP = "assert steps.step == 100, steps.step  # AutoModel's StepScheduler records the step after the one done\n"

_FOLDER = """
import torch
from toy import make_model, make_tokenizer
from ckptio import CheckpointConfig, CheckpointManager
trained = make_model(seed=3)
CheckpointManager(CheckpointConfig(checkpoint_dir="checkpoints", save_consolidated=True), model=trained,
                  tokenizer=make_tokenizer()).save(step=20, epoch=0)
"""

_HF_FOLDER = """
import torch
from toy import make_model
trained = make_model(seed=3)
trained.save_pretrained("hf")
path = "hf"
"""

_S3 = """
import atexit, os, torch
import s3server
proc, url = s3server.start()
atexit.register(proc.terminate)
os.environ.update(AWS_ENDPOINT_URL=url, **s3server.ENV)
from ckptio.storage.s3 import client
client().create_bucket(Bucket="bucket")
os.makedirs("mem", mode=0o700)
os.environ["CKPTIO_MEMORY_DIR"] = os.path.abspath("mem")
from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader, StepScheduler
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
loader = ResumableDataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
steps = StepScheduler(max_steps=30)
"""

_TINY_LOOP = """
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters())
def train_step():
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""
"""A linear model and one training step, for the object-store pages' loops."""

_GCS = """
import atexit, os, torch
import gcsserver
proc, url = gcsserver.start()
atexit.register(proc.terminate)
os.environ["STORAGE_EMULATOR_HOST"] = url
from ckptio.storage.gcs import client
client().create_bucket("bucket")
""" + _TINY_LOOP

_AZURE = """
import atexit, os, torch
import azuriteserver
proc, url = azuriteserver.start()
atexit.register(proc.terminate)
os.environ["AZURE_STORAGE_CONNECTION_STRING"] = azuriteserver.connection_string(url)
from ckptio.storage.azure import client
client().create_container("container")
""" + _TINY_LOOP

_LIGHTNING = """
import pytorch_lightning as pl, torch
from lit_tiny import Evaluated as LitModel, TinyData as MyDataModule
from ckptio.lightning import CkptioCheckpointIO
torch.manual_seed(0)
trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1, plugins=[CkptioCheckpointIO()],
                     callbacks=[pl.callbacks.ModelCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=1,
                                                             save_last=True)])
fitted = LitModel()
trainer.fit(fitted, datamodule=MyDataModule())
path = trainer.checkpoint_callback.best_model_path
"""

_LIGHTNING_FILE = """
import pytorch_lightning as pl, torch
from lit_tiny import Tiny, loader
from ckptio import CheckpointConfig, CheckpointManager, StepScheduler
torch.manual_seed(0)
lit = Tiny()
tr = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                devices=1, callbacks=[pl.callbacks.ModelCheckpoint(dirpath=".", save_last=True)])
tr.fit(lit, loader())
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
steps = StepScheduler(max_steps=100)
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir="ckpt"), model=model, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, step_scheduler=steps)
"""

_DCP_OBJECTS = """
import torch
from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader, StepScheduler
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
sched = torch.optim.lr_scheduler.StepLR(optimizer, 10)
loader = ResumableDataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
steps = StepScheduler(max_steps=10)
step, latest_dir = 1, "ckpt/step_1"
"""

_HF = """
from pathlib import Path
import torch
from hf_tiny import Tokens, arguments, model as tiny_model
from transformers import Trainer, TrainingArguments
from ckptio.hf_trainer import CkptioTrainer
model, train, val = tiny_model(), Tokens(16), Tokens(8, seed=4)
"""

RUNS: dict[str, Run] = {
    "README.md: from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader, StepScheduler": Run(
        _TINY, """
mgr.close()
from ckptio import committed_checkpoints
assert [e.step for e in committed_checkpoints("checkpoints")] == list(range(100, 1001, 100))
"""),
    "README.md: # AutoModel -> ckptio: keep the run's checkpoint_dir": Run(
        _AUTOMODEL.replace("WRITER", _BY_CKPTIO), _SAME_AS_SAVED + _STEP, python="automodel"),
    "docs/migrate-automodel.md: from ckptio import CheckpointConfig, CheckpointManager": Run(
        _AUTOMODEL.replace("WRITER", """_automodel_recipe(args, o, 0).save_checkpoint(0, 99, torch.tensor(0.0))
assert __import__("os").path.isdir("checkpoints/epoch_0_step_99")"""),
        _SAME_AS_SAVED + _STEP,
        python="automodel"),
    "docs/migrate-automodel.md: from nemo_automodel": Run(
        _AUTOMODEL.replace("WRITER", _BY_CKPTIO), _SAME_AS_SAVED, python="automodel"),
    "docs/migrate-megatron.md: import torch": Run(_MEGATRON_RUN, _MEGATRON_RESTORED),
    "docs/migrate-megatron.md: from ckptio import megatron_schedule": Run(
        _MEGATRON_RUN + blocks_of("docs/migrate-megatron.md")[0], """
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
ref = OptimizerParamScheduler(torch.optim.AdamW(model.parameters()), init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                              lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="cosine", start_wd=0.0,
                              end_wd=0.0, wd_incr_steps=100, wd_incr_style="constant")
ref.step(2)  # the fixture's opt_param_scheduler: cosine, num_steps = iteration 2 x global batch size 1
for _ in range(5):
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in ref.optimizer.param_groups]
    optimizer.step(); scheduler.step(); ref.step(1)
mgr.save(step=7)
assert scheduler.num_steps == 7
"""),
    "docs/migrate-megatron.md: from ckptio import committed_checkpoints": Run(
        _MEGATRON_RUN + blocks_of("docs/migrate-megatron.md")[0], """
import math, subprocess, sys
subprocess.run([sys.executable, sys.path[0] + "/megatron_fixture.py", "--tp", "2", "--train",
                "back-to-megatron/iter_0000002", "--out", "trained.pt"], check=True, capture_output=True)
trained = torch.load("trained.pt")  # megatron-core's optimizer loaded it strictly and took a step
assert trained["iteration"] == 2 and math.isfinite(trained["loss"])
assert all(p["before"]["step"] == 1.0 and p["after"]["step"] == 2.0 for p in trained["params"].values())
"""),
    "docs/converters.md: from ckptio.convert import Converter, Rule, register": Run("", """
import torch
from ckptio.convert import check_invertible, get_converter
sd = {"embed.weight": torch.randn(32, 8), "head.weight": torch.randn(32, 8)}
for i in range(2):
    sd.update({f"blocks.{i}.attn.{n}.weight": torch.randn(8, 8) for n in "qkvo"})
    sd.update({f"blocks.{i}.mlp.gate.weight": torch.randn(16, 8), f"blocks.{i}.mlp.up.weight": torch.randn(16, 8),
               f"blocks.{i}.mlp.down.weight": torch.randn(8, 16)})
check_invertible(get_converter("tinylm-to-megatron"), sd, {"num_attention_heads": 2, "hidden_size": 8})
check_invertible(get_converter("megatron-to-tinylm").inverse(), sd, {"num_attention_heads": 2, "hidden_size": 8})
"""),
    "docs/converters.md: from ckptio.convert import check_invertible, get_converter": Run(
        "from toy import make_model\nmodel = make_model()\n"),
    "docs/formats.md: from transformers import AutoModelForCausalLM, pipeline": Run(_FOLDER, """
for k, v in trained.state_dict().items():
    assert torch.equal(model.state_dict()[k], v), k
assert isinstance(pipe("a b", max_new_tokens=2)[0]["generated_text"], str)
"""),
    "docs/formats.md: from ckptio import load_pretrained": Run("""
import os, torch, torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)
""" + _HF_FOLDER, """
for k, v in trained.state_dict().items():
    assert torch.equal(model.state_dict()[k].full_tensor(), v), k
dist.destroy_process_group()
"""),
    "docs/formats.md: config = AutoConfig.from_pretrained(path)": Run("""
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from ckptio import load_pretrained
from test_fp8_release import QUANTIZED, SIZES, expected, quantize, write_release
from toy import llama_config
torch.manual_seed(7)
made = AutoModelForCausalLM.from_config(llama_config(**SIZES))
made.config.dtype = torch.bfloat16
made.config.save_pretrained("plain")
import json
stored, want = {}, {}
for key, value in made.state_dict().items():
    if key.endswith(".weight") and key.split(".")[-2] in QUANTIZED:
        q, scale = quantize(value.float())
        stored[key], stored[key + "_scale_inv"] = q, scale
        want[key] = expected(q, scale)
    else:
        stored[key] = value.to(torch.bfloat16)
        want[key] = stored[key].float()
path = str(write_release(__import__("pathlib").Path("release"), stored, json.load(open("plain/config.json"))))
""", """
got = model.state_dict()
for k, v in want.items():
    assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
"""),
    "docs/formats.md: from peft import AutoPeftModelForCausalLM": Run("""
import torch
from toy import Run
run = Run("checkpoints", max_steps=20, peft=True, base_dir="base")
run.train(save_at=(20,))
run.mgr.close()
""", """
mine = {k: v for k, v in run.model.state_dict().items() if "lora_" in k}
got = model.state_dict()
assert mine and all(torch.equal(got[k], v) for k, v in mine.items())
"""),
    "docs/formats.md: from ckptio import save_nemo, restore_nemo": Run("""
import torch
from toy import make_model, make_tokenizer
model, tok = make_model(seed=5), make_tokenizer()
open("notes.txt", "w").write("trained on tiny data")
""", """
assert nm.artifacts["notes.txt"] and all(torch.equal(nm.model.state_dict()[k], v)
                                         for k, v in model.state_dict().items())
"""),
    "docs/getting-started.md: import torch": Run(
        elsewhere="tests/test_docs.py::test_the_first_checkpoint_page_runs_as_it_stands_and_resumes_exactly"),
    "docs/memory-tier.md: mgr = CheckpointManager(": Run(_S3, """
from ckptio import committed_checkpoints
assert [e.step for e in committed_checkpoints("s3://bucket/run1")] == [30]
assert not os.listdir("mem"), "a clean end frees the snapshots"
"""),
    "docs/object-storage.md: from ckptio import CheckpointConfig, CheckpointManager": Run(_GCS, """
from ckptio import committed_checkpoints
assert [e.step for e in committed_checkpoints("gs://bucket/run1")] == [20, 30]
assert start is None
"""),
    "docs/object-storage.md: # credentials: AZURE_STORAGE_CONNECTION_STRING": Run(_AZURE, """
from ckptio import committed_checkpoints
assert [e.step for e in committed_checkpoints("az://container/run1")] == [20, 30]
assert start is None
"""),
    "docs/object-storage.md: # the account named in the location": Run(_AZURE + """
import azuriteserver
del os.environ["AZURE_STORAGE_CONNECTION_STRING"]
os.environ.update(AZURE_STORAGE_ACCOUNT_URL=url, AZURE_STORAGE_ACCOUNT_KEY=azuriteserver.KEY)
account = azuriteserver.ACCOUNT
""", """
from ckptio import committed_checkpoints
assert [e.step for e in committed_checkpoints(url)] == [1]
"""),
    "docs/goodput.md: mgr = CheckpointManager(CheckpointConfig(": Run("""
import os, subprocess, sys, torch
from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader
OBJECTS = '''
import torch
from ckptio import CheckpointConfig, CheckpointManager, ResumableDataLoader
torch.manual_seed(0)
loader = ResumableDataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4, seed=1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 3)
'''
FIRST = OBJECTS + '''
import os, signal
mgr = CheckpointManager(CheckpointConfig(checkpoint_dir="checkpoints", persist_every_steps=5),
                        model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader)
for step, (x,) in enumerate(loader, 1):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    mgr.maybe_save(step=step, metrics={"loss": loss.item(), "lr": sched.get_last_lr()[0]})
    if step == 8:
        mgr.wait()  # the record's thread wrote the values (a kill within its few ms would lose this window's)
        os.kill(os.getpid(), signal.SIGKILL)  # the node is lost three steps after the save of step 5
'''
killed = subprocess.run([sys.executable, "-c", FIRST], capture_output=True, text=True)
assert killed.returncode == -9, killed.stderr[-2000:]
exec(OBJECTS)  # the new process's objects, as the script makes them
""", """
from ckptio.goodput.record import RECORD_NAME, parse
events = parse(open(os.path.join("checkpoints", RECORD_NAME), "rb").read(), "record")
audits = [e for e in events if e["kind"] == "audit"]
assert [(a["step"], a["verdict"], a["checked"]) for a in audits] == [(5, "exact", 3)], audits
"""),
    "docs/goodput.md: cfg = CheckpointConfig(": Run("""
import torch
from ckptio import CheckpointConfig, CheckpointManager
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
max_steps = 12
def train_step():
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
""", """
planner = mgr._goodput.planners["durable"]
assert planner.every is not None and "one failure per 6 h (given)" in planner.reason, planner.reason
"""),
    "docs/preemption.md: mgr = CheckpointManager(": Run("""
import os, signal, torch
from ckptio import CheckpointConfig, CheckpointManager
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
def train_step(step):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 4:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler takes the node back during step 4
""", """
from ckptio import committed_checkpoints
assert mgr.preempted == signal.SIGTERM and step == 4, (mgr.preempted, step)
assert [e.step for e in committed_checkpoints("checkpoints")] == [4]
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "close() gave SIGTERM its handler back"
"""),
    "docs/preemption.md: from ckptio.lightning import CkptioCheckpointIO, CkptioPreemption": Run("""
import atexit, os, signal, traceback
import pytorch_lightning as pl, torch
from pytorch_lightning.callbacks import ModelCheckpoint
from lit_tiny import Tiny, loader
torch.manual_seed(0)
class Preempted(Tiny):
    def training_step(self, batch, idx):
        if self.global_step == 4:  # the scheduler takes the node back during step 5
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, idx)
model, train_loader = Preempted(), loader()
def _after_exit():  # "exit": the check runs as the process ends
    try:
        from ckptio.lightning import last_checkpoint, read_checkpoint
        assert read_checkpoint(last_checkpoint("ckpts"))["global_step"] == 5
        print("the block ran")  # what the harness looks for after the check
    except BaseException:
        traceback.print_exc()
        os._exit(1)
atexit.register(_after_exit)
""", """
raise AssertionError("fit went on after SIGTERM")
"""),
    "docs/preemption.md: trainer = CkptioTrainer(": Run(_HF + """
import os, signal
args = arguments(Path("out"), max_steps=8)
calls = []
def preempt(module, inputs):
    calls.append(1)
    if len(calls) == 3:  # the scheduler takes the node back during step 3
        os.kill(os.getpid(), signal.SIGTERM)
model.register_forward_pre_hook(preempt)
""", """
from ckptio.hf_trainer import last_checkpoint
assert trainer.ckptio_preemption.preempted == signal.SIGTERM and trainer.state.global_step == 3
assert last_checkpoint("out").name == "checkpoint-3"
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "train() gave SIGTERM its handler back"
"""),
    "docs/preemption.md: accelerator = CkptioAccelerator(": Run("""
import os, signal, torch
from accelerate.utils import ProjectConfiguration
from ckptio.accelerate import CkptioAccelerator
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=4)
def train_step(batch):
    model(batch).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 3:  # the scheduler takes the node back during step 3
        os.kill(os.getpid(), signal.SIGTERM)
""", """
from ckptio.accelerate import usable_checkpoints
assert accelerator.ckptio_preempted == signal.SIGTERM and step == 3
assert [p.name for p in usable_checkpoints("run/checkpoints")[0]] == ["checkpoint_0"]
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "end_training() gave SIGTERM its handler back"
"""),
    "docs/retention.md: cfg = CheckpointConfig(": Run("""
import torch
from ckptio import CheckpointConfig, CheckpointManager
""", """
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters())
with CheckpointManager(cfg, model=model, optimizer=opt) as mgr:
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 4.0)):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mgr.save(step=step, metrics={"val_loss": loss})
from ckptio import committed_checkpoints
kept = {e.step: e.manifest for e in committed_checkpoints("ckpt")}
assert sorted(kept) == [1, 2, 3, 4] and [s for s, m in kept.items() if "optim" in m.states] == [4]
assert all("optim" in m.pruned for s, m in kept.items() if s != 4)
"""),
    "docs/memory-tier.md: store = dist.TCPStore(": Run("import os, torch, torch.distributed as dist\n", """
flag = torch.ones(1)
dist.all_reduce(flag)
assert flag.item() == 2
dist.destroy_process_group()
""", python="torchrun"),
    "docs/migrate-accelerate.md: import torch": Run(
        elsewhere="tests/test_docs.py::test_the_accelerate_page_loop_resumes_where_a_straight_run_ends"),
    "docs/migrate-accelerate.md: accelerator = CkptioAccelerator(": Run("""
import torch
from accelerate.utils import ProjectConfiguration
from ckptio.accelerate import CkptioAccelerator
""", """
import os
assert accelerator.project_configuration.project_dir == "run"
model = accelerator.prepare(torch.nn.Linear(4, 1))
accelerator.save_state()
accelerator.end_training()
assert os.listdir("run/checkpoints"), "a background save was committed"
"""),
    "docs/migrate-dcp.md: import torch.distributed.checkpoint as dcp": Run(_DCP_OBJECTS, """
assert torch.equal(state["model"]["weight"], model.weight) and state["optim"]["state"]
"""),
    "docs/migrate-dcp.md: mgr = CheckpointManager(": Run(_DCP_OBJECTS, """
mgr.close()
from ckptio import committed_checkpoints
assert len(committed_checkpoints("ckpt")) == 1
"""),
    "docs/migrate-hf-trainer.md: trainer = CkptioTrainer(": Run(
        _HF + "args = arguments(Path('out'), max_steps=4)\n", """
trainer.train()
assert (Path("out") / "checkpoint-4").is_dir()
"""),
    "docs/migrate-hf-trainer.md: args = TrainingArguments(": Run(_HF + """
Trainer(model=tiny_model(), args=arguments(Path("out"), max_steps=2, save_steps=2), train_dataset=train).train()
""", """
assert trainer.state.global_step == 6, trainer.state.global_step   # resumed at 2; 3 epochs of 2 steps
"""),
    "docs/migrate-lightning.md: from ckptio.lightning import install_loader": Run(_LIGHTNING, """
for k, v in LitModel.load_from_checkpoint(path).state_dict().items():
    assert torch.equal(model.state_dict()[k], v), k
assert data.hparams == MyDataModule().hparams
"""),
    "docs/migrate-lightning.md: from ckptio.formats.lightning import load_lightning": Run(_LIGHTNING_FILE, """
mgr.close()
from ckptio import committed_checkpoints
assert pos.step == tr.global_step and [e.step for e in committed_checkpoints("ckpt")] == [pos.step]
for (k, v), w in zip(model.state_dict().items(), lit.net.state_dict().values()):
    assert torch.equal(v, w), k
"""),
}


def _matching() -> dict[str, list[str]]:
    """For each key of :data:`RUNS` (a page and the start of a block's first line), the blocks it names."""
    found = blocks()
    return {key: [b for b in found if b.startswith(key)] for key in RUNS}


def test_every_python_block_of_the_docs_is_run():
    matching = _matching()
    named = {b for blocks_ in matching.values() for b in blocks_}
    missing = sorted(set(blocks()) - named)
    assert not missing, f"python blocks no test runs (add them to RUNS): {missing}"
    wrong = {key: found for key, found in matching.items() if len(found) != 1}
    assert not wrong, f"each key of RUNS must name one block of a page: {wrong}"


def _script(key: str) -> str:
    run = RUNS[key]
    (block,) = _matching()[key]
    return "\n".join([f"import sys\nsys.path.insert(0, {str(TESTS)!r})", run.prelude,
                      "# --- the page's block, as it stands", blocks()[block], "# --- what the page says it does",
                      run.check, "print('the block ran')"])




@pytest.mark.slow
@pytest.mark.parametrize("key", [k for k, r in RUNS.items() if not r.elsewhere])
def test_the_block_runs_as_it_stands(key, tmp_path):
    if "azuriteserver" in RUNS[key].prelude:
        import azuriteserver

        if azuriteserver.missing_tools():
            pytest.skip(azuriteserver.missing_tools())
    script = tmp_path / "snippet.py"
    script.write_text(_script(key))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(TESTS)])}
    if RUNS[key].python == "automodel":
        from test_automodel import _environment

        done = subprocess.run([str(_environment()), str(script)], cwd=work, capture_output=True, text=True,
                              timeout=900, env=env)
    else:
        done = launch(str(script), ranks=2 if RUNS[key].python == "torchrun" else 1, timeout=900, cwd=str(work),
                      env=env)
    assert done.returncode == 0 and "the block ran" in done.stdout, \
        f"{key}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
