"""Llama (LlamaModel / LlamaForCausalLM, LlamaForSequenceClassification / TokenClassification /
QuestionAnswering): RoPE, RMSNorm, SwiGLU, grouped-query attention. Also the engine of the families that are
Llama with model-core options (``LlamaLike``: qwen2.py, qwen3.py, mistral.py, gemma.py, gemma2.py).

Quirks: RoPE pairs coordinates (j, j + d/2) ("rotate_half"), which our RotaryPositions uses too;
the LM head may be tied (SmolLM2) or not; rope_theta moved into rope_parameters in transformers 5 (older
folders: rope_theta beside a ``rope_scaling`` dict). RoPE types: "default" and "llama3" (Llama 3.1+: low
frequencies slowed by ``factor``, our ``rope_scaling="llama3"``); others are refused.
LlamaForSequenceClassification scores the last token that is not ``pad_token_id`` with a bias-free
``score`` (our pooling "last", read from the attention mask); LlamaForTokenClassification's ``score`` has
a bias and a dropout of 0.1 unless config.json says otherwise; LlamaForQuestionAnswering keeps its body
under ``transformer.`` instead of ``model.``.
"""

from __future__ import annotations

import torch

from ..config import TASK_HEADS, ModelConfig
from . import (
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

_TABLE = [
    ("embed_tokens.weight", "transformer.embed.weight"),
    ("layers.{}.self_attn.q_proj", "transformer.decoder.layers.{}.attn.q_proj"),
    ("layers.{}.self_attn.k_proj", "transformer.decoder.layers.{}.attn.k_proj"),
    ("layers.{}.self_attn.v_proj", "transformer.decoder.layers.{}.attn.v_proj"),
    ("layers.{}.self_attn.o_proj", "transformer.decoder.layers.{}.attn.o_proj"),
    ("layers.{}.mlp.gate_proj", "transformer.decoder.layers.{}.ffn.gate_proj"),
    ("layers.{}.mlp.up_proj", "transformer.decoder.layers.{}.ffn.up_proj"),
    ("layers.{}.mlp.down_proj", "transformer.decoder.layers.{}.ffn.down_proj"),
    ("norm", "transformer.decoder.norm"),
]
_NORMS = {  # the block's norms by norm_placement
    "pre": [("layers.{}.input_layernorm", "transformer.decoder.layers.{}.attn_norm"),
            ("layers.{}.post_attention_layernorm", "transformer.decoder.layers.{}.ffn_norm")],
    "sandwich": [  # Gemma 2: "post_attention_layernorm" is the attention branch's output norm
        ("layers.{}.input_layernorm", "transformer.decoder.layers.{}.attn_norm"),
        ("layers.{}.post_attention_layernorm", "transformer.decoder.layers.{}.attn_post_norm"),
        ("layers.{}.pre_feedforward_layernorm", "transformer.decoder.layers.{}.ffn_norm"),
        ("layers.{}.post_feedforward_layernorm", "transformer.decoder.layers.{}.ffn_post_norm")],
}
_QK_NORM_TABLE = [  # Qwen3: one RMSNorm weight (head_dim,) each for the heads' queries and keys
    ("layers.{}.self_attn.q_norm", "transformer.decoder.layers.{}.attn.q_norm"),
    ("layers.{}.self_attn.k_norm", "transformer.decoder.layers.{}.attn.k_norm"),
]
_HEADS = {"lm": [("lm_head.weight", "head.weight")], "classification": [("score.weight", "head.out.weight")],
          "regression": [("score.weight", "head.out.weight")], "tagging": [("score", "head.out")],
          "qa": [("qa_outputs", "head.out")]}
_TASK_CLASSES = {"classification": "ForSequenceClassification", "regression": "ForSequenceClassification",
                 "tagging": "ForTokenClassification", "qa": "ForQuestionAnswering"}
_TOKEN_DROPOUT = 0.1  # *ForTokenClassification's dropout when config.json sets no classifier_dropout
_LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor"}


def rope_fields(hf: dict) -> dict:
    """ModelConfig's RoPE fields (rope_base, rope_scaling and the llama3 numbers) from a config.json: transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    out = {"rope_base": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out
    if rope_type != "llama3":
        raise InteropError(f"rope type {rope_type!r} is not supported (default and llama3 RoPE only)")
    missing = [k for k in _LLAMA3_KEYS if params.get(k) is None]
    if missing:
        raise InteropError(f"rope type 'llama3' needs {', '.join(missing)} in rope_parameters / rope_scaling")
    # transformers reads original_max_position_embeddings outside the dict first, then inside, then the model's length
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or hf.get("max_position_embeddings", 2048)
    return {**out, "rope_scaling": "llama3", "rope_original_max_seq_len": int(original),
            **{ours: float(params[k]) for k, ours in _LLAMA3_KEYS.items()}}


def rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's RoPE keys (transformers 5's rope_parameters, and rope_theta for older readers)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling == "llama3":
        params.update(rope_type="llama3", original_max_position_embeddings=cfg.rope_original_max_seq_len,
                      **{k: getattr(cfg, ours) for k, ours in _LLAMA3_KEYS.items()})
    return {"rope_theta": cfg.rope_base, "rope_parameters": params}


def window_fields(window: int | None, layers: list[int], n_layers: int) -> dict:
    """ModelConfig's sliding_window / sliding_layers for config.json's window and the layers that use it (transformers'
    ``layer_types`` entries "sliding_attention")."""
    if window is None or not layers:
        return {"sliding_window": None, "sliding_layers": None}
    return {"sliding_window": int(window), "sliding_layers": None if len(layers) == n_layers else sorted(layers)}


def layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' ``layer_types`` of a config: "sliding_attention" for the layers within the window."""
    local = set() if cfg.sliding_window is None else set(cfg.sliding_layers or range(cfg.n_layers))
    return ["sliding_attention" if i in local else "full_attention" for i in range(cfg.n_layers)]


class LlamaLike:
    """A Llama-shaped decoder family: its class names (``prefix`` + ForCausalLM, ...), ``model_type``, the task heads
    it has, and the model-core options it fixes (``fields``) or reads from config.json (``fields_from_hf``, the
    ``free`` ones). Subclasses refuse config.json keys they cannot honour in ``check`` and write their own keys in
    ``extra_hf_keys``."""

    free: tuple[str, ...] = ()  # fields() entries a checkpoint of the family sets itself (exports any value)
    activations = {"silu": "swiglu"}  # config.json's activation -> our gated FFN
    act_key = "hidden_act"  # the config.json key that names it

    def __init__(self, *, prefix: str, model_type: str, qkv_bias: bool = False, qk_norm: bool = False,
                 heads: tuple[str, ...] = tuple(_TASK_CLASSES), qa_prefix: str = "transformer."):
        self.prefix, self.model_type = prefix, model_type
        self.qkv_bias, self.qk_norm = qkv_bias, qk_norm
        self.task_archs = {head: prefix + cls for head, cls in _TASK_CLASSES.items() if head in heads}
        self.body_prefix = {"qa": qa_prefix}  # *ForQuestionAnswering's base_model_prefix (others: "model.")

    def fields(self) -> dict:
        """The ModelConfig fields of every checkpoint of this family: set on import, required on export (except
        the ``free`` ones, which ``fields_from_hf`` reads)."""
        return {**PLAIN_OPTIONS, "norm": "rmsnorm", "norm_placement": "pre", "ffn": "swiglu", "bias": False,
                "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm, "embed_norm": False, "position": "rope",
                "token_types": 0, "attn_scale": None}

    def fields_from_hf(self, hf: dict) -> dict:
        """The ``free`` fields (and any other override of ``fields()``) a config.json sets."""
        return {}

    def check(self, hf: dict) -> None:
        """Raise InteropError for a config.json option this family's conversion does not support."""
        if hf.get("mlp_bias") or hf.get("attention_bias"):
            raise InteropError("attention_bias/mlp_bias=True is not supported")

    def _table(self, cfg: ModelConfig):
        return (_TABLE + _NORMS[cfg.norm_placement] + (_QK_NORM_TABLE if self.qk_norm else [])
                + _HEADS.get(cfg.head, []))

    def _guess_arch(self, keys: set[str]) -> str | None:
        if "qa_outputs.weight" in keys:
            return self.task_archs.get("qa", self.prefix + _TASK_CLASSES["qa"])
        if "score.weight" in keys:
            return self.task_archs["tagging" if "score.bias" in keys else "classification"]
        return None

    def _ffn(self, hf: dict) -> str:
        act = hf.get(self.act_key) or next(iter(self.activations))
        if act not in self.activations:
            raise InteropError(f"{self.act_key}={act!r} is not supported ({', '.join(self.activations)} only)")
        return self.activations[act]

    def config_from_hf(self, hf: dict, keys: set[str]) -> ModelConfig:
        arch = task_arch(hf, sorted(set(self.task_archs.values())), self._guess_arch(keys))
        task = task_fields(hf, arch) if arch else {"head": "lm"}
        if task["head"] in ("classification", "regression"):
            task["pooling"] = "last"
        if task["head"] == "tagging":
            if not hf.get("token_classification_bias", True):
                raise InteropError("token_classification_bias=False is not supported (the tagging head has a bias)")
            drop = next((d for d in (task["classifier_dropout"], hf.get("hidden_dropout")) if d is not None),
                        _TOKEN_DROPOUT)
            task["classifier_dropout"] = None if drop == 0.0 else drop  # our Llama dropout is 0.0
        self.check(hf)
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        return ModelConfig(
            arch="decoder", vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim if head_dim * n_heads != hf["hidden_size"] else None,
            ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6), dropout=0.0, attn_dropout=float(hf.get("attention_dropout", 0.0)),
            **{**self.fields(), "ffn": self._ffn(hf), **self.fields_from_hf(hf)}, **rope_fields(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else 0, **task,
        )

    def weights_from_hf(self, tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        tensors = strip_prefix(strip_prefix(tensors, "model."), "transformer.")
        ignore = [r"rotary_emb\.inv_freq$"]
        if cfg.tie_embeddings or cfg.head != "lm":
            ignore.append(r"^lm_head\.weight$")
        return rename(tensors, self._table(cfg), ignore=ignore)

    def weights_to_hf(self, ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        hf = rename(ours, self._table(cfg), reverse=True)
        body = self.body_prefix.get(cfg.head, "model.")
        heads = ("lm_head.", "score.", "qa_outputs.")
        return {(k if k.startswith(heads) else f"{body}{k}"): v for k, v in hf.items()}

    def export_mismatch(self, cfg: ModelConfig) -> str | None:
        fixed = {k: v for k, v in self.fields().items() if k not in self.free}
        why = mismatch(cfg, arch="decoder", **fixed, embed_dim=None, share_layers=False, tied_logit_scale=False,
                       pooler=False)
        if why:
            return why
        return task_mismatch(cfg, self.task_archs, "last") if cfg.head in TASK_HEADS else mismatch(cfg, head="lm")

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        task = {"architectures": [f"{self.prefix}ForCausalLM"]}
        if cfg.head in self.task_archs:
            task = task_config_to_hf(cfg, self.task_archs[cfg.head])
            if cfg.head == "tagging" and cfg.classifier_dropout is None and cfg.dropout != _TOKEN_DROPOUT:
                task["classifier_dropout"] = cfg.dropout
        act = next(a for a, ffn in self.activations.items() if ffn == cfg.ffn)
        return {
            "architectures": task.pop("architectures"), "model_type": self.model_type, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dh,
            self.act_key: act, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            **rope_to_hf(cfg), "attention_dropout": cfg.attn_dropout, "tie_word_embeddings": cfg.tie_embeddings,
            "pad_token_id": cfg.pad_token_id, **self.extra_hf_keys(cfg), **task,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict:
        """config.json keys of this family beyond the shared ones."""
        return {"attention_bias": False, "mlp_bias": False}


_LLAMA = LlamaLike(prefix="Llama", model_type="llama")
MODEL_TYPES = ("llama",)
config_from_hf = _LLAMA.config_from_hf
weights_from_hf = _LLAMA.weights_from_hf
weights_to_hf = _LLAMA.weights_to_hf
export_mismatch = _LLAMA.export_mismatch
config_to_hf = _LLAMA.config_to_hf
