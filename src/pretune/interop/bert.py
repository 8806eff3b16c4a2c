"""BERT and RoBERTa (BertModel/BertForMaskedLM, RobertaModel/RobertaForMaskedLM, and the
*ForSequenceClassification / *ForTokenClassification / *ForQuestionAnswering task heads).

Quirks: post-norm; RoBERTa position ids start at padding_idx + 1 (position_offset) and its
MLM head is called lm_head; the MLM decoder weight is tied to the word embeddings and its
bias is the same tensor as cls.predictions.bias. BertForSequenceClassification classifies the
pooler output (our pooling "pooler"); RobertaForSequenceClassification has no pooler and uses
dense + tanh on <s> (our pooling "cls"). The token and QA classes have no pooler: exporting a
model with one to them leaves the (unused) pooler out.
"""

from __future__ import annotations

import re

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

MODEL_TYPES = ("bert", "roberta")

ACTS = HF_ACTS

_BODY = [
    ("embeddings.word_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.position_embeddings.weight", "transformer.encoder.position.weight"),
    ("embeddings.token_type_embeddings.weight", "transformer.encoder.token_type.weight"),
    ("embeddings.LayerNorm", "transformer.encoder.embed_norm"),
    ("encoder.layer.{}.attention.self.query", "transformer.encoder.layers.{}.attn.q_proj"),
    ("encoder.layer.{}.attention.self.key", "transformer.encoder.layers.{}.attn.k_proj"),
    ("encoder.layer.{}.attention.self.value", "transformer.encoder.layers.{}.attn.v_proj"),
    ("encoder.layer.{}.attention.output.dense", "transformer.encoder.layers.{}.attn.o_proj"),
    ("encoder.layer.{}.attention.output.LayerNorm", "transformer.encoder.layers.{}.attn_norm"),
    ("encoder.layer.{}.intermediate.dense", "transformer.encoder.layers.{}.ffn.up_proj"),
    ("encoder.layer.{}.output.dense", "transformer.encoder.layers.{}.ffn.down_proj"),
    ("encoder.layer.{}.output.LayerNorm", "transformer.encoder.layers.{}.ffn_norm"),
    ("pooler.dense", "pooler.dense"),
]
_HEADS = {
    "bert": [("cls.predictions.transform.dense", "head.dense"),
             ("cls.predictions.transform.LayerNorm", "head.norm")],
    "roberta": [("lm_head.dense", "head.dense"), ("lm_head.layer_norm", "head.norm")],
}
_HEAD_OUT = {"bert": "cls.predictions.", "roberta": "lm_head."}  # where the output bias and decoder live
_TASK_HEADS = {
    "bert": {"classification": [("classifier", "head.out")], "tagging": [("classifier", "head.out")],
             "qa": [("qa_outputs", "head.out")]},
    "roberta": {"classification": [("classifier.dense", "head.dense"), ("classifier.out_proj", "head.out")],
                "tagging": [("classifier", "head.out")], "qa": [("qa_outputs", "head.out")]},
}
_TASK_ARCHS = {mt: {"classification": f"{name}ForSequenceClassification",
                    "regression": f"{name}ForSequenceClassification",
                    "tagging": f"{name}ForTokenClassification", "qa": f"{name}ForQuestionAnswering"}
               for mt, name in (("bert", "Bert"), ("roberta", "Roberta"))}
_SEQ_POOLING = {"bert": "pooler", "roberta": "cls"}  # what each *ForSequenceClassification classifies
# Redundant buffers and BERT's NSP head (no NSP head in this model yet); _mlm_table says which copies of the output
# bias and decoder weight an MLM head ignores.
_IGNORE = [r"^embeddings\.position_ids$", r"^cls\.seq_relationship\."]


def _model_type(cfg: ModelConfig) -> str:
    return "roberta" if cfg.position_offset else "bert"


def _mlm_table(mt: str, tied: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """The MLM head's names and the names an import ignores. Tied (the usual case), transformers makes the decoder's
    weight the word embeddings and its bias the head's ``bias``: both decoder tensors are copies. Untied, the
    decoder's own weight and bias are what its forward uses, and the head's ``bias`` is left unused."""
    out = _HEAD_OUT[mt]
    if tied:
        return _HEADS[mt] + [(f"{out}bias", "head.bias")], [rf"^{re.escape(out)}decoder\.(weight|bias)$"]
    return (_HEADS[mt] + [(f"{out}decoder.bias", "head.bias"), (f"{out}decoder.weight", "head.weight")],
            [rf"^{re.escape(out)}bias$"])


def _head_table(cfg: ModelConfig) -> list[tuple[str, str]]:
    mt = _model_type(cfg)
    if cfg.head == "mlm":
        return _mlm_table(mt, cfg.tie_embeddings)[0]
    return _TASK_HEADS[mt].get("classification" if cfg.head == "regression" else cfg.head, [])


def _guess_arch(mt: str, keys: set[str]) -> str | None:
    """The task class a folder without ``architectures`` holds, from its head tensors."""
    name = {"bert": "Bert", "roberta": "Roberta"}[mt]
    if "qa_outputs.weight" in keys:
        return f"{name}ForQuestionAnswering"
    if "classifier.out_proj.weight" in keys:
        return f"{name}ForSequenceClassification"
    if "classifier.weight" in keys:
        pooled = mt == "bert" and any(k.endswith("pooler.dense.weight") for k in keys)
        return f"{name}For{'Sequence' if pooled else 'Token'}Classification"
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    mt = hf["model_type"]
    causal = [a for a in hf.get("architectures") or [] if a.endswith(("LMHeadModel", "ForCausalLM"))]
    if hf.get("is_decoder") or causal:  # same tensors as the masked LM: it would load, attending both ways
        what = causal[0] if causal else f"is_decoder=true ({mt})"
        raise InteropError(f"{what} is not supported: {mt} checkpoints import as bidirectional encoders, and this one "
                           "was trained to attend causally (is_decoder); load a decoder family (GPT-2, Llama, ...) "
                           "or the masked-LM / encoder checkpoint")
    arch = task_arch(hf, sorted(set(_TASK_ARCHS[mt].values())), _guess_arch(mt, keys))
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise InteropError(f"position_embedding_type={hf['position_embedding_type']!r} is not supported "
                           "(absolute only)")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTS:
        raise InteropError(f"hidden_act={act!r} is not supported; expected one of {sorted(ACTS)}")
    head_prefix = "cls.predictions." if mt == "bert" else "lm_head."
    has_head = any(k.split(f"{mt}.", 1)[-1].startswith(head_prefix) or k.startswith(head_prefix) for k in keys)
    has_pooler = any(k.endswith("pooler.dense.weight") for k in keys)
    pad = hf.get("pad_token_id", 0 if mt == "bert" else 1)
    task = task_fields(hf, arch) if arch else {"head": "mlm" if has_head else "none"}
    if task["head"] in ("classification", "regression"):
        task["pooling"] = _SEQ_POOLING[mt]
        if mt == "bert" and not has_pooler:
            raise InteropError(f"{arch} needs the pooler tensors (bert.pooler.dense.*), none found")
    return ModelConfig(
        arch="encoder", vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 512),
        ffn=ACTS[act], norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
        bias=True, embed_norm=True, dropout=hf.get("hidden_dropout_prob", 0.1),
        attn_dropout=hf.get("attention_probs_dropout_prob", 0.1), position="learned",
        position_offset=(pad + 1) if mt == "roberta" else 0, token_types=hf.get("type_vocab_size", 2),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        head_act=ACTS[act] if mt == "bert" else "gelu", pooler=has_pooler, pad_token_id=pad, **task,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    mt = _model_type(cfg)
    tensors = strip_prefix(tensors, f"{mt}.")
    ignore = _IGNORE + (_mlm_table(mt, cfg.tie_embeddings)[1] if cfg.head == "mlm" else [r"decoder\.(weight|bias)$"])
    return rename(tensors, _BODY + _head_table(cfg), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    mt = _model_type(cfg)
    if cfg.head in _TASK_ARCHS[mt]:
        # only BertForSequenceClassification has a pooler; the other task classes would not load it
        keep_pooler = cfg.sentence_pooling == "pooler" and cfg.head in ("classification", "regression")
        hf = rename(ours, _BODY + _head_table(cfg), reverse=True, ignore=[] if keep_pooler else [r"^pooler\."])
        return {(k if k.startswith(("classifier.", "qa_outputs.")) else f"{mt}.{k}"): v for k, v in hf.items()}
    hf = rename(ours, _BODY + _head_table(cfg), reverse=True)
    if cfg.head == "mlm":  # both bias names hold the head's bias (one tensor in transformers when tied)
        out = _HEAD_OUT[mt]
        bias = hf[f"{out}bias" if cfg.tie_embeddings else f"{out}decoder.bias"]
        hf[f"{out}bias"], hf[f"{out}decoder.bias"] = bias, bias.clone()
        return {(k if k.startswith(("cls.", "lm_head.")) else f"{mt}.{k}"): v for k, v in hf.items()}
    return hf


def export_mismatch(cfg: ModelConfig) -> str | None:
    why = mismatch(cfg, arch="encoder", norm="layernorm", norm_placement="post", bias=True, norm_bias=True,
                   embed_norm=True, position="learned", embed_dim=None, share_layers=False, attn_scale=None,
                   tied_logit_scale=False, **PLAIN_OPTIONS)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head in ("lm", "rtd") or cfg.token_types < 1:
        return "needs head 'mlm', 'none' or a task head, and token_types >= 1"
    if cfg.position_offset and cfg.position_offset != cfg.pad_token_id + 1:
        return f"RoBERTa needs position_offset == pad_token_id + 1, got {cfg.position_offset}"
    if cfg.head == "mlm" and cfg.head_act != (cfg.ffn if _model_type(cfg) == "bert" else "gelu"):
        return f"the MLM head activation must be {cfg.ffn if _model_type(cfg) == 'bert' else 'gelu'}"
    if cfg.head in _TASK_ARCHS["bert"]:
        mt = _model_type(cfg)
        why = task_mismatch(cfg, _TASK_ARCHS[mt], _SEQ_POOLING[mt])
        if why and mt == "bert" and cfg.sentence_pooling == "cls":
            why += " (RoBERTa's classification head uses 'cls': a RoBERTa config, position_offset = pad_token_id + 1)"
        return why
    return None


_ACT_NAMES = HF_ACT_NAMES


def config_to_hf(cfg: ModelConfig) -> dict:
    mt = _model_type(cfg)
    arch = {"bert": "Bert", "roberta": "Roberta"}[mt] + ("ForMaskedLM" if cfg.head == "mlm" else "Model")
    task = task_config_to_hf(cfg, _TASK_ARCHS[mt][cfg.head]) if cfg.head in _TASK_ARCHS[mt] else {}
    return {
        "architectures": task.pop("architectures", [arch]), "model_type": mt, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.ffn_dim, "hidden_act": _ACT_NAMES[cfg.ffn],
        "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.token_types,
        "layer_norm_eps": cfg.norm_eps, "pad_token_id": cfg.pad_token_id,
        "position_embedding_type": "absolute", "tie_word_embeddings": cfg.tie_embeddings,
        "add_pooling_layer": cfg.pooler and cfg.head not in ("tagging", "qa"), **task,
    }
