"""BART's noising functions (Lewis et al. 2019 §2.2): corrupt a document, the decoder rebuilds the original.

On "Thank you for inviting me to your party last week ." (ids without special tokens):

    token masking          Thank you <M> inviting me to your party <M> week .
    token deletion         Thank you inviting me to your party week .
    text infilling         Thank you <M> me to <M> your party last week .  (one <M> per span; 0-length: inserted)
    sentence permutation   the sentences in random order
    document rotation      party last week . Thank you for inviting me to your

Text infilling + sentence permutation is the paper's best combination (Table 1), the default of
:class:`DenoiseConfig`. Each function takes a 1-D int64 array and a ``np.random.Generator`` and
returns the corrupted 1-D int64 source; the target is always the original (no EOS either way).

Where the paper leaves a detail open this follows fairseq's ``DenoisingDataset`` in spirit, with
two simplifications: the number of noised tokens is ``ratio * T`` rounded stochastically (so its
mean is exactly ``ratio * T`` at any length), and infilling spans never overlap (fairseq draws
span starts independently, so overlapping spans merge and cover less than ``ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _as_tokens(tokens) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {arr.shape}")
    return arr


def _check_ratio(name: str, ratio: float) -> None:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{name} ({ratio}) must be in [0, 1)")


def _check_mask_id(mask_id: int | None, needed_by: str) -> None:
    if mask_id is None:
        raise ValueError(f"{needed_by} needs mask_id, got None")


def _num_noised(length: int, ratio: float, rng: np.random.Generator) -> int:
    return int(length * ratio + rng.random())  # stochastic rounding: E[count] = ratio * length


def _noise_positions(length: int, ratio: float, rng: np.random.Generator) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    mask[rng.choice(length, size=_num_noised(length, ratio, rng), replace=False)] = True
    return mask


def token_masking(tokens, rng: np.random.Generator, *, mask_id: int, ratio: float = 0.15) -> np.ndarray:
    """Replace a random ``ratio`` of the tokens by ``mask_id`` (BERT-style, without random/kept tokens).

    "Thank you for inviting me to ..." -> "Thank you <M> inviting me to ..."

    Returns:
        (T,) int64 source.
    """
    tokens = _as_tokens(tokens)
    _check_ratio("ratio", ratio)
    _check_mask_id(mask_id, "token_masking")
    return np.where(_noise_positions(len(tokens), ratio, rng), np.int64(mask_id), tokens)


def token_deletion(tokens, rng: np.random.Generator, *, ratio: float = 0.15) -> np.ndarray:
    """Delete a random ``ratio`` of the tokens; the model must find which positions are missing.

    "Thank you for inviting me to your party last week ." -> "Thank you inviting me to your party week ."

    Returns:
        (T - k,) int64 source, k ≈ ratio * T.
    """
    tokens = _as_tokens(tokens)
    _check_ratio("ratio", ratio)
    return tokens[~_noise_positions(len(tokens), ratio, rng)]


def _poisson_span_lengths(budget: int, poisson_lambda: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson span lengths drawn until they cover ``budget`` tokens; the last one trimmed to fit (fairseq)."""
    lengths = np.zeros(0, dtype=np.int64)
    while lengths.sum() < budget:
        lengths = np.concatenate([lengths, rng.poisson(poisson_lambda, size=budget)])
    cum = np.cumsum(lengths)
    last = int(np.searchsorted(cum, budget))  # first span with cum >= budget
    lengths = lengths[: last + 1]
    lengths[last] = budget - (cum[last - 1] if last > 0 else 0)
    return lengths


def text_infilling(
    tokens, rng: np.random.Generator, *, mask_id: int, ratio: float = 0.3, poisson_lambda: float = 3.0
) -> np.ndarray:
    """Replace spans with lengths ~ Poisson(``poisson_lambda``) by ONE mask token each, until ``ratio`` of the
    tokens are covered; a 0-length span inserts a mask (Lewis et al. 2019 §2.2, after SpanBERT).

    "Thank you for inviting me to your party last week ." -> "Thank you <M> me to <M> your party last week ."

    The spans are placed uniformly at random among the kept tokens, never overlapping; two spans may
    be adjacent (two masks in a row).

    Args:
        tokens: (T,) int token ids.
        rng: the random generator.
        mask_id: id of the mask token.
        ratio: fraction of the tokens removed (in expectation), in [0, 1).
        poisson_lambda: mean span length, > 0.

    Returns:
        (T - removed + num_spans,) int64 source.
    """
    tokens = _as_tokens(tokens)
    _check_ratio("ratio", ratio)
    _check_mask_id(mask_id, "text_infilling")
    if not poisson_lambda > 0:
        raise ValueError(f"poisson_lambda ({poisson_lambda}) must be > 0")
    budget = _num_noised(len(tokens), ratio, rng)
    if budget == 0:
        return tokens.copy()
    lengths = rng.permutation(_poisson_span_lengths(budget, poisson_lambda, rng))  # (S,) spans, some 0
    n_slots = len(tokens) - budget + len(lengths)  # output length: kept tokens + one mask per span
    is_span = np.zeros(n_slots, dtype=bool)
    is_span[rng.choice(n_slots, size=len(lengths), replace=False)] = True
    consumed = np.ones(n_slots, dtype=np.int64)  # tokens of the original each output slot stands for
    consumed[is_span] = lengths
    first = np.cumsum(consumed) - consumed  # (n_slots,) original position each slot starts at
    kept = tokens[np.minimum(first, len(tokens) - 1)]
    return np.where(is_span, np.int64(mask_id), kept)


def _sentence_order(length: int, sent_starts, rng: np.random.Generator) -> np.ndarray:
    """Index array that puts whole sentences in random order."""
    starts = np.asarray(sent_starts, dtype=np.int64)
    if starts.ndim != 1:
        raise ValueError(f"sent_starts must be 1-D, got shape {starts.shape}")
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    if len(starts) == 0 or starts[0] != 0:
        raise ValueError(f"sent_starts must begin with 0, got {starts[:5].tolist()}")
    if np.any(np.diff(starts) <= 0) or starts[-1] >= length:
        raise ValueError(f"sent_starts must be strictly increasing positions < {length}, got {starts.tolist()}")
    sentences = np.split(np.arange(length), starts[1:])
    return np.concatenate([sentences[i] for i in rng.permutation(len(sentences))])


def sentence_permutation(tokens, sent_starts, rng: np.random.Generator) -> np.ndarray:
    """Shuffle whole sentences; ``sent_starts`` (int, (N,)) are the positions where sentences begin, 0 first.

    "Thank you . See you soon ." (starts [0, 3]) -> "See you soon . Thank you ."

    Returns:
        (T,) int64 source, a permutation of the tokens.
    """
    tokens = _as_tokens(tokens)
    return tokens[_sentence_order(len(tokens), sent_starts, rng)]


def _rotation_start(length: int, rng: np.random.Generator, word_starts) -> int:
    if length == 0:
        return 0
    if word_starts is None:
        return int(rng.integers(length))
    word_starts = np.asarray(word_starts, dtype=bool)
    if word_starts.shape != (length,):
        raise ValueError(f"word_starts must be a bool mask of shape ({length},), got shape {word_starts.shape}")
    candidates = np.flatnonzero(word_starts)
    if len(candidates) == 0:
        raise ValueError("word_starts marks no word start")
    return int(rng.choice(candidates))


def document_rotation(tokens, rng: np.random.Generator, *, word_starts: np.ndarray | None = None) -> np.ndarray:
    """Rotate the document so it starts at a uniformly random token (a word start if ``word_starts`` is given).

    "Thank you for inviting me to your party last week ." -> "party last week . Thank you for inviting me to your"

    Args:
        tokens: (T,) int token ids.
        rng: the random generator.
        word_starts: optional (T,) bool, True where a token begins a word.

    Returns:
        (T,) int64 source.
    """
    tokens = _as_tokens(tokens)
    return np.roll(tokens, -_rotation_start(len(tokens), rng, word_starts))


@dataclass
class DenoiseConfig:
    """Which BART noises to apply, combinable; the defaults are the paper's best (Table 1)."""

    mask_ratio: float = 0.0  # token masking: fraction of tokens -> <mask>, as in BERT (e.g. 0.15)
    delete_ratio: float = 0.0  # token deletion: fraction of tokens removed; the model must find where
    infill_ratio: float = 0.3  # text infilling: fraction of tokens covered by spans, each span -> one <mask>
    poisson_lambda: float = 3.0  # mean infilling span length (Poisson); 0-length spans insert a <mask>
    permute_sentences: bool = True  # shuffle whole sentences (needs sent_starts); weak alone, best with infilling
    rotate: bool = False  # start the document at a random token; the worst noise in Table 1, kept for ablations

    def __post_init__(self):
        for name in ("mask_ratio", "delete_ratio", "infill_ratio"):
            _check_ratio(name, getattr(self, name))
        if not self.poisson_lambda > 0:
            raise ValueError(f"poisson_lambda ({self.poisson_lambda}) must be > 0")

    @property
    def needs_mask_id(self) -> bool:
        return self.mask_ratio > 0 or self.infill_ratio > 0


def denoise(
    tokens,
    rng: np.random.Generator,
    cfg: DenoiseConfig,
    *,
    mask_id: int | None,
    sent_starts=None,
    word_starts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the noises ``cfg`` enables, in the order sentence permutation, rotation, token masking,
    deletion, infilling; return (corrupted source, original).

    Args:
        tokens: (T,) int token ids.
        rng: the random generator.
        cfg: which noises, how much.
        mask_id: id of <mask>; required when masking or infilling is on.
        sent_starts: (N,) int positions where sentences begin (0 first); required when permute_sentences.
        word_starts: optional (T,) bool word-start mask of the original, for rotation; it is permuted
            along with the sentences.

    Returns:
        (source, target): source a 1-D int64 array, target a copy of ``tokens``.
    """
    tokens = _as_tokens(tokens)
    if cfg.needs_mask_id:
        _check_mask_id(mask_id, f"denoise with mask_ratio={cfg.mask_ratio}, infill_ratio={cfg.infill_ratio}")
    if word_starts is not None:
        word_starts = np.asarray(word_starts, dtype=bool)
    source = tokens
    if cfg.permute_sentences:
        if sent_starts is None:
            raise ValueError("permute_sentences=True needs sent_starts, got None")
        order = _sentence_order(len(tokens), sent_starts, rng)
        source = source[order]
        word_starts = None if word_starts is None else word_starts[order]
    if cfg.rotate:
        source = np.roll(source, -_rotation_start(len(source), rng, word_starts))
    if cfg.mask_ratio > 0:
        source = token_masking(source, rng, mask_id=mask_id, ratio=cfg.mask_ratio)
    if cfg.delete_ratio > 0:
        source = token_deletion(source, rng, ratio=cfg.delete_ratio)
    if cfg.infill_ratio > 0:
        source = text_infilling(source, rng, mask_id=mask_id, ratio=cfg.infill_ratio, poisson_lambda=cfg.poisson_lambda)
    return source.copy(), tokens.copy()
