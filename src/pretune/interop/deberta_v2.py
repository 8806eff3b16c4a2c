"""DeBERTa-v2 and v3 (DebertaV2Model, DebertaV2ForMaskedLM, and the *ForSequenceClassification /
*ForTokenClassification / *ForQuestionAnswering task heads).

Quirks: BERT's post-norm body without absolute positions; every layer's attention adds DeBERTa's disentangled
content-to-position and position-to-content terms (our position "disentangled": log-bucketed relative distances,
one LayerNorm'd table of relative embeddings in the encoder, projected by each layer's own query and key
projections, scale 1/sqrt(3 Dh)). Supported: the v3 settings (relative_attention, pos_att_type p2c and c2p,
share_att_key, norm_rel_ebd layer_norm, position_biased_input false), with or without position buckets and token
types; refused: the v2-xlarge convolution (conv_kernel_size), separate position projections (share_att_key
false), absolute positions, embedding_size != hidden_size. The masked-LM head comes in two layouts: the legacy
``cls.predictions`` (transform dense + LayerNorm, decoder tied to the embeddings with its own bias) and, with
``legacy: false``, ``lm_predictions.lm_head`` (the layout of Microsoft's released checkpoints, always tied); both
import, the legacy one is exported. The RTD head of the v3 checkpoints (``mask_predictions``) is dropped, as
transformers drops it. DebertaV2ForSequenceClassification's ContextPooler is dense + pooler_hidden_act on the first
token (our pooling "cls" with cls_act; its pooler_dropout before the dense becomes our classifier dropout, which
only matters in training); imported DeBERTa bodies record cls_act (gelu), so a classifier added later is DeBERTa's.
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

MODEL_TYPES = ("deberta-v2",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES
POOLER_ACTS = {**ACTS, "tanh": "tanh"}  # pooler_hidden_act -> cls_act
_POOLER_ACT_NAMES = {**_ACT_NAMES, "tanh": "tanh"}

_BODY = [
    ("embeddings.word_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.token_type_embeddings.weight", "transformer.encoder.token_type.weight"),
    ("embeddings.LayerNorm", "transformer.encoder.embed_norm"),
    ("encoder.layer.{}.attention.self.query_proj", "transformer.encoder.layers.{}.attn.q_proj"),
    ("encoder.layer.{}.attention.self.key_proj", "transformer.encoder.layers.{}.attn.k_proj"),
    ("encoder.layer.{}.attention.self.value_proj", "transformer.encoder.layers.{}.attn.v_proj"),
    ("encoder.layer.{}.attention.output.dense", "transformer.encoder.layers.{}.attn.o_proj"),
    ("encoder.layer.{}.attention.output.LayerNorm", "transformer.encoder.layers.{}.attn_norm"),
    ("encoder.layer.{}.intermediate.dense", "transformer.encoder.layers.{}.ffn.up_proj"),
    ("encoder.layer.{}.output.dense", "transformer.encoder.layers.{}.ffn.down_proj"),
    ("encoder.layer.{}.output.LayerNorm", "transformer.encoder.layers.{}.ffn_norm"),
    ("encoder.rel_embeddings", "transformer.encoder.position.rel_embed"),
    ("encoder.LayerNorm", "transformer.encoder.position.rel_norm"),
]
_MLM_LEGACY = [("cls.predictions.transform.dense", "head.dense"),
               ("cls.predictions.transform.LayerNorm", "head.norm"),
               ("cls.predictions.bias", "head.bias"),
               ("cls.predictions.decoder.weight", "head.weight")]  # only when untied
_MLM = [("lm_predictions.lm_head.dense", "head.dense"), ("lm_predictions.lm_head.LayerNorm", "head.norm"),
        ("lm_predictions.lm_head.bias", "head.bias")]  # the decoder is the word embeddings
_TASK_HEADS = {
    "classification": [("pooler.dense", "head.dense"), ("classifier", "head.out")],
    "regression": [("pooler.dense", "head.dense"), ("classifier", "head.out")],
    "tagging": [("classifier", "head.out")],
    "qa": [("qa_outputs", "head.out")],
}
_TASK_ARCHS = {"classification": "DebertaV2ForSequenceClassification",
               "regression": "DebertaV2ForSequenceClassification",
               "tagging": "DebertaV2ForTokenClassification", "qa": "DebertaV2ForQuestionAnswering"}
_HEAD_KEYS = ("cls.", "lm_predictions.", "pooler.", "classifier.", "qa_outputs.")
# Buffers and what transformers drops too: position ids, absolute position tables of a position_biased_input=false
# model, the v3 RTD head.
_IGNORE = [r"^embeddings\.position_ids$", r"^embeddings\.position_embeddings\.", r"^mask_predictions\."]


def _guess_arch(keys: set[str]) -> str | None:
    """The task class a folder without ``architectures`` holds, from its head tensors."""
    if "qa_outputs.weight" in keys:
        return "DebertaV2ForQuestionAnswering"
    if "classifier.weight" in keys:
        return f"DebertaV2For{'Sequence' if 'pooler.dense.weight' in keys else 'Token'}Classification"
    return None


def _terms(hf: dict) -> set[str]:
    value = hf.get("pos_att_type") or []
    if isinstance(value, str):
        value = value.lower().split("|")
    return {str(x).strip() for x in value}


def _refuse_unsupported(hf: dict) -> None:
    """InteropError naming the first DeBERTa setting pretune's disentangled attention does not model."""
    dim = hf.get("hidden_size", 1536)
    heads = hf.get("num_attention_heads", 24)
    checks = [
        ("relative_attention", hf.get("relative_attention", False), True,
         "DeBERTa without relative attention is not supported"),
        ("position_biased_input", hf.get("position_biased_input", True), False,
         "absolute position embeddings beside the relative ones are not supported"),
        ("pos_att_type", sorted(_terms(hf)), ["c2p", "p2c"], "both terms are needed"),
        ("share_att_key", hf.get("share_att_key", False), True,
         "separate position projections (pos_key_proj, pos_query_proj) are not supported"),
        ("norm_rel_ebd", str(hf.get("norm_rel_ebd", "none")).strip().lower(), "layer_norm",
         "the relative embeddings must be LayerNorm'd (DeBERTa-v3)"),
        ("conv_kernel_size", hf.get("conv_kernel_size", 0) or 0, 0,
         "the convolution beside the first layer (DeBERTa-v2 xlarge/xxlarge) is not supported"),
        ("embedding_size", hf.get("embedding_size", dim) or dim, dim,
         "a projected embedding (embedding_size != hidden_size) is not supported"),
        ("attention_head_size", hf.get("attention_head_size", dim // heads), dim // heads,
         "heads must split hidden_size"),
        ("pooler_hidden_size", hf.get("pooler_hidden_size", dim), dim, "the pooler must be hidden_size wide"),
    ]
    for key, got, want, why in checks:
        if got != want:
            raise InteropError(f"{key}={got!r} is not supported (expected {want!r}: {why})")


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    names = {k[len("deberta."):] if k.startswith("deberta.") else k for k in keys}
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(names))
    _refuse_unsupported(hf)
    act = hf.get("hidden_act", "gelu")
    if act not in ACTS:
        raise InteropError(f"hidden_act={act!r} is not supported; expected one of {sorted(ACTS)}")
    pooler_act = hf.get("pooler_hidden_act", "gelu")
    if pooler_act not in POOLER_ACTS:
        raise InteropError(f"pooler_hidden_act={pooler_act!r} is not supported; expected one of "
                           f"{sorted(POOLER_ACTS)}")
    max_position = hf.get("max_position_embeddings", 512)
    max_relative = hf.get("max_relative_positions", -1)
    buckets = hf.get("position_buckets", -1)
    tied = hf.get("tie_word_embeddings", True)
    if arch:
        task = task_fields(hf, arch)
        task["classifier_dropout"] = hf.get("cls_dropout")
        if task["head"] in ("classification", "regression"):
            task["pooling"] = "cls"
    elif any(k.startswith("lm_predictions.") for k in names):
        task, tied = {"head": "mlm"}, True  # this head multiplies by the word embeddings whatever the config says
    elif any(k.startswith("cls.predictions.") for k in names):
        task = {"head": "mlm"}
    else:
        task = {"head": "none"}
    return ModelConfig(
        arch="encoder", vocab_size=hf.get("vocab_size", 128100), dim=hf.get("hidden_size", 1536),
        n_layers=hf.get("num_hidden_layers", 24), n_heads=hf.get("num_attention_heads", 24),
        ffn_dim=hf.get("intermediate_size", 6144), max_seq_len=max_position, ffn=ACTS[act], norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-7), norm_placement="post", bias=True, embed_norm=True,
        dropout=hf.get("hidden_dropout_prob", 0.1), attn_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        position="disentangled", position_buckets=max(buckets, 0),
        max_relative_positions=max_relative if max_relative >= 1 else max_position,
        token_types=hf.get("type_vocab_size", 0), tie_embeddings=tied, head_act=ACTS[act],
        cls_act=POOLER_ACTS[pooler_act], pooler=False, pad_token_id=hf.get("pad_token_id") or 0, **task,
    )


def _head_table(cfg: ModelConfig, names: set[str] = frozenset()) -> list[tuple[str, str]]:
    if cfg.head == "mlm":
        return _MLM if any(k.startswith("lm_predictions.") for k in names) else _MLM_LEGACY
    return _TASK_HEADS.get(cfg.head, [])


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "deberta.")
    if cfg.tie_embeddings:  # tied copies of the embeddings and of cls.predictions.bias
        ignore = _IGNORE + [r"^cls\.predictions\.decoder\.(weight|bias)$"]
    else:  # an untied legacy decoder has its own bias, the one it adds; transformers then leaves cls.predictions.bias
        ignore = _IGNORE  # unused, and so do we
        tensors = {("cls.predictions.bias" if k == "cls.predictions.decoder.bias" else k): v
                   for k, v in tensors.items() if k != "cls.predictions.bias"}
    return rename(tensors, _BODY + _head_table(cfg, set(tensors)), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _BODY + _head_table(cfg), reverse=True)
    if cfg.head == "none":
        return hf  # DebertaV2Model: no prefix
    if cfg.head == "mlm":  # the legacy decoder's bias: tied to cls.predictions.bias, or its own when untied
        hf["cls.predictions.decoder.bias"] = hf["cls.predictions.bias"].clone()
    return {(k if k.startswith(_HEAD_KEYS) else f"deberta.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    plain = {k: v for k, v in PLAIN_OPTIONS.items() if k != "cls_act"}  # the classification head sets its own
    why = mismatch(cfg, arch="encoder", norm="layernorm", norm_placement="post", bias=True, norm_bias=True,
                   embed_norm=True, position="disentangled", embed_dim=None, share_layers=False, attn_scale=None,
                   tied_logit_scale=False, pooler=False, **plain)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.dh * cfg.n_heads != cfg.dim:
        return "needs head_dim = dim / n_heads"
    if cfg.head not in ("mlm", "none", *_TASK_ARCHS):
        return f"needs head 'mlm', 'none' or a task head, got head={cfg.head!r}"
    if cfg.head == "mlm" and cfg.head_act != cfg.ffn:
        return f"the MLM head's activation is hidden_act, the FFN's ({cfg.ffn}), got head_act={cfg.head_act!r}"
    if cfg.head in _TASK_ARCHS:
        return task_mismatch(cfg, _TASK_ARCHS, "cls")
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head]) if cfg.head in _TASK_ARCHS else {}
    drop = task.pop("classifier_dropout", None)
    if drop is not None:
        task["cls_dropout"] = drop
    p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
    arch = "DebertaV2ForMaskedLM" if cfg.head == "mlm" else "DebertaV2Model"
    return {
        "architectures": task.pop("architectures", [arch]), "model_type": "deberta-v2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.ffn_dim, "hidden_act": _ACT_NAMES[cfg.ffn],
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.token_types,
        "layer_norm_eps": cfg.norm_eps, "pad_token_id": cfg.pad_token_id, "relative_attention": True,
        "max_relative_positions": cfg.max_relative_positions, "position_buckets": cfg.position_buckets or -1,
        "position_biased_input": False, "pos_att_type": ["p2c", "c2p"], "share_att_key": True,
        "norm_rel_ebd": "layer_norm", "pooler_hidden_size": cfg.dim,
        "pooler_hidden_act": _POOLER_ACT_NAMES[cfg.cls_act], "pooler_dropout": p, "legacy": True,
        "tie_word_embeddings": cfg.tie_embeddings, **task,
    }
