"""``ckptio quantize HF_FOLDER OUT``: a quantized TensorRT-LLM-style export (.qnemo) with a self-check."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import CheckpointNotFoundError, require
from ._fmt import human_bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ckptio quantize``."""
    p = sub.add_parser("quantize", help="export a Llama as a quantized .qnemo (TensorRT-LLM layout)",
                       description="Quantize the linear layers of a Hugging Face Llama folder (e.g. a step's "
                                   "model/consolidated) and write a TensorRT-LLM-style checkpoint.")
    p.add_argument("source", help="a Hugging Face model folder (config.json + safetensors)")
    p.add_argument("out", help="the .qnemo folder (or tar file with --compress) to create")
    p.add_argument("--algo", default="int8_wo", choices=["int8_wo", "fp8"], help="int8 weight-only or FP8 e4m3")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to split the weights for")
    p.add_argument("--compress", action="store_true", help="write one tar file instead of a folder")
    p.add_argument("--check", type=int, default=256, metavar="N",
                   help="compare next-token predictions with the original on N random tokens (0: skip)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Quantize a Hugging Face Llama folder into a ``.qnemo`` export."""
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = require("transformers", extra="hf", purpose="ckptio quantize")
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer

    from ..formats.nemo import qnemo

    src = Path(args.source)
    if not (src / "config.json").is_file():
        raise CheckpointNotFoundError(f"{src}: not a Hugging Face model folder (config.json is missing)")
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception:  # a folder without tokenizer files exports without one
        tokenizer = None
    out = qnemo.export_qnemo(model, args.out, algo=args.algo, tp_size=args.tp, tokenizer=tokenizer,
                             compress=args.compress)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    after = out.stat().st_size if out.is_file() else sum(p.stat().st_size for p in out.glob("rank*.safetensors"))
    print(f"wrote {out}: {args.algo}, tp={args.tp}; weights {human_bytes(after)} (was {human_bytes(before)}, "
          f"x{before / max(after, 1):.2f} smaller)")
    if args.check > 0:
        restored = qnemo.load_qnemo(out)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (max(1, args.check // 64), 64), generator=g)
        agree = qnemo.agreement(model, restored, ids)
        print(f"check: dequantized export agrees with the original on {agree:.1%} of next-token predictions "
              f"({ids.numel()} positions)")
    return 0
