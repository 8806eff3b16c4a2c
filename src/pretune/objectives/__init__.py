"""Pretraining objectives: data collators and the losses that turn hidden states into training signal.

``build_objective(cfg, model, tokenizer)`` picks one by name (``cfg.name``) and refuses an architecture
that cannot serve it, saying why.
"""

from __future__ import annotations

from ..config import ConfigError, _did_you_mean
from .base import IGNORE, Objective
from .encoder import Electra, MaskedLM, SentenceOrderMLM, SentencePairMLM
from .lm import CausalLM
from .losses import causal_lm_loss, masked_lm_loss
from .seq2seq import BertStyle, Denoise, Deshuffle, DropTokens, IidMask, IidSpans, PrefixLM, SpanCorruption

OBJECTIVES: dict[str, type[Objective]] = {c.name: c for c in (
    CausalLM, PrefixLM, MaskedLM, SentencePairMLM, SentenceOrderMLM, Electra, SpanCorruption, IidSpans,
    BertStyle, IidMask, DropTokens, Deshuffle, Denoise)}


def build_objective(cfg, model, tokenizer) -> Objective:
    """The objective named ``cfg.name`` for ``model`` (a TransformerLM) and ``tokenizer`` (pretune Tokenizer)."""
    if cfg.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {cfg.name!r}{_did_you_mean(cfg.name, list(OBJECTIVES))}; "
                          f"choose one of {list(OBJECTIVES)}")
    cls = OBJECTIVES[cfg.name]
    if cls is Electra:
        return cls(cfg, model.config, tokenizer, model=model)
    return cls(cfg, model.config, tokenizer)


__all__ = ["OBJECTIVES", "build_objective", "Objective", "IGNORE", "causal_lm_loss", "masked_lm_loss"]
