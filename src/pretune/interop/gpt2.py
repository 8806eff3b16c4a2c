"""GPT-2 (GPT2Model / GPT2LMHeadModel).

Quirks: Conv1D layers store weights as (in, out), the transpose of nn.Linear; queries, keys and
values are one fused c_attn matrix split in thirds; the LM head is tied to wte.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import InteropError, mismatch, rename, strip_prefix

MODEL_TYPES = ("gpt2",)

ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
        "silu": "swish", "swish": "swish"}
_ACT_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "swish": "silu"}

_TABLE = [
    ("wte.weight", "transformer.embed.weight"),
    ("wpe.weight", "transformer.decoder.position.weight"),
    ("h.{}.ln_1", "transformer.decoder.layers.{}.attn_norm"),
    ("h.{}.attn.q", "transformer.decoder.layers.{}.attn.q_proj"),  # split from c_attn
    ("h.{}.attn.k", "transformer.decoder.layers.{}.attn.k_proj"),
    ("h.{}.attn.v", "transformer.decoder.layers.{}.attn.v_proj"),
    ("h.{}.attn.c_proj", "transformer.decoder.layers.{}.attn.o_proj"),
    ("h.{}.ln_2", "transformer.decoder.layers.{}.ffn_norm"),
    ("h.{}.mlp.c_fc", "transformer.decoder.layers.{}.ffn.up_proj"),
    ("h.{}.mlp.c_proj", "transformer.decoder.layers.{}.ffn.down_proj"),
    ("ln_f", "transformer.decoder.norm"),
]
_CONV1D = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# attention-mask buffers of old checkpoints, and the tied LM head
_IGNORE = [r"\.attn\.bias$", r"\.attn\.masked_bias$", r"^lm_head\.weight$"]


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise InteropError("scale_attn_by_inverse_layer_idx=True is not supported")
    if not hf.get("scale_attn_weights", True):
        raise InteropError("scale_attn_weights=False is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTS:
        raise InteropError(f"activation_function={act!r} is not supported; expected one of {sorted(ACTS)}")
    dim = hf["n_embd"]
    return ModelConfig(
        arch="decoder", vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.get("n_positions", 1024), ffn=ACTS[act],
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre", bias=True,
        embed_norm=False, dropout=hf.get("resid_pdrop", 0.1), attn_dropout=hf.get("attn_pdrop", 0.1),
        position="learned", token_types=0, tie_embeddings=True, head="lm",
        pad_token_id=hf.get("pad_token_id") or hf.get("eos_token_id") or 0,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "transformer.")
    split: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("attn.c_attn.weight"):  # (dim, 3*dim) -> three (dim, dim) nn.Linear weights
            for part, w in zip("qkv", t.t().chunk(3, dim=0)):
                split[name.replace("c_attn.weight", f"{part}.weight")] = w
        elif name.endswith("attn.c_attn.bias"):
            for part, b in zip("qkv", t.chunk(3)):
                split[name.replace("c_attn.bias", f"{part}.bias")] = b
        elif name.endswith(_CONV1D):
            split[name] = t.t()
        else:
            split[name] = t
    return rename(split, _TABLE, ignore=_IGNORE)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _TABLE, reverse=True, ignore=[r"^head\.weight$"])
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if ".attn.q." in name:
            base = name.replace(".attn.q.", ".attn.c_attn.")
            parts = [hf[name.replace(".attn.q.", f".attn.{p}.")] for p in "qkv"]
            out[base] = torch.cat([p.t() for p in parts], dim=1) if name.endswith("weight") else torch.cat(parts)
        elif ".attn.k." in name or ".attn.v." in name:
            continue
        elif name.endswith(_CONV1D):
            out[name] = t.t().contiguous()
        else:
            out[name] = t
    return {f"transformer.{k}": v for k, v in out.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    why = mismatch(cfg, arch="decoder", norm="layernorm", norm_placement="pre", bias=True, norm_bias=True,
                   embed_norm=False, position="learned", position_offset=0, token_types=0, embed_dim=None,
                   share_layers=False, attn_scale=None, head="lm", tie_embeddings=True, tied_logit_scale=False,
                   pooler=False)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu_tanh, gelu, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len, "activation_function": _ACT_NAMES[cfg.ffn],
        "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout, "tie_word_embeddings": True, "scale_attn_weights": True,
        "bos_token_id": cfg.pad_token_id, "eos_token_id": cfg.pad_token_id,
    }
