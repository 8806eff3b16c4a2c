"""T5 v1.0 (ReLU FFN, tied head rescaled by dim**-0.5) and v1.1 (gated-gelu FFN, untied head).

Quirks: no attention scaling (folded into the init); one relative-position bias table per stack,
stored in block 0's self-attention; every block is a list of sub-layers (self, [cross], FFN).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import PLAIN_OPTIONS, InteropError, mismatch, rename, task_arch

MODEL_TYPES = ("t5",)

# (gated?, HF dense_act_fn) -> our ffn name
_FFN = {(False, "relu"): "relu", (False, "gelu"): "gelu", (False, "gelu_new"): "gelu_tanh",
        (False, "silu"): "swish", (True, "relu"): "reglu",
        (True, "gelu_new"): "geglu_tanh", (True, "silu"): "swiglu"}
_FFN_NAMES = {v: k for k, v in _FFN.items()}


def _table(cfg: ModelConfig) -> list[tuple[str, str]]:
    rows = [("shared.weight", "transformer.embed.weight")]
    for stack, ffn_layer in (("encoder", 1), ("decoder", 2)):
        hf, ours = f"{stack}.block.{{}}.layer", f"transformer.{stack}.layers.{{}}"
        rows += [(f"{hf}.0.SelfAttention.{p}", f"{ours}.attn.{p}_proj") for p in "qkvo"]
        rows += [(f"{hf}.0.layer_norm", f"{ours}.attn_norm"),
                 (f"{hf}.{ffn_layer}.layer_norm", f"{ours}.ffn_norm"),
                 (f"{hf}.{ffn_layer}.DenseReluDense.wo", f"{ours}.ffn.down_proj"),
                 (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                  f"transformer.{stack}.position.bias_table.weight"),
                 (f"{stack}.final_layer_norm", f"transformer.{stack}.norm")]
        if cfg.gated_ffn:
            rows += [(f"{hf}.{ffn_layer}.DenseReluDense.wi_0", f"{ours}.ffn.gate_proj"),
                     (f"{hf}.{ffn_layer}.DenseReluDense.wi_1", f"{ours}.ffn.up_proj")]
        else:
            rows += [(f"{hf}.{ffn_layer}.DenseReluDense.wi", f"{ours}.ffn.up_proj")]
    hf, ours = "decoder.block.{}.layer", "transformer.decoder.layers.{}"
    rows += [(f"{hf}.1.EncDecAttention.{p}", f"{ours}.cross_attn.{p}_proj") for p in "qkvo"]
    rows += [(f"{hf}.1.layer_norm", f"{ours}.cross_norm"), ("lm_head.weight", "head.weight")]
    return rows


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    task_arch(hf, [])  # T5's task classes read the decoder (or the encoder alone): none is supported
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    act = "gelu_new" if proj == "gated-gelu" else act  # HF: "gated-gelu" means the tanh GELU
    if (gated, act) not in _FFN:
        raise InteropError(f"feed_forward_proj={proj!r} is not supported")
    # T5 v1.0 ties the head and rescales by dim**-0.5; v1.1 has tie_word_embeddings=False and neither.
    tied = hf.get("tie_word_embeddings", True) is not False
    if "scale_decoder_outputs" in hf:
        tied = bool(hf["scale_decoder_outputs"])
    return ModelConfig(
        arch="encoder-decoder", vocab_size=hf["vocab_size"], dim=hf["d_model"], n_layers=hf["num_layers"],
        n_decoder_layers=hf.get("num_decoder_layers") or None, n_heads=hf["num_heads"],
        head_dim=hf["d_kv"], ffn_dim=hf["d_ff"], ffn=_FFN[(gated, act)], norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre", bias=False, attn_scale=1.0,
        embed_norm=False, dropout=hf.get("dropout_rate", 0.1), attn_dropout=hf.get("dropout_rate", 0.1),
        position="relative", relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128), token_types=0,
        tie_embeddings=tied, tied_logit_scale=tied, head="lm", max_seq_len=512,
        pad_token_id=hf.get("pad_token_id", 0),
        decoder_start_token_id=hf.get("decoder_start_token_id", hf.get("pad_token_id", 0)),
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = dict(tensors)
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["shared.weight"]
    ignore = [r"^(encoder|decoder)\.embed_tokens\.weight$"]  # copies of shared.weight
    if cfg.tie_embeddings:
        ignore.append(r"^lm_head\.weight$")
    return rename(tensors, _table(cfg), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = rename(ours, _table(cfg), reverse=True)
    hf["encoder.embed_tokens.weight"] = hf["shared.weight"]
    hf["decoder.embed_tokens.weight"] = hf["shared.weight"]
    if "lm_head.weight" not in hf:
        hf["lm_head.weight"] = hf["shared.weight"]
    return {k: v.clone() for k, v in hf.items()}  # safetensors stores no aliases


def export_mismatch(cfg: ModelConfig) -> str | None:
    if cfg.arch == "encoder-decoder" and cfg.head not in ("lm", "none"):
        return (f"head={cfg.head!r} has no Hugging Face T5 class (T5ForSequenceClassification and "
                "T5ForQuestionAnswering read the decoder; pretune's task heads read the encoder)")
    why = mismatch(cfg, arch="encoder-decoder", norm="rmsnorm", norm_placement="pre", bias=False,
                   attn_scale=1.0, embed_norm=False, position="relative", token_types=0, embed_dim=None,
                   share_layers=False, share_encoder_decoder=False, head="lm", pooler=False, decoder_heads=None,
                   decoder_ffn_dim=None, **PLAIN_OPTIONS)  # T5's num_heads and d_ff serve both stacks
    if why:
        return why
    if cfg.tie_embeddings != cfg.tied_logit_scale:
        return "needs tied_logit_scale == tie_embeddings (v1.0: both true; v1.1: both false)"
    if cfg.ffn not in _FFN_NAMES:
        return f"ffn={cfg.ffn!r} has no T5 equivalent"
    if cfg.kv_heads != cfg.n_heads:
        return "needs n_kv_heads == n_heads"
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    gated, act = _FFN_NAMES[cfg.ffn]
    proj = "gated-gelu" if cfg.ffn == "geglu_tanh" else ("gated-" if gated else "") + act
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": cfg.vocab_size,
        "d_model": cfg.dim, "d_kv": cfg.dh, "d_ff": cfg.ffn_dim, "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers, "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.relative_buckets,
        "relative_attention_max_distance": cfg.relative_max_distance, "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm_eps, "feed_forward_proj": proj, "is_encoder_decoder": True,
        "tie_word_embeddings": cfg.tie_embeddings, "scale_decoder_outputs": cfg.tied_logit_scale,
        "pad_token_id": cfg.pad_token_id, "eos_token_id": 1, "decoder_start_token_id": cfg.decoder_start_token_id,
    }
