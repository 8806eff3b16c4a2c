"""ELECTRA (ElectraModel, ElectraForPreTraining: the discriminator, ElectraForMaskedLM: the generator, and the
*ForSequenceClassification / *ForTokenClassification / *ForQuestionAnswering task heads).

Quirks: BERT's post-norm body with no pooler; the embeddings are ``embedding_size`` wide and projected to the hidden
size (``embeddings_project``, our ``embed_dim`` factorisation) only when the two differ. The discriminator's head is
dense + hidden_act + one logit per token (our head "rtd"); the generator's is dense to the embedding width + GELU
(always, whatever hidden_act says) + LayerNorm, then the tied ``generator_lm_head`` with its bias (our "mlm" head
with head_act="gelu"). ElectraForSequenceClassification classifies the first token through dense + GELU (our
pooling "cls" with cls_act="gelu"); an imported ELECTRA records that (cls_act="gelu"), which is how a config that
is otherwise BERT's exports as ELECTRA. ElectraForMultipleChoice and ElectraForCausalLM are refused.
"""

from __future__ import annotations

import torch

from ..config import TASK_HEADS, ModelConfig
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

MODEL_TYPES = ("electra",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES

_BODY = [
    ("embeddings.word_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.position_embeddings.weight", "transformer.encoder.position.weight"),
    ("embeddings.token_type_embeddings.weight", "transformer.encoder.token_type.weight"),
    ("embeddings.LayerNorm", "transformer.encoder.embed_norm"),
    ("embeddings_project", "transformer.encoder.embed_proj"),
    ("encoder.layer.{}.attention.self.query", "transformer.encoder.layers.{}.attn.q_proj"),
    ("encoder.layer.{}.attention.self.key", "transformer.encoder.layers.{}.attn.k_proj"),
    ("encoder.layer.{}.attention.self.value", "transformer.encoder.layers.{}.attn.v_proj"),
    ("encoder.layer.{}.attention.output.dense", "transformer.encoder.layers.{}.attn.o_proj"),
    ("encoder.layer.{}.attention.output.LayerNorm", "transformer.encoder.layers.{}.attn_norm"),
    ("encoder.layer.{}.intermediate.dense", "transformer.encoder.layers.{}.ffn.up_proj"),
    ("encoder.layer.{}.output.dense", "transformer.encoder.layers.{}.ffn.down_proj"),
    ("encoder.layer.{}.output.LayerNorm", "transformer.encoder.layers.{}.ffn_norm"),
]
_HEADS = {
    "none": [],
    "rtd": [("discriminator_predictions.dense_prediction", "head.out"),
            ("discriminator_predictions.dense", "head.dense")],
    "mlm": [("generator_predictions.dense", "head.dense"), ("generator_predictions.LayerNorm", "head.norm"),
            ("generator_lm_head.bias", "head.bias"), ("generator_lm_head.weight", "head.weight")],  # untied only
    "classification": [("classifier.dense", "head.dense"), ("classifier.out_proj", "head.out")],
    "regression": [("classifier.dense", "head.dense"), ("classifier.out_proj", "head.out")],
    "tagging": [("classifier", "head.out")],
    "qa": [("qa_outputs", "head.out")],
}
_ARCHS = {"none": "ElectraModel", "rtd": "ElectraForPreTraining", "mlm": "ElectraForMaskedLM",
          "classification": "ElectraForSequenceClassification", "regression": "ElectraForSequenceClassification",
          "tagging": "ElectraForTokenClassification", "qa": "ElectraForQuestionAnswering"}
_TASK_ARCHS = {head: _ARCHS[head] for head in TASK_HEADS}
_HEAD_KEYS = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.", "classifier.",
              "qa_outputs.")
# buffers older files may hold (position ids, the default token types)
_IGNORE = [r"^embeddings\.position_ids$", r"^embeddings\.token_type_ids$"]


def _guess_arch(keys: set[str]) -> str | None:
    """The task class a folder without ``architectures`` holds, from its head tensors."""
    if "qa_outputs.weight" in keys:
        return "ElectraForQuestionAnswering"
    if "classifier.out_proj.weight" in keys:
        return "ElectraForSequenceClassification"
    if "classifier.weight" in keys:
        return "ElectraForTokenClassification"
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    if hf.get("is_decoder") or any(a == "ElectraForCausalLM" for a in hf.get("architectures") or []):
        raise InteropError("ElectraForCausalLM (is_decoder=true) is not supported: ELECTRA imports as an encoder")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise InteropError(f"position_embedding_type={hf['position_embedding_type']!r} is not supported "
                           "(absolute only)")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTS:
        raise InteropError(f"hidden_act={act!r} is not supported; expected one of {sorted(ACTS)}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(hf.get(key, 0), int):
            raise InteropError(f"{key}={hf[key]!r} must be an integer")
    dim = hf.get("hidden_size", 256)
    embed = hf.get("embedding_size", 128)
    if not isinstance(embed, int) or embed <= 0:
        raise InteropError(f"embedding_size={embed!r} must be a positive integer")
    names = {k[len("electra."):] if k.startswith("electra.") else k for k in keys}
    if arch:
        fields = task_fields(hf, arch)
        if fields["head"] == "regression" or fields["head"] == "classification":
            fields["pooling"] = "cls"
    elif any(k.startswith("discriminator_predictions.") for k in names):
        fields = {"head": "rtd"}
    elif any(k.startswith(("generator_predictions.", "generator_lm_head.")) for k in names):
        fields = {"head": "mlm"}
    else:
        fields = {"head": "none"}
    return ModelConfig(
        arch="encoder", vocab_size=hf.get("vocab_size", 30522), dim=dim,
        n_layers=hf.get("num_hidden_layers", 12), n_heads=hf.get("num_attention_heads", 4),
        ffn_dim=hf.get("intermediate_size", 1024), max_seq_len=hf.get("max_position_embeddings", 512),
        ffn=ACTS[act], norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
        bias=True, embed_norm=True, dropout=hf.get("hidden_dropout_prob", 0.1),
        attn_dropout=hf.get("attention_probs_dropout_prob", 0.1), position="learned",
        token_types=hf.get("type_vocab_size", 2), embed_dim=embed if embed != dim else None,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        head_act="gelu" if fields["head"] == "mlm" else ACTS[act],  # the generator's head: GELU whatever hidden_act
        cls_act="gelu", pooler=False, pad_token_id=hf.get("pad_token_id") or 0, **fields,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "electra.")
    ignore = _IGNORE + ([r"^generator_lm_head\.weight$"] if cfg.tie_embeddings else [])  # a copy of the embeddings
    return rename(tensors, _BODY + _HEADS[cfg.head], ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _BODY + _HEADS[cfg.head], reverse=True)
    if cfg.head == "none":
        return hf  # ElectraModel: no prefix
    return {(k if k.startswith(_HEAD_KEYS) else f"electra.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    plain = {k: v for k, v in PLAIN_OPTIONS.items() if k != "cls_act"}
    why = mismatch(cfg, arch="encoder", norm="layernorm", norm_placement="post", bias=True, norm_bias=True,
                   embed_norm=True, position="learned", position_offset=0, share_layers=False, attn_scale=None,
                   tied_logit_scale=False, pooler=False, **plain)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head not in _ARCHS or cfg.token_types < 1:
        return f"needs head 'rtd', 'mlm', 'none' or a task head, and token_types >= 1 (got head={cfg.head!r})"
    if cfg.head == "mlm" and cfg.head_act != "gelu":
        return f"the generator's MLM head activation is gelu, got head_act={cfg.head_act!r}"
    if cfg.head == "rtd" and cfg.head_act != cfg.ffn:
        return (f"the discriminator head's activation is hidden_act, the FFN's ({cfg.ffn}), got "
                f"head_act={cfg.head_act!r}")
    if cfg.head in ("classification", "regression") and (cfg.sentence_pooling, cfg.cls_act) != ("cls", "gelu"):
        return ("ElectraForSequenceClassification classifies dense + gelu on the first token (pooling='cls', "
                f"cls_act='gelu'), got pooling={cfg.sentence_pooling!r}, cls_act={cfg.cls_act!r}")
    return task_mismatch(cfg, _TASK_ARCHS, "cls") if cfg.head in _TASK_ARCHS else None


def config_to_hf(cfg: ModelConfig) -> dict:
    task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head]) if cfg.head in _TASK_ARCHS else {}
    return {
        "architectures": task.pop("architectures", [_ARCHS[cfg.head]]), "model_type": "electra",
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_dim, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.ffn_dim,
        "hidden_act": _ACT_NAMES[cfg.ffn], "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout, "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.token_types, "layer_norm_eps": cfg.norm_eps, "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_embeddings, **task,
    }
