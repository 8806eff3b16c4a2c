"""The objective interface: block → example (numpy) → padded batch (torch) → loss terms.

An objective is an ``nn.Module`` so that pretraining-only parts (the NSP head, ELECTRA's generator)
train with the model and are saved in the training checkpoint, but not in the finetunable model.

Loss normalisation: every loss term is a *sum* over its targets divided by the number of targets of
the whole optimizer step (all micro-batches, all processes), so gradient accumulation and DDP give
the same update as one big batch. ``counts(batch)`` says how many targets each term has before the
forward pass; ``loss(model, batch, totals)`` returns Σ_term weight · sum_term / totals[term].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..config import ConfigError
from ..model.layout import IGNORE, check_family


@dataclass
class Settings:
    """An objective's section of a run config (``objective: {name: ..., ...}``). Each objective owns a subclass
    with its own knobs; keys of another objective are an error, so nothing set is silently ignored."""

    name: str = "mlm"  # the objective (pretune.objectives.OBJECTIVES; `pretune pretrain --help` lists them)

    def validate(self) -> None:
        """Check the values (each rule once, here or in the subclass); raise ConfigError naming the key."""


def _in_unit(settings, *names: str, low_open: bool = False) -> None:
    """Each ``objective.<name>`` must lie in [0, 1) ((0, 1) with ``low_open``)."""
    for name in names:
        v = getattr(settings, name)
        if not (0.0 < v < 1.0 if low_open else 0.0 <= v < 1.0):
            raise ConfigError(f"objective.{name}={v} must be in {'(0, 1)' if low_open else '[0, 1)'}")


class Objective(nn.Module):
    """Base class. Subclasses set ``name``, ``archs`` (families that can serve it), ``why`` and ``Settings``."""

    Settings: ClassVar[type[Settings]] = Settings  # this objective's config section (its knobs)
    term_weights: ClassVar[dict[str, float]] = {}  # weight of each loss term in the evaluated total (default 1)

    name: ClassVar[str]
    archs: ClassVar[tuple[str, ...]]  # the model families (ModelConfig.arch values) that can serve it
    why: ClassVar[str] = ""  # one sentence: what the objective needs from the architecture
    corrupts: ClassVar[bool] = True  # has random corruption (dynamic vs static masking applies)
    head: ClassVar[str | None] = None  # the model head the loss reads ("mlm", "lm"), None: none needed

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__()
        check_family(model_cfg, self.archs, who=f"objective {self.name!r}", why=self.why)
        if self.head is not None and model_cfg.head != self.head:
            raise ConfigError(f"objective {self.name!r} trains the model's {self.head} head but the model has "
                              f"head={model_cfg.head!r}: set model.head={self.head}")
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.tok = tokenizer
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        self.special_ids = np.array(sorted(tokenizer.special_ids), dtype=np.int64)

    # -- data side (numpy, runs in the data path) -------------------------------------------------
    def n_special_tokens(self) -> int:
        """Tokens the objective adds around a block ([CLS]/[SEP], EOS, ...)."""
        return 0

    def block_size(self, max_seq_len: int) -> int:
        """The longest block whose example still fits the model's max_seq_len."""
        return max_seq_len - self.n_special_tokens()

    def doc_separator(self) -> int | None:
        """Token inserted between documents when FULL-SENTENCES packing crosses a boundary."""
        return self.tok.sep_id if self.tok.sep_id is not None else self.tok.eos_id

    def example(self, block, rng: np.random.Generator, random_block: Callable[[np.random.Generator], Any]) -> dict:
        """One training example (numpy arrays) from a packed block."""
        raise NotImplementedError

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """Pad a list of examples into a batch (right padding; pad id for ids, -100 for labels, 0 otherwise)."""
        out = {}
        for key in examples[0]:
            arrays = [np.asarray(e[key]) for e in examples]
            if arrays[0].ndim == 0:
                out[key] = torch.as_tensor(np.stack(arrays))
                continue
            fill = IGNORE if key.endswith("labels") else (self.pad_id if key.endswith("ids") else 0)
            width = max(a.shape[0] for a in arrays)
            buf = np.full((len(arrays), width), fill, dtype=np.int64)
            for i, a in enumerate(arrays):
                buf[i, : a.shape[0]] = a
            out[key] = torch.from_numpy(buf)
        return out

    # -- model side ---------------------------------------------------------------------------------
    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        """Number of targets of each loss term in this (micro-)batch."""
        raise NotImplementedError

    def loss(self, model, batch: dict[str, torch.Tensor], totals: dict[str, float]) -> tuple[torch.Tensor, dict]:
        """(Σ_term weight · sum_term / totals[term], stats) where stats holds summed floats for logging:
        ``<term>_loss`` (sum of per-target losses) and optionally ``<term>_correct``."""
        raise NotImplementedError

    def records(self) -> dict:
        """ModelConfig fields the trained model should carry about how it was trained (e.g. a decoder's
        ``decoder_layout``), set on the model before it is saved."""
        return {}

    def finetunable(self, model):
        """The model to save as the run's result (ELECTRA: the discriminator, which *is* ``model``)."""
        return model

    def companions(self) -> dict:
        """Other models the run saves beside its result, each as a model folder ``<train.out>/<name>`` (ELECTRA:
        ``generator``), name -> TransformerLM."""
        return {}

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Real (non-pad) input tokens in a batch, for tokens/s."""
        n = int(batch["attention_mask"].sum())
        if "decoder_attention_mask" in batch:
            n += int(batch["decoder_attention_mask"].sum())
        return n


def with_specials(tokens: np.ndarray, first: int | None, last: int | None) -> np.ndarray:
    """[first] + tokens + [last] (either may be None)."""
    parts = ([np.array([first], dtype=np.int64)] if first is not None else []) + [tokens.astype(np.int64)]
    if last is not None:
        parts.append(np.array([last], dtype=np.int64))
    return np.concatenate(parts)


def require(tok, role: str, objective: str, hint: str) -> int:
    """The id of a special-token role, or a ConfigError saying which tokenizer the objective needs."""
    value = getattr(tok, f"{role}_id")
    if value is None:
        raise ConfigError(f"objective {objective!r} needs a {role} token but the tokenizer has none; {hint}")
    return int(value)


def summed_ce(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropies over targets != -100, number of correct argmax predictions)."""
    loss = nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")
    with torch.no_grad():
        valid = targets != IGNORE
        correct = ((logits.argmax(-1) == targets) & valid).sum()
    return loss, correct
