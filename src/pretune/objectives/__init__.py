"""Pretraining objectives: data collators and the losses that turn hidden states into training signal.

``OBJECTIVES`` is the registry (name -> Objective class); each objective owns its settings (``.Settings``, the
``objective:`` section of a run config). ``objective_settings(values)`` builds and checks that section;
``build_objective(settings, model, tokenizer)`` makes the objective and refuses an architecture that cannot serve
it, saying why. A new objective is one class (with its Settings) plus one line below.
"""

from __future__ import annotations

import dataclasses

from ..config import ConfigError, _did_you_mean
from .base import IGNORE, Objective, Settings
from .distill import Distill
from .encoder import Electra, MaskedLM, SentenceOrderMLM, SentencePairMLM
from .lm import CausalLM
from .losses import causal_lm_loss, masked_lm_loss
from .seq2seq import BertStyle, Denoise, Deshuffle, DropTokens, IidMask, IidSpans, PrefixLM, SpanCorruption

OBJECTIVES: dict[str, type[Objective]] = {c.name: c for c in (
    CausalLM, PrefixLM, MaskedLM, SentencePairMLM, SentenceOrderMLM, Electra, SpanCorruption, IidSpans,
    BertStyle, IidMask, DropTokens, Deshuffle, Denoise, Distill)}


def objective_settings(values: dict | None = None, **kw) -> Settings:
    """The typed, checked ``objective`` section: ``values`` (and keyword overrides) with ``name`` picking the
    objective. A key another objective owns is an error when it differs from that objective's default (a run.yaml
    written before settings were split per objective lists every key at its default, and still loads)."""
    from ..runconfig import owned_section

    values = {**(values or {}), **kw}
    name = values.get("name", Settings.name)
    if name not in OBJECTIVES:
        hint = _did_you_mean(str(name), list(OBJECTIVES))
        raise ConfigError(f"objective.name={name!r} is not one of {list(OBJECTIVES)}{hint}")
    return owned_section("objective", OBJECTIVES[name].Settings, values, kind="objective", name=name,
                         owners={o: c.Settings for o, c in OBJECTIVES.items()})


def build_objective(cfg: Settings, model, tokenizer, *, teacher=None) -> Objective:
    """The objective named ``cfg.name`` for ``model`` (a TransformerLM) and ``tokenizer`` (pretune Tokenizer);
    ``teacher``: the frozen model objective ``distill`` learns from (the job loads ``objective.teacher``)."""
    if cfg.name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {cfg.name!r}{_did_you_mean(cfg.name, list(OBJECTIVES))}; "
                          f"choose one of {list(OBJECTIVES)}")
    cls = OBJECTIVES[cfg.name]
    if not isinstance(cfg, cls.Settings):
        cfg = objective_settings(dataclasses.asdict(cfg))
    if cls is Electra:
        return cls(cfg, model.config, tokenizer, model=model)
    if cls is Distill:
        return cls(cfg, model.config, tokenizer, model=model, teacher=teacher)
    return cls(cfg, model.config, tokenizer)


__all__ = ["OBJECTIVES", "build_objective", "objective_settings", "Objective", "Settings", "IGNORE",
           "causal_lm_loss", "masked_lm_loss"]
