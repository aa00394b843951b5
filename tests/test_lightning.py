"""Lightning ``.ckpt`` both ways, proven with the real ``pytorch_lightning``.

Export: a ckptio checkpoint restored into live objects and written as ``.ckpt`` is resumed by
``Trainer.fit(ckpt_path=…)`` at the next global step, with the exact weights, optimizer and scheduler.
Import: a checkpoint written by Lightning's ``ModelCheckpoint`` loads into a model/optimizer/scheduler
bit for bit, and the fine-tuning recipe continues from one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pytorch_lightning as pl  # noqa: E402  (a test dependency: the real client proves compatibility)

from ckptio import CheckpointConfig, CheckpointError, CheckpointManager  # noqa: E402
from ckptio.formats.lightning import load_lightning, read_lightning, save_lightning  # noqa: E402
from cli_here import ckptio_here  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-2


def _lambda(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _batches(n: int = 12, vocab: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, vocab, (2, 16), generator=g) for _ in range(n)]


def _loader():
    from torch.utils.data import DataLoader

    return DataLoader(_batches(), batch_size=None)  # each item is already a batch


class LitLlama(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.at_start: dict = {}

    def training_step(self, batch, idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, _lambda),
                                                   "interval": "step"}}

    def on_train_start(self) -> None:  # after Lightning restored the checkpoint, before the next step
        opt = self.trainer.optimizers[0]
        self.at_start = {
            "global_step": self.trainer.global_step,
            "weights": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt.state.values())},
            "sched_epoch": self.trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        }


def _trainer(max_steps: int, **kw) -> "pl.Trainer":
    # Lightning's own checkpointing stays off unless a test passes its ModelCheckpoint: by default it
    # would write into the working directory
    kw.setdefault("enable_checkpointing", bool(kw.get("callbacks")))
    return pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1, **kw)


def _train_ours(model, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    for batch in _batches()[:steps]:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def test_lightning_resumes_from_our_export(tmp_path):
    from toy import make_model

    model = make_model(seed=0)
    opt, sched = _train_ours(model, 5)
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model, optimizer=opt,
                           lr_scheduler=sched, rng=False) as mgr:
        mgr.save(step=5)
    # a fresh process's view: restore the ckptio checkpoint into new objects, then export
    model2 = make_model(seed=1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=LR, weight_decay=0.01)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, _lambda)
    info = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model2, optimizer=opt2,
                             lr_scheduler=sched2, rng=False).restore()
    export = save_lightning(tmp_path / "export.ckpt", model2, opt2, sched2, step=info.step, epoch=info.epoch)

    lit = LitLlama(make_model(seed=2))
    trainer = _trainer(8)
    trainer.fit(lit, _loader(), ckpt_path=str(export))
    start = lit.at_start
    assert start["global_step"] == 5 and trainer.global_step == 8
    assert start["sched_epoch"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(start["weights"][k], v), k
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            assert torch.equal(start["optim"][i][k], v), f"optimizer state {i}.{k}"


def _lightning_run(root: Path, steps: int, model) -> LitLlama:
    from pytorch_lightning.callbacks import ModelCheckpoint

    lit = LitLlama(model)
    cb = ModelCheckpoint(dirpath=str(root), every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _trainer(steps, callbacks=[cb]).fit(lit, _loader())
    return lit


def test_a_checkpoint_written_by_lightning_loads_exactly(tmp_path):
    from toy import make_model

    lit = _lightning_run(tmp_path, 6, make_model(seed=3))
    ckpt = tmp_path / "step=6.ckpt"
    model = make_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
    pos = load_lightning(ckpt, model, opt, sched)
    assert (pos.step, pos.epoch, pos.batches_in_epoch) == (6, 0, 6)
    for k, v in lit.model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    theirs = lit.trainer.optimizers[0]
    for (p, st), (q, st2) in zip(theirs.state.items(), opt.state.items()):
        for k in st:
            assert torch.equal(st[k], st2[k]), k
    assert sched.last_epoch == 6
    # the wrong model is refused, naming the file
    with pytest.raises(CheckpointError, match="step=6.ckpt"):
        load_lightning(ckpt, make_model(hidden_size=48, intermediate_size=64))


def test_hostile_or_broken_ckpt_is_refused(tmp_path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94.")
    with pytest.raises(CheckpointError, match="bad.ckpt"):
        read_lightning(bad)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="no state_dict"):
        read_lightning(tmp_path / "other.ckpt")


@pytest.mark.slow
def test_recipe_continues_from_a_lightning_checkpoint(tmp_path):
    """Lightning trains the recipe's model 4 steps; the recipe picks up at step 5 with its optimizer state."""
    sys.path.insert(0, str(ROOT / "examples" / "llm"))
    from recipe_config import load_config
    from transformers import LlamaConfig, LlamaForCausalLM

    args = ["--config", str(ROOT / "examples/llm/tiny_llama.yaml"), "--checkpoint.checkpoint_dir", str(tmp_path / "ck"),
            "--step_scheduler.max_steps", "8", "--step_scheduler.ckpt_every_steps", "100",
            "--step_scheduler.val_every_steps", "100", "--data.num_sentences", "300",
            "--checkpoint.save_consolidated", "false", "--log_file", str(tmp_path / "log.jsonl")]
    m = load_config(args).model
    config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
                         tie_word_embeddings=m.tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    lit = _lightning_run(tmp_path / "pl", 4, LlamaForCausalLM(config))
    ckpt = tmp_path / "pl" / "step=3.ckpt"
    out = subprocess.run([sys.executable, str(ROOT / "examples/llm/finetune.py"), *args,
                          "--init_from_lightning", str(ckpt), "--export_lightning", str(tmp_path / "final.ckpt")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Initialised from Lightning checkpoint" in out.stdout and "step 3, epoch 0" in out.stdout
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6, 7, 8], steps
    # the recipe's optimizer carried Lightning's state on: AdamW's step counter reached 8 (3 + 5)
    final = read_lightning(tmp_path / "final.ckpt")
    assert final["global_step"] == 8
    counts = {float(st["step"]) for st in final["optimizer_states"][0]["state"].values()}
    assert counts == {8.0}
    assert final["lr_schedulers"][0]["last_epoch"] == 8
    del lit


def test_ckptio_convert_turns_a_whole_training_checkpoint_into_one_lightning_resumes(tmp_path):
    """``ckptio convert STEP_DIR x.ckpt --to lightning`` carries weights, optimizer and scheduler, no code needed."""
    from toy import Run, make_model

    run = Run(tmp_path / "ck", max_steps=5)  # AdamW(lr=1e-2, wd=0.01) + LambdaLR(min(1, (s+1)/4)), as LitLlama
    run.train(save_at=(5,), stop_at=5)
    run.mgr.close()
    out = ckptio_here("convert", tmp_path / "ck" / "epoch_0_step_5", tmp_path / "x.ckpt", "--to", "lightning",
                      "--no-progress")
    assert out.returncode == 0, out.stderr
    lit = LitLlama(make_model(seed=2))
    trainer = _trainer(7)
    trainer.fit(lit, _loader(), ckpt_path=str(tmp_path / "x.ckpt"))
    start = lit.at_start
    assert start["global_step"] == 5 and trainer.global_step == 7 and start["sched_epoch"] == 5
    for k, v in run.model.state_dict().items():
        assert torch.equal(start["weights"][k], v), k
    for i, st in enumerate(run.opt.state.values()):
        for k, v in st.items():
            assert torch.equal(start["optim"][i][k], v), f"optimizer state {i}.{k}"


class _Warmup:
    def factor(self, step: int) -> float:
        return _lambda(step)


def test_convert_keeps_a_bound_method_lambda_scheduler_for_lightning(tmp_path):
    """LambdaLR over a bound method stores ``lr_lambdas: [{}]``; that entry must survive to the .ckpt."""
    from toy import make_model

    model = make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _Warmup().factor)
    for batch in _batches()[:4]:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    with CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path / "ck")), model=model, optimizer=opt,
                           lr_scheduler=sched, rng=False) as mgr:
        mgr.save(step=4)
    out = ckptio_here("convert", tmp_path / "ck" / "epoch_0_step_4", tmp_path / "x.ckpt", "--to", "lightning",
                      "--no-progress")
    assert out.returncode == 0, out.stderr
    assert read_lightning(tmp_path / "x.ckpt")["lr_schedulers"][0] == sched.state_dict()
    lit = LitLlama(make_model(seed=2))
    trainer = _trainer(6)
    trainer.fit(lit, _loader(), ckpt_path=str(tmp_path / "x.ckpt"))
    assert lit.at_start["global_step"] == 4 and lit.at_start["sched_epoch"] == 4 and trainer.global_step == 6
