"""The fuzz family of ``convert --config`` (``hf_config``; see ``fuzz_readers.py`` for the oracle): the model's
``config.json`` that a conversion takes from outside its source, damaged as JSON (values of other types, huge,
negative, NaN, deep, keys dropped or doubled, random bytes) or replaced by what is not a file (a link out of its
folder, a FIFO, a folder, a huge sparse file), given as a file or as a model folder, then used by a conversion of
a bare safetensors folder (weights only, a tiny Llama) into a Hugging Face bundle and into a Megatron run (TP 1 or
2, either layout), the targets that build from the config.

Every outcome must be "converted right" or ckptio's own error: a bundle whose ``config.json`` is the bytes given and
whose weights are the source's, or a Megatron run that ckptio reads back to the source's weights exactly; and nothing
is written outside the output, nor an output left behind by a conversion that failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from fuzz_frameworks import _fixed_dir
from fuzz_kit import Case, Special, WrongResult, materialize, outside_dir
from fuzz_mutations import mutate_json

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
}
"""A tiny Llama's config, as transformers writes it (the family's pristine input)."""


def _weights(config: dict) -> dict[str, torch.Tensor]:
    """The tensors of a Llama with ``config``'s sizes, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    h, f, v, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                               "num_attention_heads", "num_key_value_heads"))
    d = h // heads
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, by the names ckptio's reader gives."""
    from ckptio.convert.formats import open_any

    opened = open_any(path)
    try:
        return {k: opened.source.read(k) for k in opened.source.index()}
    finally:
        opened.close()


def _config_input(rng: Case, tmp: Path, outside: Path) -> tuple[str, bytes | None]:
    """The ``--config`` argument of this input (a file or a model folder) and the bytes it gives (``None``: not a
    regular file)."""
    data = json.dumps(CONFIG).encode()
    if not rng.pristine:
        data = mutate_json(rng, data, "config.json")
    entry: bytes | Special = data
    if not rng.pristine and rng.random() < 0.15:
        entry = rng.choice([Special(("link", str(outside / "canary.bin"))), Special(("link", "../outside/canary.bin")),
                            Special(("fifo",)), Special(("dir",)), Special(("sparse", 1 << 40))])
        rng.note(f"config.json is {entry[0]}")
    folder = rng.pristine or rng.random() < 0.5
    holder = tmp / "cfg"
    materialize({"config.json": entry, "tokenizer_config.json": b"{}"}, holder)
    if folder:
        rng.note("--config names the model folder")
    return str(holder if folder else holder / "config.json"), entry if isinstance(entry, bytes) else None


class HFConfig:
    def prepare(self) -> None:
        if hasattr(self, "want"):
            return
        from safetensors.torch import save_file

        self.src = _fixed_dir("hf-config") / "weights"
        self.want = _weights(CONFIG)
        if not (self.src / "model.safetensors").is_file():
            self.src.mkdir(parents=True, exist_ok=True)
            save_file(self.want, str(self.src / "model.safetensors"))

    def __call__(self, rng: Case, tmp: Path) -> None:
        from ckptio.convert.formats import convert

        self.prepare()
        rng.reading = False
        outside = outside_dir(tmp)
        spec, given = _config_input(rng, tmp, outside)
        to = rng.choice(["hf", "megatron"])
        options = {"tp": rng.choice([1, 2]), "layout": rng.choice(["dist", "legacy"])} if to == "megatron" else None
        rng.note(f"convert --to {to} {options or ''}")
        out = tmp / "out" / "converted"
        out.parent.mkdir()
        rng.reading = True
        try:
            convert(self.src, out, to, config=spec, options=options)
        except BaseException:
            if out.exists() or any(p.name != "converted" for p in out.parent.iterdir()):
                raise WrongResult("a conversion that failed left files in the output's folder") from None
            raise
        finally:
            if sorted(p.name for p in outside.iterdir()) != ["canary.bin"]:
                raise WrongResult("a file was written beside the canary, outside the output")
        if given is None:
            raise WrongResult("a conversion took a config.json that is not a regular file")
        got = _read_all(out)
        if to == "hf" and (out / "config.json").read_bytes() != given:
            raise WrongResult("the bundle's config.json is not the bytes given")
        if set(got) != set(self.want) or any(not torch.equal(got[k], v) for k, v in self.want.items()):
            raise WrongResult(f"the {to} output does not hold the source's weights")


FAMILIES = {"hf_config": HFConfig()}
