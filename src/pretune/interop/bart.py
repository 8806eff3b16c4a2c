"""BART (BartModel, BartForConditionalGeneration, BartForSequenceClassification, BartForQuestionAnswering).

Quirks: post-norm encoder-decoder with biases and GELU; each stack has its own learned positions, stored with
BART's offset of 2 rows (``position_offset=2``, the table max_position_embeddings + 2 long), and a LayerNorm on
the embedding sum (``layernorm_embedding``: our ``embed_norm``); LayerNorm eps is fixed at 1e-5; the token
embeddings may be scaled by sqrt(d_model) (``scale_embedding``); one token embedding (``shared``) serves both
stacks and the tied LM head, which adds ``final_logits_bias`` (a buffer: our ``logit_bias``). The decoder may have
its own head count and FFN width (``decoder_attention_heads``, ``decoder_ffn_dim``: our ``decoder_heads``,
``decoder_ffn_dim``, None when they equal the encoder's; its cross-attention has the decoder's heads). The task classes
run the whole model with the decoder reading the input shifted right (``task_stack="decoder"``):
BartForSequenceClassification classifies the decoder state at each row's last ``eos_token_id`` through dense +
tanh + out_proj (our pooling "eos"), BartForQuestionAnswering puts ``qa_outputs`` on every decoder state.
Generation starts the decoder from </s> (``decoder_start_token_id=2``) and forces </s> at the length limit
(``forced_eos_token_id``; bart-large forces <s> first: ``forced_bos_token_id``). Not modelled, as they only act
in training: ``activation_dropout`` (exported as 0) and LayerDrop.
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
    task_arch,
    task_config_to_hf,
    task_fields,
    task_mismatch,
)

MODEL_TYPES = ("bart",)

ACTS = HF_ACTS
_ACT_NAMES = HF_ACT_NAMES
OFFSET = 2  # BartLearnedPositionalEmbedding: position p is row p + 2
NORM_EPS = 1e-5  # nn.LayerNorm's default, which every BART LayerNorm uses


def _stack_rows(stack: str) -> list[tuple[str, str]]:
    hf, ours = f"{stack}.layers.{{}}", f"transformer.{stack}.layers.{{}}"
    rows = [(f"{stack}.embed_positions.weight", f"transformer.{stack}.position.weight"),
            (f"{stack}.layernorm_embedding", f"transformer.{stack}.embed_norm")]
    rows += [(f"{hf}.self_attn.{p}_proj", f"{ours}.attn.{p}_proj") for p in "qkv"]
    rows += [(f"{hf}.self_attn.out_proj", f"{ours}.attn.o_proj"),
             (f"{hf}.self_attn_layer_norm", f"{ours}.attn_norm"),
             (f"{hf}.fc1", f"{ours}.ffn.up_proj"), (f"{hf}.fc2", f"{ours}.ffn.down_proj"),
             (f"{hf}.final_layer_norm", f"{ours}.ffn_norm")]
    if stack == "decoder":
        rows += [(f"{hf}.encoder_attn.{p}_proj", f"{ours}.cross_attn.{p}_proj") for p in "qkv"]
        rows += [(f"{hf}.encoder_attn.out_proj", f"{ours}.cross_attn.o_proj"),
                 (f"{hf}.encoder_attn_layer_norm", f"{ours}.cross_norm")]
    return rows


_BODY = [("shared.weight", "transformer.embed.weight"), *_stack_rows("encoder"), *_stack_rows("decoder")]
_HEADS = {"classification": [("classification_head.dense", "head.dense"),
                             ("classification_head.out_proj", "head.out")],
          "qa": [("qa_outputs", "head.out")]}
_HEADS["regression"] = _HEADS["classification"]
_TASK_ARCHS = {"classification": "BartForSequenceClassification", "regression": "BartForSequenceClassification",
               "qa": "BartForQuestionAnswering"}
_ARCHS = {"lm": "BartForConditionalGeneration", "none": "BartModel", **_TASK_ARCHS}
# copies of shared.weight (checked equal before they are dropped) and fairseq's version buffers
_IGNORE = [r"^(encoder|decoder)\.embed_tokens\.weight$", r"^lm_head\.weight$", r"^(encoder|decoder)\.version$"]


def _need(hf: dict, key: str):
    if hf.get(key) is None:
        raise InteropError(f"config.json has no {key!r}")
    return hf[key]


def _pair(hf: dict, enc: str, dec: str) -> tuple[int, int | None]:
    """A size each stack has its own of: (the encoder's, the decoder's or None when it is the same)."""
    a = _need(hf, enc)
    b = hf.get(dec)
    return a, (None if b is None or b == a else b)


def _one_id(hf: dict, key: str, default: int | None) -> int | None:
    value = hf.get(key, default)
    if isinstance(value, list):
        if len(value) != 1:
            raise InteropError(f"{key}={value!r}: one token id expected")
        value = value[0]
    return value


def _guess_arch(keys: set[str]) -> str | None:
    if "qa_outputs.weight" in keys:
        return "BartForQuestionAnswering"
    if "classification_head.out_proj.weight" in keys:
        return "BartForSequenceClassification"
    return None


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    archs = hf.get("architectures") or []
    other = [a for a in archs if a not in _ARCHS.values() and not a.endswith(("ForSequenceClassification",
                                                                               "ForTokenClassification",
                                                                               "ForQuestionAnswering",
                                                                               "ForMultipleChoice"))]
    if other:
        raise InteropError(f"architectures={other[0]!r} is not supported; BART classes: "
                           f"{', '.join(sorted(set(_ARCHS.values())))}")
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())), _guess_arch(keys))
    act = hf.get("activation_function", "gelu")
    if act not in ACTS:
        raise InteropError(f"activation_function={act!r} is not supported; expected one of {sorted(ACTS)}")
    if hf.get("tie_word_embeddings", True) is False:
        raise InteropError("tie_word_embeddings=False is not supported (transformers then unties the encoder's and "
                           "decoder's token embeddings too; pretune's stacks share one)")
    if arch:
        task = task_fields(hf, arch)
    else:
        lm = any(a == _ARCHS["lm"] for a in archs) if archs else "final_logits_bias" in keys
        task = {"head": "lm" if lm else "none", "classifier_dropout": hf.get("classifier_dropout")}
    n_heads, decoder_heads = _pair(hf, "encoder_attention_heads", "decoder_attention_heads")
    ffn_dim, decoder_ffn_dim = _pair(hf, "encoder_ffn_dim", "decoder_ffn_dim")
    return ModelConfig(
        arch="encoder-decoder", vocab_size=_need(hf, "vocab_size"), dim=_need(hf, "d_model"),
        n_layers=_need(hf, "encoder_layers"), n_decoder_layers=hf.get("decoder_layers", hf["encoder_layers"]),
        n_heads=n_heads, decoder_heads=decoder_heads, ffn_dim=ffn_dim, decoder_ffn_dim=decoder_ffn_dim, ffn=ACTS[act],
        max_seq_len=hf.get("max_position_embeddings", 1024) + OFFSET, norm="layernorm", norm_eps=NORM_EPS,
        norm_placement="post", bias=True, embed_norm=True, scale_embeddings=bool(hf.get("scale_embedding", False)),
        dropout=hf.get("dropout", 0.1), attn_dropout=hf.get("attention_dropout", 0.0), position="learned",
        position_offset=OFFSET, token_types=0, tie_embeddings=True,
        logit_bias=task["head"] == "lm" and "final_logits_bias" in keys,
        pad_token_id=_one_id(hf, "pad_token_id", 1), eos_token_id=_one_id(hf, "eos_token_id", 2),
        decoder_start_token_id=_one_id(hf, "decoder_start_token_id", 2),
        forced_bos_token_id=_one_id(hf, "forced_bos_token_id", None),
        forced_eos_token_id=_one_id(hf, "forced_eos_token_id", 2), task_stack="decoder", **task,
    )


def _table(cfg: ModelConfig) -> list[tuple[str, str]]:
    return _BODY + _HEADS.get(cfg.head, [])


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}
    shared = tensors.get("shared.weight")
    if shared is None:
        raise InteropError("no token embedding: expected a tensor 'model.shared.weight' (or 'shared.weight')")
    for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        if copy in tensors and not torch.equal(tensors[copy], shared):
            raise InteropError(f"{copy!r} differs from the shared token embedding; untied embeddings are not "
                               "supported")
    bias = tensors.pop("final_logits_bias", None)
    out = rename(tensors, _table(cfg), ignore=_IGNORE)
    if cfg.logit_bias:
        if bias is None or bias.numel() != cfg.vocab_size:
            raise InteropError(f"final_logits_bias must hold vocab_size={cfg.vocab_size} values, got "
                               f"{None if bias is None else tuple(bias.shape)}")
        out["head.bias"] = bias.reshape(-1)
    return out


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    ours = dict(ours)
    bias = ours.pop("head.bias", None) if cfg.head == "lm" else None
    hf = rename(ours, _table(cfg), reverse=True)
    if cfg.head != "none":  # the *For* classes hold the body under "model."
        hf = {(k if k.startswith(("classification_head.", "qa_outputs.")) else f"model.{k}"): v
              for k, v in hf.items()}
    if bias is not None:
        hf["final_logits_bias"] = bias.reshape(1, -1)
    return hf


def export_mismatch(cfg: ModelConfig) -> str | None:
    plain = {**PLAIN_OPTIONS, "scale_embeddings": cfg.scale_embeddings, "logit_bias": cfg.logit_bias,
             "task_stack": cfg.task_stack}
    why = mismatch(cfg, arch="encoder-decoder", norm="layernorm", norm_eps=NORM_EPS, norm_placement="post", bias=True,
                   norm_bias=True, embed_norm=True, position="learned", position_offset=OFFSET, token_types=0,
                   embed_dim=None, share_layers=False, share_encoder_decoder=False, attn_scale=None,
                   tied_logit_scale=False, tie_embeddings=True, pooler=False, **plain)
    if why:
        return why
    if cfg.ffn not in _ACT_NAMES:
        return f"needs a non-gated FFN (gelu, gelu_tanh, relu, swish), got ffn={cfg.ffn!r}"
    for stack, c in (("encoder", cfg), ("decoder", cfg.decoder_config)):
        if c.kv_heads != c.n_heads or c.dh * c.n_heads != c.dim:
            return (f"needs plain multi-head attention in the {stack} (no GQA, head_dim = dim / heads), got "
                    f"{c.n_heads} heads, {c.kv_heads} key/value heads of {c.dh}")
    if cfg.head in ("lm", "none"):
        return None
    if cfg.task_stack != "decoder":
        return (f"BART's task classes read the decoder (task_stack='decoder'), got task_stack={cfg.task_stack!r} "
                f"with head={cfg.head!r}")
    return task_mismatch(cfg, _TASK_ARCHS, "eos")


def config_to_hf(cfg: ModelConfig) -> dict:
    task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head]) if cfg.head in _TASK_ARCHS else {}
    dec = cfg.decoder_config
    out = {
        "architectures": task.pop("architectures", [_ARCHS[cfg.head]]), "model_type": "bart",
        "vocab_size": cfg.vocab_size, "d_model": cfg.dim, "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.decoder_layers, "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": dec.n_heads, "encoder_ffn_dim": cfg.ffn_dim, "decoder_ffn_dim": dec.ffn_dim,
        "activation_function": _ACT_NAMES[cfg.ffn], "max_position_embeddings": cfg.max_seq_len - OFFSET,
        "dropout": cfg.dropout, "attention_dropout": cfg.attn_dropout, "activation_dropout": 0.0,
        "scale_embedding": cfg.scale_embeddings, "is_encoder_decoder": True, "tie_word_embeddings": True,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id if cfg.eos_token_id is not None else 2,
        "decoder_start_token_id": cfg.decoder_start_token_id, "forced_eos_token_id": cfg.forced_eos_token_id,
        **task,
    }
    if cfg.forced_bos_token_id is not None:
        out["forced_bos_token_id"] = cfg.forced_bos_token_id
    if cfg.classifier_dropout is not None:
        out["classifier_dropout"] = cfg.classifier_dropout
    return out
