"""Named model configurations with the published sizes, and a ``tiny-*`` twin of each for tests.

Presets are plain data: a mapping of ModelConfig fields. ``tiny-NAME`` keeps every choice of
NAME (family, norm, positions, FFN, tying) and shrinks the sizes to dim 32, 2 layers, 4 heads.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, ModelConfig, _did_you_mean

_BERT = dict(arch="encoder", vocab_size=30522, max_seq_len=512, ffn="gelu", norm="layernorm",
             norm_eps=1e-12, norm_placement="post", position="learned", token_types=2,
             embed_norm=True, head="mlm", pad_token_id=0)
_GPT2 = dict(arch="decoder", vocab_size=50257, max_seq_len=1024, ffn="gelu_tanh", norm="layernorm",
             norm_eps=1e-5, norm_placement="pre", position="learned", token_types=0, embed_norm=False,
             head="lm", head_act="gelu_tanh", tie_embeddings=True, pad_token_id=50256)
_T5 = dict(arch="encoder-decoder", vocab_size=32128, head_dim=64, ffn="relu", norm="rmsnorm",
           norm_eps=1e-6, norm_placement="pre", bias=False, attn_scale=1.0, embed_norm=False,
           position="relative", relative_buckets=32, relative_max_distance=128, token_types=0,
           head="lm", tie_embeddings=True, tied_logit_scale=True, max_seq_len=512,
           pad_token_id=0, decoder_start_token_id=0)

PRESETS: dict[str, dict[str, Any]] = {
    # Devlin et al. 2019: 12 layers, 768 wide, 12 heads, ~110M parameters.
    "bert-base": dict(_BERT, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    # Devlin et al. 2019: 24 layers, 1024 wide, 16 heads, ~340M parameters.
    "bert-large": dict(_BERT, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # Liu et al. 2019: BERT-base shape, byte-level BPE vocab, positions start at padding_idx + 1.
    "roberta-base": dict(_BERT, vocab_size=50265, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                         max_seq_len=514, position_offset=2, token_types=1, norm_eps=1e-5,
                         pad_token_id=1),
    # Radford et al. 2018 (GPT-1): post-norm decoder, 12/768/12, FFN 3072, ~117M parameters.
    "gpt": dict(arch="decoder", vocab_size=40478, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                max_seq_len=512, ffn="gelu", norm="layernorm", norm_eps=1e-5,
                norm_placement="post", position="learned", token_types=0, embed_norm=False,
                head="lm", tie_embeddings=True),
    # Radford et al. 2019 (GPT-2 small): pre-norm, tanh-GELU, 124M parameters.
    "gpt2": dict(_GPT2, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "gpt2-medium": dict(_GPT2, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # Raffel et al. 2020, T5 v1.0: ReLU FFN, relative position buckets, tied + rescaled head.
    "t5-small": dict(_T5, dim=512, n_layers=6, n_heads=8, ffn_dim=2048),
    "t5-base": dict(_T5, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    # Llama-style (shaped like SmolLM2-135M): RoPE, RMSNorm, SwiGLU, GQA 9 query / 3 kv heads.
    "llama": dict(arch="decoder", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                  ffn_dim=1536, max_seq_len=2048, ffn="swiglu", norm="rmsnorm", norm_eps=1e-5,
                  norm_placement="pre", bias=False, embed_norm=False, position="rope",
                  rope_base=100000.0, token_types=0, head="lm", tie_embeddings=True,
                  dropout=0.0, attn_dropout=0.0, pad_token_id=2),
    # ModernBERT-style (Warner et al. 2024, base size): RoPE + pre-norm + GeGLU, no biases.
    # (ModernBERT's alternating local/global attention is not modelled: every layer is global.)
    "modernbert": dict(arch="encoder", vocab_size=50368, dim=768, n_layers=22, n_heads=12,
                       ffn_dim=1152, max_seq_len=8192, ffn="geglu", norm="layernorm", norm_eps=1e-5,
                       norm_placement="pre", bias=False, norm_bias=False, embed_norm=True,
                       position="rope", rope_base=160000.0, token_types=0, head="mlm",
                       dropout=0.0, attn_dropout=0.0, pad_token_id=50283),
    # Clark et al. 2020, ELECTRA-small discriminator: factorised 128-wide embeddings, 256 wide.
    "electra-small": dict(_BERT, dim=256, n_layers=12, n_heads=4, ffn_dim=1024, embed_dim=128),
}

_TINY = dict(vocab_size=128, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)


def _tiny(name: str) -> dict[str, Any]:
    cfg = dict(PRESETS[name], **_TINY)
    if cfg.get("n_kv_heads"):
        cfg["n_kv_heads"] = 2  # keep GQA in the tiny twin
    if cfg.get("head_dim"):
        cfg["head_dim"] = 8
    if cfg.get("embed_dim"):
        cfg["embed_dim"] = 16  # keep the factorisation in the tiny twin
    if cfg.get("relative_buckets"):
        cfg.update(relative_buckets=8, relative_max_distance=20)
    cfg["pad_token_id"] = min(cfg.get("pad_token_id", 0), 127)
    return cfg


PRESETS.update({f"tiny-{name}": _tiny(name) for name in list(PRESETS)})


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{_did_you_mean(name, preset_names())}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")
