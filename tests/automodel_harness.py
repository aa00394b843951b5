"""One training run of a tiny Llama, checkpointed by NeMo AutoModel 0.7's recipe machinery or by ckptio.

Run inside the AutoModel test environment (``tests/test_automodel.py`` builds it), with ckptio's sources on
``PYTHONPATH``; one process, or ``torchrun`` (gloo, FSDP2 over every rank)::

    python automodel_harness.py --by automodel|ckptio --dir CKPT_DIR --steps N --ckpt-every K \\
        [--format safetensors|torch_save] [--stop-after S] --out RESULT.pt

Both sides drive the same objects through the same loop: AutoModel's ``StepScheduler``, torchdata's
``StatefulDataLoader`` over a ``DistributedSampler`` (per-rank position), AutoModel's ``StatefulRNG`` and
attention dropout (so the RNG streams matter), AdamW and a ``StepLR`` scheduler. With ``--by automodel`` the
checkpoints are saved and auto-resumed by a ``BaseRecipe`` subclass (``save_checkpoint`` /
``load_checkpoint``, AutoModel's own code); with ``--by ckptio`` by a ``CheckpointManager`` with default
settings. Either resumes from whatever ``--dir`` holds, written by either. ``--stop-after S`` ends the run
after step S (a preemption); ``--out`` gets every step's loss and, at the end, the full model and optimizer
state (gathered) for bitwise comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 128, 16, 2


LORA = {"targets": ["q_proj", "v_proj"], "rank": 4, "alpha": 8}


def _model(world: int, peft: str | None) -> torch.nn.Module:
    """The tiny Llama; with ``peft``, LoRA on q/v by that implementation (``automodel``: AutoModel's own
    LinearLoRA, ``peft``: Hugging Face peft), the base frozen. FSDP2 over every rank when there are several."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)  # the same initial weights on every rank and in every run
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                                         max_position_embeddings=SEQ))
    if peft == "automodel":
        from nemo_automodel.components._peft.lora import apply_lora_to_linear_modules

        apply_lora_to_linear_modules(model, _automodel_lora())
    elif peft == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                 target_modules=LORA["targets"], task_type="CAUSAL_LM"))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.base_model.model if peft == "peft" else model).model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _automodel_lora() -> object:
    from nemo_automodel.components._peft.lora import PeftConfig

    return PeftConfig(target_modules=[f"*.{t}" for t in LORA["targets"]], dim=LORA["rank"], alpha=LORA["alpha"],
                      use_memory_efficient_lora=False)


def _objects(args: argparse.Namespace, rank: int, world: int) -> dict:
    from nemo_automodel.components.training.rng import StatefulRNG
    from nemo_automodel.components.training.step_scheduler import StepScheduler
    from torchdata.stateful_dataloader import StatefulDataLoader

    rng = StatefulRNG(seed=7, ranked=True)
    data = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    # a generator of its own: a DataLoader draws its base seed when an iterator is made, which on the global RNG
    # would shift every stream of a run resumed mid-epoch (the iterator is then made after the restore)
    loader = StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(11))
    peft = None if not args.peft else "automodel" if args.by == "automodel" else "peft"
    model = _model(world, peft)
    if getattr(args, "freeze", False):  # a frozen fine-tune: the embeddings and the first layer (ckptio shares their files from save to save)
        for p in [*model.model.embed_tokens.parameters(), *model.model.layers[0].parameters()]:
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    steps = StepScheduler(global_batch_size=BATCH * world, local_batch_size=BATCH, dp_size=world, dataloader=loader,
                          ckpt_every_steps=args.ckpt_every, save_checkpoint_every_epoch=False,
                          validate_on_checkpoint=False, max_steps=args.steps, num_epochs=100, preemption_signal=None)
    return {"rng": rng, "dataloader": loader, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler,
            "step_scheduler": steps}


def _automodel_recipe(args: argparse.Namespace, objects: dict, rank: int) -> object:
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes.base_recipe import BaseRecipe

    class Recipe(BaseRecipe):
        pass

    recipe = Recipe()
    for name, value in objects.items():
        setattr(recipe, name, value)
    recipe.config = ConfigNode({"recipe": "ckptio interop harness"})
    recipe.peft_config = _automodel_lora() if args.peft else None
    recipe.checkpointer = CheckpointingConfig(
        enabled=True, checkpoint_dir=args.dir, model_save_format=args.format, save_consolidated=False,
        is_peft=args.peft,
        model_repo_id=None, model_cache_dir=os.path.join(args.dir, ".cache"),
    ).build(dp_rank=rank, tp_rank=0, pp_rank=0)
    return recipe


def _gathered(objects: dict) -> dict:
    """The whole model and optimizer state on every rank (full tensors of FSDP shards), for comparison."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model = get_model_state_dict(objects["model"], options=opts)
    optim = get_optimizer_state_dict(objects["model"], objects["optimizer"], options=opts)
    # one naming for both LoRA implementations: peft's wrappers and adapter name dropped
    plain = lambda k: k.removeprefix("base_model.model.").replace(".default.", ".").replace(".base_layer.", ".")  # noqa: E731,E501
    return {"model": {plain(k): v.clone() for k, v in model.items()},
            "optim": {plain(k): {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                      for k, v in optim["state"].items()},
            "sched": objects["lr_scheduler"].state_dict(), "step": objects["step_scheduler"].step}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--by", choices=("automodel", "ckptio"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--format", default="safetensors")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--keep-latest", type=int, default=None, help="ckptio's retention: keep this many of its own steps")
    p.add_argument("--restore-from", default=None, help="ckptio: restore(PATH) this step directory, not the newest of --dir")
    p.add_argument("--out", required=True)
    p.add_argument("--freeze", action="store_true", help="freeze the embeddings and the first layer before training")
    p.add_argument("--peft", action="store_true", help="LoRA: AutoModel's own with --by automodel, peft's with ckptio")
    p.add_argument("--check-restore", action="store_true",
                   help="restore the newest step of --dir and write the state it gave, without training (with "
                        "--by automodel through Checkpointer.load_model/load_optimizer, which take any rank count)")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    objects = _objects(args, rank, world)
    steps = objects["step_scheduler"]
    if args.check_restore:
        _restore_only(args, objects, rank)
        state = _gathered(objects)  # a collective: every rank
        if rank == 0:
            torch.save(state, args.out)
        return _exit(world)
    if args.by == "automodel":
        recipe = _automodel_recipe(args, objects, rank)
        recipe.load_checkpoint(None)  # AutoModel's auto-resume: the newest step of --dir
        save = lambda: recipe.save_checkpoint(steps.epoch, steps.step, torch.tensor(0.0))  # noqa: E731
    else:
        from ckptio import CheckpointConfig, CheckpointManager, RNGState  # noqa: F401

        mgr = CheckpointManager(CheckpointConfig(checkpoint_dir=args.dir, model_save_format=args.format,
                                                 is_peft=args.peft, keep_latest=args.keep_latest),
                                model=objects["model"], optimizer=objects["optimizer"],
                                lr_scheduler=objects["lr_scheduler"], dataloader=objects["dataloader"],
                                step_scheduler=steps)
        mgr.restore(args.restore_from)  # by default ckptio's auto-resume: the newest step of --dir, either's
        save = lambda: mgr.save(step=steps.step, epoch=steps.epoch)  # noqa: E731
    losses = {}
    objects["model"].train()
    stopped = False
    for epoch in steps.epochs if hasattr(steps, "epochs") else range(steps.epoch, steps.num_epochs):
        steps.set_epoch(epoch)
        for batches in steps:
            for batch in batches:
                loss = objects["model"](input_ids=batch, labels=batch).loss
                loss.backward()
            objects["optimizer"].step()
            objects["lr_scheduler"].step()
            objects["optimizer"].zero_grad(set_to_none=True)
            losses[steps.step] = loss.item()
            if steps.is_ckpt_step:
                save()
            if args.stop_after is not None and steps.step >= args.stop_after:
                stopped = True
                break
        if stopped or steps.step + 1 >= steps.max_steps:
            break
    if args.by == "ckptio":
        mgr.close()
    result = {"losses": losses, **_gathered(objects)}
    if rank == 0:
        torch.save(result, args.out)
    _exit(world)


def _restore_only(args: argparse.Namespace, objects: dict, rank: int) -> None:
    if args.by == "ckptio":
        from ckptio import CheckpointConfig, CheckpointManager

        CheckpointManager(CheckpointConfig(checkpoint_dir=args.dir, is_peft=args.peft), model=objects["model"],
                          optimizer=objects["optimizer"], lr_scheduler=objects["lr_scheduler"]).restore()
        return
    from nemo_automodel.components.checkpoint.utils import find_latest_checkpoint

    recipe = _automodel_recipe(args, objects, rank)
    step = str(find_latest_checkpoint(args.dir))
    recipe.checkpointer.load_model(objects["model"], os.path.join(step, "model"))
    recipe.checkpointer.load_optimizer(objects["optimizer"], objects["model"], step, objects["lr_scheduler"])


def _exit(world: int) -> None:
    # a rank can abort in interpreter teardown after its work is done (torch + transformers): leave directly
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
