"""Quantized exports: a Llama as a TensorRT-LLM-style checkpoint (``.qnemo`` folder or tar).

::

    model.qnemo/
    ├── config.json               # architecture, dtype, quantization, mapping (world/tp/pp size), shapes
    ├── rank0.safetensors …       # one file per tensor-parallel rank
    ├── tokenizer files           # when a tokenizer is given
    └── tokenizer_config.yaml     # where the tokenizer is (library + file names)

Weights use TensorRT-LLM's Llama names: ``transformer.vocab_embedding``, per layer
``attention.qkv`` (q, k and v fused), ``attention.dense``, ``mlp.fc`` (HF ``gate_proj``, the activated
branch), ``mlp.gate`` (HF ``up_proj``), ``mlp.proj`` (``down_proj``), ``input_layernorm``,
``post_layernorm``; then ``transformer.ln_f`` and ``lm_head``. Tensor parallelism splits them as TP
runs them: column-parallel layers (qkv — each of q, k, v by heads —, fc, gate, lm_head) by output rows,
row-parallel layers (dense, proj) by input columns; embeddings and norms are replicated.

Quantization of the linear layers of the decoder:

* ``int8_wo`` (TensorRT-LLM ``W8A16``): int8 weights, symmetric, one scale per output channel
  (``<name>.per_channel_scale``, float32). Weights keep PyTorch's ``[out, in]`` layout; TensorRT-LLM's
  build step interleaves them for its kernels.
* ``fp8`` (``FP8``, e4m3): float8 weights with one scale per tensor (``<name>.weights_scaling_factor``);
  activation scales are not calibrated here (weight-only reference).

No TensorRT-LLM runs on this machine, so :func:`load_qnemo` is the reference reader: it merges the
rank files, dequantizes, and rebuilds a ``transformers`` Llama that runs on CPU.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from ...errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError, require
from ...storage import LocalFolderWriter
from ...storage.confined import Folder
from .. import hf_fields
from ..safetensors._reader import SafetensorsFile

__all__ = ["ALGOS", "export_qnemo", "load_qnemo", "quantize", "dequantize"]

ALGOS = {"int8_wo": "W8A16", "fp8": "FP8"}
_FP8_MAX = 448.0
_COLUMN = ("attention.qkv", "mlp.fc", "mlp.gate")
_ROW = ("attention.dense", "mlp.proj")
_HF_LINEAR = {"mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
              "attention.dense": "self_attn.o_proj"}


def quantize(weight: torch.Tensor, algo: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, scale) of a ``[out, in]`` weight; dequantize with :func:`dequantize`."""
    w = weight.detach().float()
    if algo == "int8_wo":
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale
    if algo == "fp8":
        scale = (w.abs().amax() / _FP8_MAX).clamp(min=1e-12).reshape(1)
        return (w / scale).to(torch.float8_e4m3fn), scale
    raise ConfigError(f"unknown quantization {algo!r}; use one of {sorted(ALGOS)}")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The floating-point weight of a quantized one: int8 rows times their per-row scale, FP8 times its scale."""
    if q.dtype == torch.int8:
        return (q.float() * scale.float()[:, None]).to(dtype)
    return (q.float() * scale.float()).to(dtype)


def _llama_config(model: torch.nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        raise CheckpointError("a .qnemo export needs a transformers Llama model (config.model_type == 'llama')")
    return cfg


def _check_tp(cfg: Any, tp_size: int) -> None:
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if not isinstance(tp_size, int) or tp_size < 1 or heads % tp_size or kv_heads % tp_size \
            or cfg.intermediate_size % tp_size or cfg.hidden_size % tp_size:
        raise ConfigError(f"tp_size={tp_size} must divide the attention heads ({heads}), KV heads ({kv_heads}), "
                          f"hidden size ({cfg.hidden_size}) and intermediate size ({cfg.intermediate_size})")


class _RankFiles:
    """The tensors of each TP rank's ``rank{r}.safetensors``: weights split column- or row-wise (or whole), the
    linear ones quantized with their scales."""

    def __init__(self, algo: str, tp_size: int, dtype: torch.dtype) -> None:
        self.algo, self.tp_size, self.dtype = algo, tp_size, dtype
        self.ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]

    def put(self, name: str, weight: torch.Tensor, kind: str, quant: bool) -> None:
        algo, tp_size = self.algo, self.tp_size
        q, scale = quantize(weight, algo) if quant else (weight.to(self.dtype), None)
        for r in range(tp_size):
            if kind == "column":
                part, sc = q.chunk(tp_size, dim=0)[r], None if scale is None else (
                    scale.chunk(tp_size)[r] if algo == "int8_wo" else scale)
            elif kind == "row":
                part, sc = q.chunk(tp_size, dim=1)[r], scale
            else:
                part, sc = q, scale
            self.ranks[r][f"{name}.weight"] = part.clone(memory_format=torch.contiguous_format)  # no shared storage
            if sc is not None:
                suffix = "per_channel_scale" if algo == "int8_wo" else "weights_scaling_factor"
                self.ranks[r][f"{name}.{suffix}"] = sc.contiguous().float()

    def llama(self, sd: dict[str, torch.Tensor], cfg: Any) -> None:
        """Every weight of a transformers Llama state dict, under TensorRT-LLM's names."""
        tp_size = self.tp_size
        self.put("transformer.vocab_embedding", sd["model.embed_tokens.weight"], "replicated", False)
        for i in range(cfg.num_hidden_layers):
            hf, tl = f"model.layers.{i}", f"transformer.layers.{i}"
            q_w, k_w, v_w = (sd[f"{hf}.self_attn.{p}_proj.weight"] for p in "qkv")
            # fuse per TP rank so that each rank holds its own heads of q, k and v
            fused = torch.cat([torch.cat([q_w.chunk(tp_size)[r], k_w.chunk(tp_size)[r], v_w.chunk(tp_size)[r]])
                               for r in range(tp_size)])
            self.put(f"{tl}.attention.qkv", fused, "column", True)
            for tl_name, hf_name in _HF_LINEAR.items():
                self.put(f"{tl}.{tl_name}", sd[f"{hf}.{hf_name}.weight"], "row" if tl_name in _ROW else "column", True)
            self.put(f"{tl}.input_layernorm", sd[f"{hf}.input_layernorm.weight"], "replicated", False)
            self.put(f"{tl}.post_layernorm", sd[f"{hf}.post_attention_layernorm.weight"], "replicated", False)
        self.put("transformer.ln_f", sd["model.norm.weight"], "replicated", False)
        lm_head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        if lm_head.shape[0] % tp_size:
            raise ConfigError(f"tp_size={tp_size} must divide the vocabulary ({lm_head.shape[0]})")
        self.put("lm_head", lm_head, "column", False)


def _trtllm_config(cfg: Any, sd: dict[str, torch.Tensor], dtype: torch.dtype, algo: str, tp_size: int) -> dict:
    """The export's ``config.json``: TensorRT-LLM's model description, with the source config for the way back.

    The rotary embedding is read from either transformers spelling (:mod:`ckptio.formats.hf_fields`); a
    scaled one is kept as TensorRT-LLM's ``rotary_scaling``. A field the export cannot hold is refused."""
    heads = cfg.num_attention_heads
    r = hf_fields.refuse(cfg.to_dict(), "the model's config", "qnemo (TensorRT-LLM)", holds=("rope_type",))
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": str(dtype).removeprefix("torch."),
        "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_size": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": r.theta,
        "rotary_scaling": {"type": r.kind, "rope_type": r.kind, **r.scaling} if r.kind != "default" else None,
        "share_embedding_table": "lm_head.weight" not in sd,
        "quantization": {"quant_algo": ALGOS[algo], "kv_cache_quant_algo": None, "per_channel": algo == "int8_wo"},
        "mapping": {"world_size": tp_size, "tp_size": tp_size, "pp_size": 1},
        "ckptio": {"algo": algo, "hf_config": json.loads(cfg.to_json_string())},
    }


def _write_tokenizer(stage: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(stage)
    files = sorted(p.name for p in stage.iterdir() if p.name not in ("config.json",) and not p.name.startswith("rank"))
    (stage / "tokenizer_config.yaml").write_text(yaml.safe_dump(
        {"library": "huggingface", "type": ".", "files": files}, sort_keys=False))


def export_qnemo(model: torch.nn.Module, out: str | Path, *, algo: str = "int8_wo", tp_size: int = 1,
                 tokenizer: Any | None = None, compress: bool = False) -> Path:
    """Quantize ``model`` (a plain, unsharded transformers Llama) and write it to ``out``.

    ``compress=True`` writes one tar file at ``out`` instead of a folder. Returns ``out``.
    """
    if algo not in ALGOS:
        raise ConfigError(f"unknown quantization {algo!r}; use one of {sorted(ALGOS)}")
    cfg = _llama_config(model)
    hf_fields.refuse(cfg.to_dict(), "the model's config", "qnemo (TensorRT-LLM)", holds=("rope_type",))
    _check_tp(cfg, tp_size)
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dtype = next(iter(sd.values())).dtype
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder export is committed whole; a tar export is packed from a scratch folder that is then removed
    writer = LocalFolderWriter.create(out if not compress else out.parent / f".{out.name}.stage")
    stage = writer.local_path()
    try:
        files = _RankFiles(algo, tp_size, dtype)
        files.llama(sd, cfg)
        for r, tensors in enumerate(files.ranks):
            save_file(tensors, str(stage / f"rank{r}.safetensors"), metadata={"format": "pt"})
        config = _trtllm_config(cfg, sd, dtype, algo, tp_size)
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if tokenizer is not None:
            _write_tokenizer(stage, tokenizer)
        if compress:
            from .format import _tar_folder

            _tar_folder(stage, out)
            writer.abort()
        else:
            writer.commit()
    except BaseException:
        writer.abort()
        raise
    return out


def load_qnemo(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The reference reader: merge the rank files, dequantize, return a ``transformers`` Llama (eval mode)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such .qnemo folder or file")
    with tempfile.TemporaryDirectory(prefix="ckptio-qnemo-") as tmp:
        if path.is_file():
            from ...storage.archive import safe_extract

            folder = safe_extract(path, Path(tmp) / "x")
        else:
            folder = path
        tree = Folder(folder)
        try:
            config = json.loads(tree.read_bytes("config.json", max_size=64 << 20))
            tp = int(config["mapping"]["tp_size"])
            algo = config["ckptio"]["algo"]
            hf_config = config["ckptio"]["hf_config"]
        except (CheckpointError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{path}: config.json is missing or not a ckptio .qnemo config ({exc})") from exc
        if not 1 <= tp <= 4096:
            raise CheckpointCorruptError(f"{path}: config.json gives tp_size {tp}")
        ranks = []
        for r in range(tp):
            name = f"rank{r}.safetensors"
            if tree.kind(name) is None:
                raise CheckpointNotFoundError(f"{path}: {name} is missing (tp_size is {tp})")
            with SafetensorsFile(tree, name) as st:
                ranks.append({k: st.read(k) for k in st.entries})
    return _rebuild(ranks, algo, hf_config, dtype, path)


def _rebuild(ranks: list[dict[str, torch.Tensor]], algo: str, hf_config: dict, dtype: torch.dtype,
             where: Path) -> torch.nn.Module:
    transformers = require("transformers", extra="hf", purpose="reading a .qnemo export back")
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM

    tp = len(ranks)
    scale_key = "per_channel_scale" if algo == "int8_wo" else "weights_scaling_factor"

    def merged(name: str, kind: str) -> torch.Tensor:
        try:
            parts = [r[f"{name}.weight"] for r in ranks]
        except KeyError as exc:
            raise CheckpointCorruptError(f"{where}: tensor {name}.weight is missing from a rank file") from exc
        if f"{name}.{scale_key}" in ranks[0]:
            scales = [r[f"{name}.{scale_key}"] for r in ranks]
            parts = [dequantize(p, s, dtype) for p, s in zip(parts, scales)]
        else:
            parts = [p.to(dtype) for p in parts]
        if kind == "column":
            return torch.cat(parts, dim=0)
        if kind == "row":
            return torch.cat(parts, dim=1)
        return parts[0]

    cfg = AutoConfig.for_model(**hf_config)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": merged("transformer.vocab_embedding", "replicated")}
    for i in range(cfg.num_hidden_layers):
        hf, tl = f"model.layers.{i}", f"transformer.layers.{i}"
        fused = merged(f"{tl}.attention.qkv", "column")
        q_rows, kv_rows = heads * head_dim // tp, kv_heads * head_dim // tp
        qs, ks, vs = [], [], []
        for chunk in fused.split(q_rows + 2 * kv_rows):
            q, k, v = chunk.split([q_rows, kv_rows, kv_rows])
            qs.append(q)
            ks.append(k)
            vs.append(v)
        sd[f"{hf}.self_attn.q_proj.weight"] = torch.cat(qs)
        sd[f"{hf}.self_attn.k_proj.weight"] = torch.cat(ks)
        sd[f"{hf}.self_attn.v_proj.weight"] = torch.cat(vs)
        for tl_name, hf_name in _HF_LINEAR.items():
            sd[f"{hf}.{hf_name}.weight"] = merged(f"{tl}.{tl_name}", "row" if tl_name in _ROW else "column")
        sd[f"{hf}.input_layernorm.weight"] = merged(f"{tl}.input_layernorm", "replicated")
        sd[f"{hf}.post_attention_layernorm.weight"] = merged(f"{tl}.post_layernorm", "replicated")
    sd["model.norm.weight"] = merged("transformer.ln_f", "replicated")
    sd["lm_head.weight"] = merged("lm_head", "column")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointCorruptError(f"{where}: weights do not fit the config: missing {missing[:3]}, "
                                     f"unexpected {unexpected[:3]}")
    return model.eval()


def agreement(reference: torch.nn.Module, other: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """Fraction of positions where both models predict the same next token."""
    with torch.no_grad():
        a = reference(input_ids=input_ids).logits.argmax(-1)
        b = other(input_ids=input_ids).logits.argmax(-1)
    return (a == b).float().mean().item()
