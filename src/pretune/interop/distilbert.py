"""DistilBERT (DistilBertModel / DistilBertForMaskedLM, and DistilBertForSequenceClassification /
ForTokenClassification / ForQuestionAnswering).

A BERT without token types and without a pooler (Sanh et al. 2019): post-norm blocks, learned positions, every
LayerNorm with eps 1e-12 whatever the config says. Quirks: the MLM head is vocab_transform + ``activation`` (the FFN's)
+ vocab_layer_norm + vocab_projector, whose weight is tied to the word embeddings and whose bias is the head's;
DistilBertForSequenceClassification classifies [CLS] through pre_classifier + ReLU (our pooling "cls" with
cls_act="relu"; HF has no dropout before pre_classifier, ours has one: training-time only); ``sinusoidal_pos_embds``
tables are stored in the checkpoint (and trained, in transformers 5), so they import as a learned table holding those
values (exact), and a pretune model with sinusoidal positions exports its table with ``sinusoidal_pos_embds=True``.
DistilBertForQuestionAnswering applies dropout (qa_dropout) before qa_outputs in training; pretune's QA head has none.
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

MODEL_TYPES = ("distilbert",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES
EPS = 1e-12  # DistilBERT's LayerNorms are built with eps=1e-12, not from the config

_BODY = [
    ("embeddings.word_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.position_embeddings.weight", "transformer.encoder.position.weight"),
    ("embeddings.LayerNorm", "transformer.encoder.embed_norm"),
    ("transformer.layer.{}.attention.q_lin", "transformer.encoder.layers.{}.attn.q_proj"),
    ("transformer.layer.{}.attention.k_lin", "transformer.encoder.layers.{}.attn.k_proj"),
    ("transformer.layer.{}.attention.v_lin", "transformer.encoder.layers.{}.attn.v_proj"),
    ("transformer.layer.{}.attention.out_lin", "transformer.encoder.layers.{}.attn.o_proj"),
    ("transformer.layer.{}.sa_layer_norm", "transformer.encoder.layers.{}.attn_norm"),
    ("transformer.layer.{}.ffn.lin1", "transformer.encoder.layers.{}.ffn.up_proj"),
    ("transformer.layer.{}.ffn.lin2", "transformer.encoder.layers.{}.ffn.down_proj"),
    ("transformer.layer.{}.output_layer_norm", "transformer.encoder.layers.{}.ffn_norm"),
]
_HEADS = {
    "mlm": [("vocab_transform", "head.dense"), ("vocab_layer_norm", "head.norm"),
            ("vocab_projector.bias", "head.bias"), ("vocab_projector.weight", "head.weight")],  # weight: untied only
    "classification": [("pre_classifier", "head.dense"), ("classifier", "head.out")],
    "tagging": [("classifier", "head.out")],
    "qa": [("qa_outputs", "head.out")],
}
_HEADS["regression"] = _HEADS["classification"]
_TASK_ARCHS = {"classification": "DistilBertForSequenceClassification",
               "regression": "DistilBertForSequenceClassification",
               "tagging": "DistilBertForTokenClassification", "qa": "DistilBertForQuestionAnswering"}
_OWN_HEADS = ("vocab_", "pre_classifier.", "classifier.", "qa_outputs.")  # tensors outside the distilbert. body
_IGNORE = [r"^embeddings\.position_ids$"]
SEQ_DROPOUT = 0.2  # DistilBertConfig.seq_classif_dropout's default


def _guess_arch(keys: set[str]) -> str | None:
    """The task class a folder without ``architectures`` holds, from its head tensors."""
    if "qa_outputs.weight" in keys:
        return "DistilBertForQuestionAnswering"
    if "pre_classifier.weight" in keys:
        return "DistilBertForSequenceClassification"
    if "classifier.weight" in keys:
        return "DistilBertForTokenClassification"
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    act = hf.get("activation", "gelu")
    if act not in ACTS:
        raise InteropError(f"activation={act!r} is not supported; expected one of {sorted(ACTS)}")
    if hf.get("sinusoidal_pos_embds") and "distilbert.embeddings.position_embeddings.weight" not in keys \
            and "embeddings.position_embeddings.weight" not in keys:
        raise InteropError("sinusoidal_pos_embds=True but the folder stores no position table "
                           "(embeddings.position_embeddings.weight)")
    task = task_fields(hf, arch) if arch else {"head": "mlm" if "vocab_transform.weight" in keys else "none"}
    # [CLS] -> pre_classifier -> ReLU -> dropout -> classifier, recorded on every DistilBERT (a classifier added later
    # is DistilBERT's)
    task["cls_act"] = "relu"
    if task["head"] in ("classification", "regression"):
        task.update(pooling="cls", classifier_dropout=hf.get("seq_classif_dropout", SEQ_DROPOUT))
    else:
        task["classifier_dropout"] = None  # token heads use `dropout`; pretune's QA head has no dropout
    dim = hf.get("dim", hf.get("hidden_size", 768))
    return ModelConfig(
        arch="encoder", vocab_size=hf["vocab_size"], dim=dim, n_layers=hf.get("n_layers", 6),
        n_heads=hf.get("n_heads", 12), ffn_dim=hf.get("hidden_dim", 4 * dim),
        max_seq_len=hf.get("max_position_embeddings", 512), ffn=ACTS[act], norm="layernorm", norm_eps=EPS,
        norm_placement="post", bias=True, embed_norm=True, dropout=hf.get("dropout", 0.1),
        attn_dropout=hf.get("attention_dropout", 0.1), position="learned", token_types=0,
        tie_embeddings=hf.get("tie_word_embeddings", True), head_act=ACTS[act], pooler=False,
        pad_token_id=hf.get("pad_token_id") or 0, **task,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = strip_prefix(tensors, "distilbert.")
    ignore = _IGNORE + ([r"^vocab_projector\.weight$"] if cfg.tie_embeddings else [])  # a tied copy
    return rename(tensors, _BODY + _HEADS.get(cfg.head, []), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    ours = dict(ours)
    if cfg.position == "sinusoidal":  # pretune computes the table; DistilBERT stores it
        from ..model.position import SinusoidalPositions

        table = SinusoidalPositions(cfg, causal=False)._table(cfg.max_seq_len)
        ours["transformer.encoder.position.weight"] = table
    hf = rename(ours, _BODY + _HEADS.get(cfg.head, []), reverse=True)
    return {(k if k.startswith(_OWN_HEADS) else f"distilbert.{k}"): v for k, v in hf.items()}


def export_mismatch(cfg: ModelConfig) -> str | None:
    plain = {k: v for k, v in PLAIN_OPTIONS.items() if k != "cls_act"}  # checked below for a classification head
    why = mismatch(cfg, arch="encoder", norm="layernorm", norm_placement="post", bias=True, norm_bias=True,
                   embed_norm=True, token_types=0, position_offset=0, embed_dim=None, share_layers=False,
                   attn_scale=None, tied_logit_scale=False, pooler=False, norm_eps=EPS, **plain)
    if why:
        return why
    if cfg.position not in ("learned", "sinusoidal"):
        return f"needs position 'learned' or 'sinusoidal', got {cfg.position!r}"
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, relu, gelu_tanh, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head not in ("mlm", "none", *_TASK_ARCHS):
        return f"needs head 'mlm', 'none' or a task head, got head={cfg.head!r}"
    if cfg.head == "mlm" and cfg.head_act != cfg.ffn:
        return f"the MLM head activation must be the FFN's ({cfg.ffn}), got head_act={cfg.head_act!r}"
    if cfg.head in ("classification", "regression") and cfg.sentence_pooling == "cls" and cfg.cls_act != "relu":
        return f"DistilBertForSequenceClassification puts a ReLU after its pre_classifier, got cls_act={cfg.cls_act!r}"
    if cfg.head in _TASK_ARCHS:
        return task_mismatch(cfg, _TASK_ARCHS, "cls")
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    arch = "DistilBertForMaskedLM" if cfg.head == "mlm" else "DistilBertModel"
    task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head]) if cfg.head in _TASK_ARCHS else {}
    dropout = task.pop("classifier_dropout", None)
    seq_dropout = cfg.dropout if dropout is None else dropout
    return {
        "architectures": task.pop("architectures", [arch]), "model_type": "distilbert",
        "vocab_size": cfg.vocab_size, "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
        "hidden_dim": cfg.ffn_dim, "activation": _ACT_NAMES[cfg.ffn], "dropout": cfg.dropout,
        "attention_dropout": cfg.attn_dropout, "max_position_embeddings": cfg.max_seq_len,
        "sinusoidal_pos_embds": cfg.position == "sinusoidal", "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_embeddings, "qa_dropout": 0.0,
        "seq_classif_dropout": seq_dropout if cfg.head in ("classification", "regression") else SEQ_DROPOUT, **task,
    }
