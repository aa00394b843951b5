"""Load a checkpoint's model the way a user of the ecosystem would, and generate a line of text.

    python examples/llm/generate.py checkpoints/epoch_0_step_200/model/consolidated   # transformers
    python examples/llm/generate.py checkpoints_peft/epoch_0_step_100/model           # peft adapter
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a consolidated Hugging Face folder, or a PEFT adapter folder")
    p.add_argument("--prompt", default="The old man ")
    p.add_argument("--max-new-tokens", type=int, default=60)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(args.model_dir)
    if (folder / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
        how = "peft.AutoPeftModelForCausalLM"
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        how = "transformers.AutoModelForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model.eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    print(f"[generate] loaded {folder} with {how}")
    print(f"[generate] {text.splitlines()[0] if text.strip() else text!r}")
    return 0 if text.strip() else 1


if __name__ == "__main__":
    sys.exit(main())
