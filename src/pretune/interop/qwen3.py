"""Qwen3 (Qwen3Model / Qwen3ForCausalLM and the Sequence/Token classification and QuestionAnswering classes):
Llama with an RMSNorm on each head's queries and keys before RoPE (``q_norm`` / ``k_norm``, one (head_dim,)
weight each, shared by the heads: our ``qk_norm``) and a ``head_dim`` set independently of hidden_size / heads
(128 in every released size; our ``head_dim`` when it differs from dim / n_heads).

Quirks: ``attention_bias=True`` would put biases on q, k, v and o (refused; released checkpoints have none); the
sliding window is read as in Qwen2 (qwen2.py).
"""

from __future__ import annotations

from ..config import ModelConfig
from . import InteropError
from .qwen2 import Qwen


class Qwen3(Qwen):
    """Qwen2's rules plus: attention_bias is a real key (q/k/v/o biases), refused when True."""

    def check(self, hf: dict) -> None:
        if hf.get("attention_bias"):
            raise InteropError("attention_bias=True is not supported (biases on q/k/v and o_proj)")
        super().check(hf)

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        return {**super().extra_hf_keys(cfg), "attention_bias": False}


_QWEN3 = Qwen3(prefix="Qwen3", model_type="qwen3", qk_norm=True)
MODEL_TYPES = ("qwen3",)
config_from_hf = _QWEN3.config_from_hf
weights_from_hf = _QWEN3.weights_from_hf
weights_to_hf = _QWEN3.weights_to_hf
export_mismatch = _QWEN3.export_mismatch
config_to_hf = _QWEN3.config_to_hf
