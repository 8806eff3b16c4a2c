"""GPT-2 (GPT2Model / GPT2LMHeadModel, GPT2ForSequenceClassification / TokenClassification /
QuestionAnswering).

Quirks: Conv1D layers store weights as (in, out), the transpose of nn.Linear; queries, keys and
values are one fused c_attn matrix split in thirds; the LM head is tied to wte.
GPT2ForSequenceClassification scores the last token that is not ``pad_token_id`` (our pooling
"last", which reads the attention mask instead: the two agree when padding uses the pad id and no
real token is the pad id); its ``score`` layer has no bias. GPT2ForTokenClassification's dropout
defaults to 0.1 whatever resid_pdrop is.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import (
    HF_ACT_NAMES,
    HF_ACTS,
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

MODEL_TYPES = ("gpt2",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES

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
_TASK_HEADS = {"classification": [("score.weight", "head.out.weight")], "tagging": [("classifier", "head.out")],
               "qa": [("qa_outputs", "head.out")]}
_TASK_HEADS["regression"] = _TASK_HEADS["classification"]
_TASK_ARCHS = {"classification": "GPT2ForSequenceClassification", "regression": "GPT2ForSequenceClassification",
               "tagging": "GPT2ForTokenClassification", "qa": "GPT2ForQuestionAnswering"}
_TOKEN_DROPOUT = 0.1  # GPT2ForTokenClassification's dropout when config.json sets neither classifier_dropout
# nor hidden_dropout
_CONV1D = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# attention-mask buffers of old checkpoints, and the tied LM head
_IGNORE = [r"\.attn\.bias$", r"\.attn\.masked_bias$", r"^lm_head\.weight$"]


def _guess_arch(keys: set[str]) -> str | None:
    for tensor, arch in (("score.weight", "GPT2ForSequenceClassification"),
                         ("classifier.weight", "GPT2ForTokenClassification"),
                         ("qa_outputs.weight", "GPT2ForQuestionAnswering")):
        if tensor in keys:
            return arch
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise InteropError("scale_attn_by_inverse_layer_idx=True is not supported")
    if not hf.get("scale_attn_weights", True):
        raise InteropError("scale_attn_weights=False is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTS:
        raise InteropError(f"activation_function={act!r} is not supported; expected one of {sorted(ACTS)}")
    dim = hf["n_embd"]
    task = task_fields(hf, arch) if arch else {"head": "lm"}
    if task["head"] in ("classification", "regression"):
        task["pooling"] = "last"
    if task["head"] == "tagging":  # HF's dropout: classifier_dropout, else hidden_dropout, else 0.1
        drop = next((d for d in (task["classifier_dropout"], hf.get("hidden_dropout")) if d is not None),
                    _TOKEN_DROPOUT)
        task["classifier_dropout"] = None if drop == hf.get("resid_pdrop", 0.1) else drop
    return ModelConfig(
        arch="decoder", vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf.get("n_positions", 1024), ffn=ACTS[act],
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre", bias=True,
        embed_norm=False, dropout=hf.get("resid_pdrop", 0.1), attn_dropout=hf.get("attn_pdrop", 0.1),
        position="learned", token_types=0, tie_embeddings=True,
        pad_token_id=hf.get("pad_token_id") or hf.get("eos_token_id") or 0, **task,
    )


def from_conv1d(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Conv1D (in, out) weights as nn.Linear (out, in) ones, the fused ``attn.c_attn`` split into ``attn.q/k/v``
    (GPT-2 and GPT-1 share these names)."""
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
    return split


def to_conv1d(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``from_conv1d``: ``attn.q/k/v`` fused into ``attn.c_attn``, Linear weights as Conv1D ones."""
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
    return out


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    split = from_conv1d(strip_prefix(tensors, "transformer."))
    return rename(split, _TABLE + _TASK_HEADS.get(cfg.head, []), ignore=_IGNORE)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = to_conv1d(rename(ours, _TABLE + _TASK_HEADS.get(cfg.head, []), reverse=True, ignore=[r"^head\.weight$"]))
    heads = ("score.", "classifier.", "qa_outputs.")
    return {(k if k.startswith(heads) else f"transformer.{k}"): v for k, v in out.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    why = mismatch(cfg, arch="decoder", norm="layernorm", norm_placement="pre", bias=True, norm_bias=True,
                   embed_norm=False, position="learned", position_offset=0, token_types=0, embed_dim=None,
                   share_layers=False, attn_scale=None, tied_logit_scale=False, pooler=False, **PLAIN_OPTIONS)
    if why:
        return why
    if cfg.head in _TASK_ARCHS:
        why = task_mismatch(cfg, _TASK_ARCHS, "last")
    else:
        why = mismatch(cfg, head="lm", tie_embeddings=True)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu_tanh, gelu, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    task = {"architectures": ["GPT2LMHeadModel"]}
    if cfg.head in _TASK_ARCHS:
        task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head])
        task["pad_token_id"] = cfg.pad_token_id  # the sequence head finds the last token that is not padding
        if cfg.head == "tagging" and cfg.classifier_dropout is None and cfg.dropout != _TOKEN_DROPOUT:
            task["classifier_dropout"] = cfg.dropout
    return {
        "architectures": task.pop("architectures"), "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len, "activation_function": _ACT_NAMES[cfg.ffn],
        "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout, "tie_word_embeddings": True, "scale_attn_weights": True,
        "bos_token_id": cfg.pad_token_id, "eos_token_id": cfg.pad_token_id, **task,
    }
