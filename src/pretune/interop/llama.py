"""Llama (LlamaModel / LlamaForCausalLM, LlamaForSequenceClassification / TokenClassification /
QuestionAnswering): RoPE, RMSNorm, SwiGLU, grouped-query attention.

Quirks: RoPE pairs coordinates (j, j + d/2) ("rotate_half"), which our RotaryPositions uses too;
the LM head may be tied (SmolLM2) or not; rope_theta moved into rope_parameters in transformers 5.
LlamaForSequenceClassification scores the last token that is not ``pad_token_id`` with a bias-free
``score`` (our pooling "last", read from the attention mask); LlamaForTokenClassification's ``score`` has
a bias and a dropout of 0.1 unless config.json says otherwise; LlamaForQuestionAnswering keeps its body
under ``transformer.`` instead of ``model.``.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import InteropError, mismatch, rename, strip_prefix, task_arch, task_config_to_hf, task_fields, task_mismatch

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
]
_HEADS = {"lm": [("lm_head.weight", "head.weight")], "classification": [("score.weight", "head.out.weight")],
          "regression": [("score.weight", "head.out.weight")], "tagging": [("score", "head.out")],
          "qa": [("qa_outputs", "head.out")]}
_TASK_ARCHS = {"classification": "LlamaForSequenceClassification", "regression": "LlamaForSequenceClassification",
               "tagging": "LlamaForTokenClassification", "qa": "LlamaForQuestionAnswering"}
_TOKEN_DROPOUT = 0.1  # LlamaForTokenClassification's dropout when config.json sets no classifier_dropout
_BODY_PREFIX = {"qa": "transformer."}  # LlamaForQuestionAnswering's base_model_prefix (others: "model.")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InteropError(f"rope type {rope_type!r} is not supported (default RoPE only)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _guess_arch(keys: set[str]) -> str | None:
    if "qa_outputs.weight" in keys:
        return "LlamaForQuestionAnswering"
    if "score.weight" in keys:
        return "LlamaForTokenClassification" if "score.bias" in keys else "LlamaForSequenceClassification"
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    task = task_fields(hf, arch) if arch else {"head": "lm"}
    if task["head"] in ("classification", "regression"):
        task["pooling"] = "last"
    if task["head"] == "tagging":
        if not hf.get("token_classification_bias", True):
            raise InteropError("token_classification_bias=False is not supported (the tagging head has a bias)")
        drop = next((d for d in (task["classifier_dropout"], hf.get("hidden_dropout")) if d is not None),
                    _TOKEN_DROPOUT)
        task["classifier_dropout"] = None if drop == 0.0 else drop  # our Llama dropout is 0.0
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
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else 0, **task,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(strip_prefix(tensors, "model."), "transformer.")
    ignore = [r"rotary_emb\.inv_freq$"]
    if cfg.tie_embeddings or cfg.head != "lm":
        ignore.append(r"^lm_head\.weight$")
    return rename(tensors, _TABLE + _HEADS.get(cfg.head, []), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _TABLE + _HEADS.get(cfg.head, []), reverse=True)
    body = _BODY_PREFIX.get(cfg.head, "model.")
    heads = ("lm_head.", "score.", "qa_outputs.")
    return {(k if k.startswith(heads) else f"{body}{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    why = mismatch(cfg, arch="decoder", norm="rmsnorm", norm_placement="pre", bias=False, embed_norm=False,
                   position="rope", ffn="swiglu", token_types=0, embed_dim=None, share_layers=False,
                   attn_scale=None, tied_logit_scale=False, pooler=False)
    if why:
        return why
    return task_mismatch(cfg, _TASK_ARCHS, "last") if cfg.head in _TASK_ARCHS else mismatch(cfg, head="lm")


def config_to_hf(cfg: ModelConfig) -> dict:
    task = {"architectures": ["LlamaForCausalLM"]}
    if cfg.head in _TASK_ARCHS:
        task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head])
        if cfg.head == "tagging" and cfg.classifier_dropout is None and cfg.dropout != _TOKEN_DROPOUT:
            task["classifier_dropout"] = cfg.dropout
    return {
        "architectures": task.pop("architectures"), "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dh,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_dropout": cfg.attn_dropout, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "pad_token_id": cfg.pad_token_id, **task,
    }
