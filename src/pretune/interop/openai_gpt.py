"""GPT-1 (OpenAIGPTModel / OpenAIGPTLMHeadModel, OpenAIGPTForSequenceClassification; Radford et al. 2018).

Quirks: a post-norm decoder (ln_1 after the attention's residual sum, ln_2 after the MLP's; no embedding norm, no
final norm) with learned positions; ``afn="gelu"`` is the tanh approximation (transformers' ``gelu_new``: our
``gelu_tanh``); the MLP is always 4 x n_embd wide; Conv1D weights and the fused ``c_attn`` as in GPT-2 (gpt2.py's
helpers). OpenAIGPTForSequenceClassification scores the last token that is not ``pad_token_id`` with a bias-free
``score`` (our pooling "last", read from the attention mask). transformers adds ``token_type_ids`` through the token
embedding; pretune's GPT-1 has no token types. OpenAIGPTDoubleHeadsModel (its multiple-choice head) is refused.
"""

from __future__ import annotations

import torch

from ..config import TASK_HEADS, ModelConfig
from . import (
    PLAIN_OPTIONS,
    InteropError,
    mismatch,
    rename,
    strip_prefix,
    task_arch,
    task_config_to_hf,
    task_fields,
    task_mismatch,
)
from .gpt2 import from_conv1d, to_conv1d

MODEL_TYPES = ("openai-gpt",)

ACTS = {"gelu": "gelu_tanh", "relu": "relu", "silu": "swish", "swish": "swish"}  # transformers' ACT_FNS
_ACT_NAMES = {"gelu_tanh": "gelu", "relu": "relu", "swish": "silu"}

_TABLE = [
    ("tokens_embed.weight", "transformer.embed.weight"),
    ("positions_embed.weight", "transformer.decoder.position.weight"),
    ("h.{}.attn.q", "transformer.decoder.layers.{}.attn.q_proj"),  # split from c_attn
    ("h.{}.attn.k", "transformer.decoder.layers.{}.attn.k_proj"),
    ("h.{}.attn.v", "transformer.decoder.layers.{}.attn.v_proj"),
    ("h.{}.attn.c_proj", "transformer.decoder.layers.{}.attn.o_proj"),
    ("h.{}.ln_1", "transformer.decoder.layers.{}.attn_norm"),  # post-norm: after the attention's residual sum
    ("h.{}.mlp.c_fc", "transformer.decoder.layers.{}.ffn.up_proj"),
    ("h.{}.mlp.c_proj", "transformer.decoder.layers.{}.ffn.down_proj"),
    ("h.{}.ln_2", "transformer.decoder.layers.{}.ffn_norm"),
]
_HEADS = {"lm": [("lm_head.weight", "head.weight")],  # only when untied
          "classification": [("score.weight", "head.out.weight")], "regression": [("score.weight", "head.out.weight")]}
_TASK_ARCHS = {"classification": "OpenAIGPTForSequenceClassification",
               "regression": "OpenAIGPTForSequenceClassification"}
_TOP = ("lm_head.", "score.")


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    if "OpenAIGPTDoubleHeadsModel" in (hf.get("architectures") or []) or any(
            k.startswith("multiple_choice_head.") for k in keys):
        raise InteropError("OpenAIGPTDoubleHeadsModel (the LM + multiple-choice heads) is not supported; "
                           "OpenAIGPTModel, OpenAIGPTLMHeadModel and OpenAIGPTForSequenceClassification are")
    guess = "OpenAIGPTForSequenceClassification" if "score.weight" in keys else None
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), guess)
    act = hf.get("afn", "gelu")
    if act not in ACTS:
        raise InteropError(f"afn={act!r} is not supported; expected one of {sorted(ACTS)}")
    task = task_fields(hf, arch) if arch else {"head": "lm"}
    if arch:
        task["pooling"] = "last"
    dim = hf.get("n_embd", 768)
    pad = hf.get("pad_token_id")
    return ModelConfig(
        arch="decoder", vocab_size=hf.get("vocab_size", 40478), dim=dim, n_layers=hf.get("n_layer", 12),
        n_heads=hf.get("n_head", 12), ffn_dim=4 * dim, max_seq_len=hf.get("n_positions", 512), ffn=ACTS[act],
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="post", bias=True,
        embed_norm=False, dropout=hf.get("resid_pdrop", 0.1), attn_dropout=hf.get("attn_pdrop", 0.1),
        position="learned", token_types=0, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        pad_token_id=pad if pad is not None else 0, **task,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    split = from_conv1d(strip_prefix(tensors, "transformer."))
    ignore = [r"\.attn\.bias$", r"^position_ids$"]  # old checkpoints' causal-mask and position buffers
    if cfg.tie_embeddings or cfg.head != "lm":
        ignore.append(r"^lm_head\.weight$")  # the tied copy of the embeddings
    return rename(split, _TABLE + _HEADS.get(cfg.head, []), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = to_conv1d(rename(ours, _TABLE + _HEADS.get(cfg.head, []), reverse=True))
    return {(k if k.startswith(_TOP) else f"transformer.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    why = mismatch(cfg, arch="decoder", norm="layernorm", norm_placement="post", bias=True, norm_bias=True,
                   embed_norm=False, position="learned", position_offset=0, token_types=0, embed_dim=None,
                   share_layers=False, attn_scale=None, tied_logit_scale=False, pooler=False, **PLAIN_OPTIONS)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.ffn_dim != 4 * cfg.dim:
        return f"needs ffn_dim = 4 * dim ({4 * cfg.dim}), got {cfg.ffn_dim}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head in TASK_HEADS:
        return task_mismatch(cfg, _TASK_ARCHS, "last")
    return mismatch(cfg, head="lm")


def config_to_hf(cfg: ModelConfig) -> dict:
    task = {"architectures": ["OpenAIGPTLMHeadModel"]}
    if cfg.head in _TASK_ARCHS:
        task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head])
    return {
        "architectures": task.pop("architectures"), "model_type": "openai-gpt", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len, "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "afn": _ACT_NAMES[cfg.ffn], "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout, "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": cfg.pad_token_id, **task,
    }
