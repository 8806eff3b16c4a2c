"""Qwen2 / Qwen2.5 (Qwen2Model / Qwen2ForCausalLM and the Sequence/Token classification and QuestionAnswering
classes): Llama with biases on the q/k/v projections only (o_proj and the MLP have none), our ``qkv_bias``.

Quirks: the q/k/v biases are fixed by the architecture (no ``attention_bias`` key: transformers ignores one);
``use_sliding_window`` with layers past ``max_window_layers`` (or ``layer_types`` naming "sliding_attention")
attend within ``sliding_window`` (our ``sliding_window`` and ``sliding_layers``); with it off (every released Qwen2.5
config) attention is full. Exports write ``layer_types`` out. Everything else (RoPE types, task heads, tied
embeddings) is as in Llama (llama.py).
"""

from __future__ import annotations

from ..config import ModelConfig
from .llama import LlamaLike, layer_types, window_fields


def sliding_layers(hf: dict) -> list[int]:
    """The layers a Qwen config.json makes attend within a sliding window (transformers' Qwen2Config rules)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []
    n = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


class Qwen(LlamaLike):
    """Llama-shaped with Qwen's config keys: a sliding window on some layers (use_sliding_window, layer_types)."""

    free = ("sliding_window", "sliding_layers")

    def check(self, hf: dict) -> None:
        return None  # no attention_bias / mlp_bias keys: transformers' Qwen2 ignores them

    def fields_from_hf(self, hf: dict) -> dict:
        return window_fields(hf.get("sliding_window"), sliding_layers(hf), hf["num_hidden_layers"])

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
                "max_window_layers": cfg.n_layers, "layer_types": layer_types(cfg)}


_QWEN2 = Qwen(prefix="Qwen2", model_type="qwen2", qkv_bias=True)
MODEL_TYPES = ("qwen2",)
config_from_hf = _QWEN2.config_from_hf
weights_from_hf = _QWEN2.weights_from_hf
weights_to_hf = _QWEN2.weights_to_hf
export_mismatch = _QWEN2.export_mismatch
config_to_hf = _QWEN2.config_to_hf
