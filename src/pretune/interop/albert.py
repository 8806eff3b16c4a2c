"""ALBERT (AlbertModel, AlbertForMaskedLM, AlbertForPreTraining, and the *ForSequenceClassification /
*ForTokenClassification / *ForQuestionAnswering task heads).

Quirks: BERT's post-norm body with factorised embeddings (``embedding_size`` wide, then
``encoder.embedding_hidden_mapping_in`` to the hidden size: our ``embed_dim`` + ``Stack.embed_proj``) and one
layer shared across depth (``num_hidden_groups=1, inner_group_num=1``: our ``share_layers``; the group/inner
layouts no published checkpoint uses are refused). The MLM head projects to ``embedding_size`` with hidden_act
(gelu_new in v2) and a LayerNorm, then a decoder tied to the embeddings with its own bias (our "mlm" head with
head_act = the FFN's). The pooler is a bare ``albert.pooler`` Linear (+ tanh). AlbertForPreTraining adds the
sentence-order head ``sop_classifier.classifier`` on the pooled output (our ``pair_head``);
AlbertForSequenceClassification classifies the pooler output (our pooling "pooler"); the token and QA classes have
no pooler. AlbertForMultipleChoice is refused.
"""

from __future__ import annotations

import torch

from ..config import TASK_HEADS, ConfigError, ModelConfig
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

MODEL_TYPES = ("albert",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES

_LAYER = "encoder.albert_layer_groups.{}.albert_layers.0"  # group g holds layer g (one group: the shared layer)
_BODY = [
    ("embeddings.word_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.position_embeddings.weight", "transformer.encoder.position.weight"),
    ("embeddings.token_type_embeddings.weight", "transformer.encoder.token_type.weight"),
    ("embeddings.LayerNorm", "transformer.encoder.embed_norm"),
    ("encoder.embedding_hidden_mapping_in", "transformer.encoder.embed_proj"),
    (f"{_LAYER}.attention.query", "transformer.encoder.layers.{}.attn.q_proj"),
    (f"{_LAYER}.attention.key", "transformer.encoder.layers.{}.attn.k_proj"),
    (f"{_LAYER}.attention.value", "transformer.encoder.layers.{}.attn.v_proj"),
    (f"{_LAYER}.attention.dense", "transformer.encoder.layers.{}.attn.o_proj"),
    (f"{_LAYER}.attention.LayerNorm", "transformer.encoder.layers.{}.attn_norm"),
    (f"{_LAYER}.ffn", "transformer.encoder.layers.{}.ffn.up_proj"),
    (f"{_LAYER}.ffn_output", "transformer.encoder.layers.{}.ffn.down_proj"),
    (f"{_LAYER}.full_layer_layer_norm", "transformer.encoder.layers.{}.ffn_norm"),
    ("pooler", "pooler.dense"),
]
_MLM = [("predictions.dense", "head.dense"), ("predictions.LayerNorm", "head.norm")]
# the decoder's bias: tied, transformers overwrites predictions.decoder.bias with predictions.bias; untied, the two
# are separate and the decoder's own is the one its forward adds (predictions.bias is then left unused)
_MLM_TIED = [("predictions.bias", "head.bias")]
_MLM_UNTIED = [("predictions.decoder.bias", "head.bias"), ("predictions.decoder.weight", "head.weight")]
_SOP = [("sop_classifier.classifier", "pair_head")]
_TASK_HEADS = {"classification": [("classifier", "head.out")], "regression": [("classifier", "head.out")],
               "tagging": [("classifier", "head.out")], "qa": [("qa_outputs", "head.out")]}
_TASK_ARCHS = {"classification": "AlbertForSequenceClassification",
               "regression": "AlbertForSequenceClassification",
               "tagging": "AlbertForTokenClassification", "qa": "AlbertForQuestionAnswering"}
_HEAD_KEYS = ("predictions.", "sop_classifier.", "classifier.", "qa_outputs.")
# buffers older files may hold (position ids, the default token types)
_IGNORE = [r"^embeddings\.position_ids$", r"^embeddings\.token_type_ids$"]


def _guess_arch(keys: set[str]) -> str | None:
    """The task class a folder without ``architectures`` holds, from its head tensors."""
    if "qa_outputs.weight" in keys:
        return "AlbertForQuestionAnswering"
    if "classifier.weight" in keys:
        pooled = any(k.endswith("pooler.weight") for k in keys)
        return f"AlbertFor{'Sequence' if pooled else 'Token'}Classification"
    return None


def _int(hf: dict, key: str, default: int) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InteropError(f"{key}={value!r} must be a positive integer")
    return value


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    groups, inner = hf.get("num_hidden_groups", 1), hf.get("inner_group_num", 1)
    if groups != 1 or inner != 1:
        raise InteropError(f"num_hidden_groups={groups!r}, inner_group_num={inner!r} is not supported: only one layer "
                           "shared across depth (num_hidden_groups=1, inner_group_num=1, as every published ALBERT)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise InteropError(f"position_embedding_type={hf['position_embedding_type']!r} is not supported "
                           "(absolute only)")
    act = hf.get("hidden_act", "gelu_new")
    if act not in ACTS:
        raise InteropError(f"hidden_act={act!r} is not supported; expected one of {sorted(ACTS)}")
    dim, embed = _int(hf, "hidden_size", 4096), _int(hf, "embedding_size", 128)
    if embed == dim:
        raise InteropError(f"embedding_size={embed} equal to hidden_size is not supported (pretune projects "
                           "factorised embeddings only when they are narrower or wider than the model)")
    names = {k[len("albert."):] if k.startswith("albert.") else k for k in keys}
    has_pooler = "pooler.weight" in names
    if arch:
        fields = task_fields(hf, arch)
        if fields["head"] in ("classification", "regression"):
            fields["pooling"] = "pooler"
            if not has_pooler:
                raise InteropError(f"{arch} needs the pooler tensors (albert.pooler.*), none found")
    else:
        mlm = any(k.startswith("predictions.") for k in names)
        fields = {"head": "mlm" if mlm else "none"}
        if mlm and any(k.startswith("sop_classifier.") for k in names):  # AlbertForPreTraining
            if not has_pooler:
                raise InteropError("the sentence-order head (sop_classifier.*) needs the pooler tensors "
                                   "(albert.pooler.*), none found")
            fields["pair_head"] = True
    drop = hf.get("hidden_dropout_prob", 0.0)
    classifier_drop = hf.get("classifier_dropout_prob", 0.1)
    try:
        return ModelConfig(
            arch="encoder", vocab_size=_int(hf, "vocab_size", 30000), dim=dim,
            n_layers=_int(hf, "num_hidden_layers", 12), n_heads=_int(hf, "num_attention_heads", 64),
            ffn_dim=_int(hf, "intermediate_size", 16384), max_seq_len=_int(hf, "max_position_embeddings", 512),
            ffn=ACTS[act], norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
            bias=True, embed_norm=True, dropout=drop, attn_dropout=hf.get("attention_probs_dropout_prob", 0.0),
            position="learned", token_types=hf.get("type_vocab_size", 2), embed_dim=embed, share_layers=True,
            tie_embeddings=hf.get("tie_word_embeddings", True), head_act=ACTS[act], pooler=has_pooler,
            pad_token_id=hf.get("pad_token_id") or 0,
            **{**fields, "classifier_dropout": None if classifier_drop in (None, drop) else classifier_drop},
        )
    except ConfigError as e:
        raise InteropError(f"config.json does not describe a model pretune can build: {e}") from None


def _head_table(cfg: ModelConfig) -> list[tuple[str, str]]:
    if cfg.head == "mlm":
        return _MLM + (_MLM_TIED if cfg.tie_embeddings else _MLM_UNTIED) + (_SOP if cfg.pair_head else [])
    return _TASK_HEADS.get(cfg.head, [])


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "albert.")
    ignore = list(_IGNORE)
    if cfg.head == "mlm":  # the tied copies (the word embeddings, the bias), or the unused predictions.bias
        ignore += [r"^predictions\.decoder\.(weight|bias)$"] if cfg.tie_embeddings else [r"^predictions\.bias$"]
    if not cfg.pair_head:  # the pretraining SOP head beside a body or a task head: transformers drops it too
        ignore.append(r"^sop_classifier\.")
    return rename(tensors, _BODY + _head_table(cfg), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # only AlbertForSequenceClassification (of the task classes) has a pooler; the others would not load it
    drop_pooler = cfg.head in ("tagging", "qa")
    hf = rename(ours, _BODY + _head_table(cfg), reverse=True, ignore=[r"^pooler\."] if drop_pooler else [])
    if cfg.head == "none":
        return hf  # AlbertModel: no prefix
    if cfg.head == "mlm":  # both bias names hold the head's bias (one tensor in transformers when tied)
        bias = hf["predictions.bias" if cfg.tie_embeddings else "predictions.decoder.bias"]
        hf["predictions.bias"], hf["predictions.decoder.bias"] = bias, bias.clone()
    return {(k if k.startswith(_HEAD_KEYS) else f"albert.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    plain = {k: v for k, v in PLAIN_OPTIONS.items() if k != "pair_head"}
    why = mismatch(cfg, arch="encoder", share_layers=True, norm="layernorm", norm_placement="post", bias=True,
                   norm_bias=True, embed_norm=True, position="learned", position_offset=0, attn_scale=None,
                   tied_logit_scale=False, **plain)
    if why:
        return why
    if cfg.embedding_dim == cfg.dim:
        return "needs factorised embeddings (embed_dim different from dim)"
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head not in ("mlm", "none", *TASK_HEADS) or cfg.token_types < 1:
        return f"needs head 'mlm', 'none' or a task head, and token_types >= 1 (got head={cfg.head!r})"
    if cfg.head == "mlm" and cfg.head_act != cfg.ffn:
        return f"the MLM head's activation is hidden_act, the FFN's ({cfg.ffn}), got head_act={cfg.head_act!r}"
    if cfg.head in TASK_HEADS:
        return task_mismatch(cfg, _TASK_ARCHS, "pooler")
    return None


def _arch(cfg: ModelConfig) -> str:
    if cfg.head == "mlm":
        return "AlbertForPreTraining" if cfg.pair_head else "AlbertForMaskedLM"
    return "AlbertModel"


def config_to_hf(cfg: ModelConfig) -> dict:
    task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head]) if cfg.head in _TASK_ARCHS else {}
    task.pop("classifier_dropout", None)  # ALBERT's key is classifier_dropout_prob (below)
    return {
        "architectures": task.pop("architectures", [_arch(cfg)]), "model_type": "albert",
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.embedding_dim, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_hidden_groups": 1, "inner_group_num": 1,
        "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.ffn_dim, "hidden_act": _ACT_NAMES[cfg.ffn],
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attn_dropout,
        "classifier_dropout_prob": cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout,
        "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.token_types,
        "layer_norm_eps": cfg.norm_eps, "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_embeddings,
        **task,
    }
