"""Gemma (GemmaModel / GemmaForCausalLM, GemmaForSequenceClassification / TokenClassification): Llama with
RMSNorm gains stored as offsets from 1 (x / rms(x) * (1 + w), our ``norm="rmsnorm_plus_one"``), token embeddings
multiplied by sqrt(hidden_size) in their own dtype (``scale_embeddings``), a GeGLU FFN with the tanh GELU
(``ffn="geglu_tanh"``), a ``head_dim`` set independently of hidden_size / heads (256 in the released sizes) and,
in every released checkpoint, an LM head tied to the embeddings.

Quirks: ``hidden_act: "gelu"`` in the original configs means the tanh approximation (transformers rewrites it to
"gelu_pytorch_tanh"; so do we); ``attention_bias=True`` (biases on q/k/v/o) and ``use_bidirectional_attention`` are
refused; there is no GemmaForQuestionAnswering.
"""

from __future__ import annotations

from ..config import ModelConfig
from . import InteropError
from .llama import LlamaLike


class Gemma(LlamaLike):
    """Llama with (1 + w) RMSNorms, scaled embeddings and GeGLU-tanh."""

    activations = {"gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu_tanh"}  # the first is what exports write

    def fields(self) -> dict:
        return {**super().fields(), "norm": "rmsnorm_plus_one", "ffn": "geglu_tanh", "scale_embeddings": True}

    def check(self, hf: dict) -> None:
        if hf.get("attention_bias"):
            raise InteropError("attention_bias=True is not supported (biases on q/k/v and o_proj)")
        if hf.get("use_bidirectional_attention"):
            raise InteropError("use_bidirectional_attention=True is not supported (a causal decoder only)")

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        return {"attention_bias": False}


_GEMMA = Gemma(prefix="Gemma", model_type="gemma", heads=("classification", "regression", "tagging"))
MODEL_TYPES = ("gemma",)
config_from_hf = _GEMMA.config_from_hf
weights_from_hf = _GEMMA.weights_from_hf
weights_to_hf = _GEMMA.weights_to_hf
export_mismatch = _GEMMA.export_mismatch
config_to_hf = _GEMMA.config_to_hf
