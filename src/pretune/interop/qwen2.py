"""Qwen2 / Qwen2.5 (Qwen2Model / Qwen2ForCausalLM and the Sequence/Token classification and QuestionAnswering
classes): Llama with biases on the q/k/v projections only (o_proj and the MLP have none), our ``qkv_bias``.

Quirks: the q/k/v biases are fixed by the architecture (no ``attention_bias`` key: transformers ignores one);
``use_sliding_window`` with layers past ``max_window_layers`` (or ``layer_types`` naming "sliding_attention")
attend within a window, which is refused; with it off (every released Qwen2.5 config) attention is full.
Everything else (RoPE types, task heads, tied embeddings) is as in Llama (llama.py).
"""

from __future__ import annotations

from . import InteropError
from .llama import LlamaLike


def sliding_layers(hf: dict) -> list[int]:
    """The layers a Qwen config.json makes attend within a sliding window (transformers' Qwen2Config rules)."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return []
    n = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


class Qwen(LlamaLike):
    """Llama-shaped with Qwen's config keys: a sliding window is refused, exports write it off."""

    def check(self, hf: dict) -> None:
        layers = sliding_layers(hf)
        if layers:
            raise InteropError(f"sliding-window attention (use_sliding_window=True, sliding_window="
                               f"{hf['sliding_window']}, layers {layers}) is not supported")

    def extra_hf_keys(self) -> dict:
        return {"use_sliding_window": False, "sliding_window": None}


_QWEN2 = Qwen(prefix="Qwen2", model_type="qwen2", qkv_bias=True)
MODEL_TYPES = ("qwen2",)
config_from_hf = _QWEN2.config_from_hf
weights_from_hf = _QWEN2.weights_from_hf
weights_to_hf = _QWEN2.weights_to_hf
export_mismatch = _QWEN2.export_mismatch
config_to_hf = _QWEN2.config_to_hf
