"""Mistral (MistralModel / MistralForCausalLM and the Sequence/Token classification and QuestionAnswering classes):
Llama with every layer attending within a sliding window of ``sliding_window`` keys (position t sees keys
t - w + 1 .. t, transformers' ``kv_idx > q_idx - sliding_window``), our ``sliding_window`` with ``sliding_layers=None``.

Quirks: ``sliding_window: null`` (Mistral v0.2 and later) is full attention, so such a checkpoint is a Llama (and
exports as one); transformers' Mistral ignores ``layer_types`` (every layer is windowed), and so do we;
MistralForQuestionAnswering keeps its body under ``model.`` (Llama's under ``transformer.``). Everything else (RoPE
types, tied embeddings, task heads) is as in Llama (llama.py).
"""

from __future__ import annotations

from ..config import ModelConfig
from .llama import LlamaLike


class Mistral(LlamaLike):
    """Llama plus a sliding window on every layer."""

    free = ("sliding_window",)

    def check(self, hf: dict) -> None:
        return None  # no attention_bias / mlp_bias keys: transformers' Mistral has neither

    def fields_from_hf(self, hf: dict) -> dict:
        window = hf.get("sliding_window")
        return {"sliding_window": None if window is None else int(window)}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        return {"sliding_window": cfg.sliding_window}


_MISTRAL = Mistral(prefix="Mistral", model_type="mistral", qa_prefix="model.")
MODEL_TYPES = ("mistral",)
config_from_hf = _MISTRAL.config_from_hf
weights_from_hf = _MISTRAL.weights_from_hf
weights_to_hf = _MISTRAL.weights_to_hf
export_mismatch = _MISTRAL.export_mismatch
config_to_hf = _MISTRAL.config_to_hf
