"""Gemma 2 (Gemma2Model / Gemma2ForCausalLM, Gemma2ForSequenceClassification / TokenClassification): Gemma
(gemma.py) plus a norm before and after each branch (``input_layernorm`` / ``post_attention_layernorm`` around the
attention, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP: our
``norm_placement="sandwich"``), attention scores soft-capped as c * tanh(s / c) before the mask
(``attn_logit_softcapping``: our ``attn_softcap``), LM logits soft-capped the same way (``final_logit_softcapping``:
``logit_softcap``), the attention scale ``query_pre_attn_scalar ** -0.5`` (``attn_scale``; None when the scalar is
head_dim) and the layers ``layer_types`` names "sliding_attention" (by default every other one, starting with the
first) attending within ``sliding_window`` keys (``sliding_window`` / ``sliding_layers``).

Quirks: transformers' Gemma2 has no SDPA path (soft-capping), nor do we for it: attention runs eagerly; the task
heads (Generic*) do not soft-cap; a config with no sliding layer still needs a ``sliding_window`` for transformers to
build its (unused) local mask, so exports write max_seq_len there; no Gemma2ForQuestionAnswering.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import InteropError
from .gemma import Gemma
from .llama import layer_types, window_fields


def _scalar(cfg: ModelConfig) -> float | int:
    """query_pre_attn_scalar of a config: head_dim when attn_scale is the default, else attn_scale ** -2 (an int when it
    is one, so that a round trip gives back the same attn_scale)."""
    if cfg.attn_scale is None:
        return cfg.dh
    q = float(f"{cfg.attn_scale ** -2:.12g}")
    return int(q) if q.is_integer() else q


class Gemma2(Gemma):
    """Gemma with sandwich norms, soft-capping, the query_pre_attn_scalar scale and local layers."""

    free = ("attn_scale", "attn_softcap", "logit_softcap", "sliding_window", "sliding_layers")
    act_key = "hidden_activation"
    activations = {"gelu_pytorch_tanh": "geglu_tanh"}

    def fields(self) -> dict:
        return {**super().fields(), "norm_placement": "sandwich"}

    def fields_from_hf(self, hf: dict) -> dict:
        n = hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        scalar = hf.get("query_pre_attn_scalar", 256)
        types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        local = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise InteropError(f"layer_types must name sliding_attention or full_attention for each of the {n} "
                               f"layers, got {types!r}")
        if local and hf.get("sliding_window") is None:
            raise InteropError(f"layer_types names sliding layers {local} but sliding_window is null")
        caps = {ours: (None if hf.get(key) is None else float(hf[key])) for key, ours in (
            ("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap"))}
        return {"attn_scale": None if scalar == head_dim else float(scalar) ** -0.5, **caps,
                **window_fields(hf.get("sliding_window"), local, n)}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        return {"attention_bias": False, "query_pre_attn_scalar": _scalar(cfg),
                "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.logit_softcap,
                "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": layer_types(cfg)}


_GEMMA2 = Gemma2(prefix="Gemma2", model_type="gemma2", heads=("classification", "regression", "tagging"))
MODEL_TYPES = ("gemma2",)
config_from_hf = _GEMMA2.config_from_hf
weights_from_hf = _GEMMA2.weights_from_hf
weights_to_hf = _GEMMA2.weights_to_hf
export_mismatch = _GEMMA2.export_mismatch
config_to_hf = _GEMMA2.config_to_hf
