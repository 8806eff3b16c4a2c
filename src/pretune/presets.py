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
# BART (Lewis et al. 2019; HF facebook/bart-*): post-norm, GELU, learned positions 2 rows in (1024 + 2), a LayerNorm on
# each stack's embeddings, a tied head with a fixed logit bias, task heads on the decoder; RoBERTa's BPE ids (<s> 0,
# <pad> 1, </s> 2): decoding starts from </s> and a cut-off output ends with it
_BART = dict(arch="encoder-decoder", vocab_size=50265, max_seq_len=1026, ffn="gelu", norm="layernorm", norm_eps=1e-5,
             norm_placement="post", position="learned", position_offset=2, token_types=0, embed_norm=True, head="lm",
             tie_embeddings=True, logit_bias=True, task_stack="decoder", classifier_dropout=0.0, pad_token_id=1,
             eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
_MODERNBERT = dict(arch="encoder", vocab_size=50368, max_seq_len=8192, ffn="geglu", norm="layernorm", norm_eps=1e-5,
                   norm_placement="pre", bias=False, norm_bias=False, embed_norm=True, first_attn_norm=False,
                   position="rope", rope_base=160000.0, rope_local_base=10000.0, sliding_window=65, token_types=0,
                   head="mlm", head_act="gelu", head_dense_bias=False, head_transform=True, dropout=0.0,
                   attn_dropout=0.0, pad_token_id=50283)
_ELECTRA = dict(_BERT, head="rtd", cls_act="gelu")
_DEBERTA_V3 = dict(arch="encoder", vocab_size=128100, max_seq_len=512, ffn="gelu", norm="layernorm", norm_eps=1e-7,
                   norm_placement="post", position="disentangled", position_buckets=256, max_relative_positions=512,
                   token_types=0, embed_norm=True, head="mlm", head_act="gelu", cls_act="gelu", pad_token_id=0)
# ALBERT v2 (HF albert/albert-*-v2): BERT's post-norm body, 128-wide embeddings projected to dim, one layer shared
# across depth, tanh-GELU (gelu_new) in the FFN and the MLM head, no dropout in the body (v2; Lan et al. 2020 §4.8)
# but 0.1 before a task classifier (classifier_dropout_prob), the pooler and the sentence-order head
_ALBERT = dict(_BERT, vocab_size=30000, embed_dim=128, share_layers=True, ffn="gelu_tanh", head_act="gelu_tanh",
               dropout=0.0, attn_dropout=0.0, classifier_dropout=0.1, pooler=True, pair_head=True)

PRESETS: dict[str, dict[str, Any]] = {
    # Devlin et al. 2019: 12 layers, 768 wide, 12 heads, ~110M parameters.
    "bert-base": dict(_BERT, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    # Devlin et al. 2019: 24 layers, 1024 wide, 16 heads, ~340M parameters.
    "bert-large": dict(_BERT, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # Sanh et al. 2019 (DistilBERT, HF distilbert-base-uncased): BERT-base with half the layers, no token types, no
    # pooler, a classifier with ReLU after its dense layer (pre_classifier); 66M parameters (67.0M with the MLM head).
    "distilbert-base": dict(_BERT, dim=768, n_layers=6, n_heads=12, ffn_dim=3072, token_types=0, cls_act="relu"),
    # Liu et al. 2019: BERT-base shape, byte-level BPE vocab, positions start at padding_idx + 1.
    "roberta-base": dict(_BERT, vocab_size=50265, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                         max_seq_len=514, position_offset=2, token_types=1, norm_eps=1e-5,
                         pad_token_id=1),
    # Radford et al. 2018 (GPT-1, HF openai-gpt): post-norm decoder, 12/768/12, FFN 3072, tanh GELU (its "gelu" is
    # gelu_new), ~117M parameters.
    "gpt": dict(arch="decoder", vocab_size=40478, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                max_seq_len=512, ffn="gelu_tanh", norm="layernorm", norm_eps=1e-5,
                norm_placement="post", position="learned", token_types=0, embed_norm=False,
                head="lm", tie_embeddings=True),
    # Radford et al. 2019 (GPT-2 small): pre-norm, tanh-GELU, 124M parameters.
    "gpt2": dict(_GPT2, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "gpt2-medium": dict(_GPT2, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    "gpt2-large": dict(_GPT2, dim=1280, n_layers=36, n_heads=20, ffn_dim=5120),  # 774M
    "gpt2-xl": dict(_GPT2, dim=1600, n_layers=48, n_heads=25, ffn_dim=6400),  # 1.56B
    # Raffel et al. 2020, T5 v1.0: ReLU FFN, relative position buckets, tied + rescaled head.
    "t5-small": dict(_T5, dim=512, n_layers=6, n_heads=8, ffn_dim=2048),
    "t5-base": dict(_T5, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    # Lewis et al. 2019: BART-base 6 + 6 layers, 768 wide, 12 heads (140M); BART-large 12 + 12, 1024, 16 (406M).
    "bart-base": dict(_BART, dim=768, n_layers=6, n_heads=12, ffn_dim=3072),
    "bart-large": dict(_BART, dim=1024, n_layers=12, n_heads=16, ffn_dim=4096),
    # Llama-style (shaped like SmolLM2-135M): RoPE, RMSNorm, SwiGLU, GQA 9 query / 3 kv heads.
    "llama": dict(arch="decoder", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                  ffn_dim=1536, max_seq_len=2048, ffn="swiglu", norm="rmsnorm", norm_eps=1e-5,
                  norm_placement="pre", bias=False, embed_norm=False, position="rope",
                  rope_base=100000.0, token_types=0, head="lm", tie_embeddings=True,
                  dropout=0.0, attn_dropout=0.0, pad_token_id=2),
    # Warner et al. 2024 (ModernBERT, HF answerdotai/ModernBERT-base / -large): pre-norm + GeGLU, no biases, RoPE;
    # every third layer global (RoPE base 160000), the others local (a 128-token window, 64 keys each side: w = 65;
    # base 10000); layer 0 has no attention norm; 149M / 395M parameters.
    "modernbert-base": dict(_MODERNBERT, dim=768, n_layers=22, n_heads=12, ffn_dim=1152,
                            sliding_layers=[i for i in range(22) if i % 3]),
    "modernbert-large": dict(_MODERNBERT, dim=1024, n_layers=28, n_heads=16, ffn_dim=2624,
                             sliding_layers=[i for i in range(28) if i % 3]),
    # Clark et al. 2020 (ELECTRA, HF google/electra-*-discriminator): BERT's body without a pooler, the
    # replaced-token-detection head, a dense + GELU classification head; small has 128-wide embeddings projected to
    # 256; 13.5M / 109.5M / 335.1M parameters (the paper: 14M / 110M / 335M).
    "electra-small": dict(_ELECTRA, dim=256, n_layers=12, n_heads=4, ffn_dim=1024, embed_dim=128),
    "electra-base": dict(_ELECTRA, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "electra-large": dict(_ELECTRA, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # He et al. 2021/2023 (DeBERTa-v3, HF microsoft/deberta-v3-*): post-norm BERT body with disentangled attention
    # (256 log buckets of relative distance, no absolute positions, no token types), a 128K SentencePiece vocabulary;
    # the model cards' backbone + embedding: 22M + 48M, 44M + 98M, 86M + 98M, 304M + 131M (with the MLM head: 71.0M,
    # 142.0M, 184.6M, 435.2M)
    "deberta-v3-xsmall": dict(_DEBERTA_V3, dim=384, n_layers=12, n_heads=6, ffn_dim=1536),
    "deberta-v3-small": dict(_DEBERTA_V3, dim=768, n_layers=6, n_heads=12, ffn_dim=3072),
    "deberta-v3-base": dict(_DEBERTA_V3, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "deberta-v3-large": dict(_DEBERTA_V3, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    # Lan et al. 2020 (ALBERT, Table 1; HF albert/albert-{base,large,xlarge,xxlarge}-v2): 12/768/12, 24/1024/16,
    # 24/2048/16, 12/4096/64 with FFN 4 x dim; AlbertForPreTraining has 11.8M / 17.8M / 59.0M / 223.2M parameters
    # (AlbertModel 11.7M / 17.7M / 58.7M / 222.6M; the paper: 12M / 18M / 60M / 235M)
    "albert-base": dict(_ALBERT, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "albert-large": dict(_ALBERT, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    "albert-xlarge": dict(_ALBERT, dim=2048, n_layers=24, n_heads=16, ffn_dim=8192),
    "albert-xxlarge": dict(_ALBERT, dim=4096, n_layers=12, n_heads=64, ffn_dim=16384),
}

_TINY = dict(vocab_size=128, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=128)


def _tiny(name: str) -> dict[str, Any]:
    cfg = dict(PRESETS[name], **_TINY)
    if cfg.get("n_kv_heads"):
        cfg["n_kv_heads"] = 2  # keep GQA in the tiny twin
    if cfg.get("head_dim"):
        cfg["head_dim"] = 8
    if cfg.get("decoder_heads"):  # keep a decoder that differs from the encoder in the tiny twin
        cfg["decoder_heads"] = 2
    if cfg.get("decoder_ffn_dim"):
        cfg["decoder_ffn_dim"] = 96
    if cfg.get("embed_dim"):
        cfg["embed_dim"] = 16  # keep the factorisation in the tiny twin
    if cfg.get("relative_buckets"):
        cfg.update(relative_buckets=8, relative_max_distance=20)
    if cfg.get("position") == "disentangled":  # buckets the tiny twin's short rows reach
        cfg.update(position_buckets=8, max_relative_positions=32)
    if cfg.get("sliding_layers"):  # the local layers among the tiny twin's (ModernBERT: 0 global, 1 local)
        cfg["sliding_layers"] = [i for i in cfg["sliding_layers"] if i < _TINY["n_layers"]]
        assert cfg["sliding_layers"], f"{name}: keep a local layer among the first {_TINY['n_layers']}"
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
