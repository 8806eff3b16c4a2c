"""Llama (LlamaModel / LlamaForCausalLM): RoPE, RMSNorm, SwiGLU, grouped-query attention.

Quirks: RoPE pairs coordinates (j, j + d/2) ("rotate_half"), which our RotaryPositions uses too;
the LM head may be tied (SmolLM2) or not; rope_theta moved into rope_parameters in transformers 5.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import InteropError, mismatch, rename, strip_prefix

MODEL_TYPES = ("llama",)

_TABLE = [
    ("embed_tokens.weight", "transformer.embed.weight"),
    ("layers.{}.self_attn.q_proj", "transformer.decoder.layers.{}.attn.q_proj"),
    ("layers.{}.self_attn.k_proj", "transformer.decoder.layers.{}.attn.k_proj"),
    ("layers.{}.self_attn.v_proj", "transformer.decoder.layers.{}.attn.v_proj"),
    ("layers.{}.self_attn.o_proj", "transformer.decoder.layers.{}.attn.o_proj"),
    ("layers.{}.mlp.gate_proj", "transformer.decoder.layers.{}.ffn.gate_proj"),
    ("layers.{}.mlp.up_proj", "transformer.decoder.layers.{}.ffn.up_proj"),
    ("layers.{}.mlp.down_proj", "transformer.decoder.layers.{}.ffn.down_proj"),
    ("layers.{}.input_layernorm", "transformer.decoder.layers.{}.attn_norm"),
    ("layers.{}.post_attention_layernorm", "transformer.decoder.layers.{}.ffn_norm"),
    ("norm", "transformer.decoder.norm"),
    ("lm_head.weight", "head.weight"),
]


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InteropError(f"rope type {rope_type!r} is not supported (default RoPE only)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise InteropError(f"hidden_act={hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise InteropError("attention_bias/mlp_bias=True is not supported")
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    return ModelConfig(
        arch="decoder", vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim if head_dim * n_heads != hf["hidden_size"] else None,
        ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048), ffn="swiglu",
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre", bias=False,
        embed_norm=False, dropout=0.0, attn_dropout=float(hf.get("attention_dropout", 0.0)),
        position="rope", rope_base=_rope_theta(hf), token_types=0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), head="lm",
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else 0,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "model.")
    ignore = [r"rotary_emb\.inv_freq$"]
    if cfg.tie_embeddings:
        ignore.append(r"^lm_head\.weight$")
    return rename(tensors, _TABLE, ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _TABLE, reverse=True)
    return {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    return mismatch(cfg, arch="decoder", norm="rmsnorm", norm_placement="pre", bias=False, embed_norm=False,
                    position="rope", ffn="swiglu", token_types=0, embed_dim=None, share_layers=False,
                    attn_scale=None, head="lm", tied_logit_scale=False, pooler=False)


def config_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dh,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_dropout": cfg.attn_dropout, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "pad_token_id": cfg.pad_token_id,
    }
