"""Per-example corruption for masked-LM and sentence-pair pretraining (pure numpy, no torch).

A collator calls these once per example with its own ``np.random.Generator``; calling again with
a fresh generator gives a fresh mask, which is RoBERTa's *dynamic masking* (Liu et al. 2019 §4.1),
while reusing one seed per example reproduces BERT's *static* masks.

- ``select_for_masking``: which positions to predict — 15% of the maskable tokens, chosen
  uniformly (BERT, Devlin et al. 2019 §3.1), as whole words (BERT's whole-word-masking release),
  or as contiguous spans of whole words (SpanBERT, Joshi et al. 2020 §3.1).
- ``apply_mask``: BERT's 80/10/10 corruption of the selected positions and the MLM labels.
- ``electra_labels``: replaced-token-detection targets (ELECTRA, Clark et al. 2020 §2).
- ``sentence_pair``: next-sentence prediction (BERT §3.1, 50% random B) and sentence-order
  prediction (ALBERT, Lan et al. 2020 §4.1, 50% swapped).

Conventions: token sequences are 1-D int64 arrays of length T; labels use ``IGNORE`` (-100) where
there is no target, the value ``torch.nn.functional.cross_entropy`` ignores by default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import numpy as np

IGNORE = -100


def select_for_masking(tokens: np.ndarray, rng: np.random.Generator, *, rate: float = 0.15,
                       maskable: np.ndarray, word_starts: np.ndarray | None = None, span: bool = False,
                       geometric_p: float = 0.2, max_span: int = 10) -> np.ndarray:
    """Choose the positions an MLM predicts.

    The budget is exactly ``round(rate * n_maskable)`` tokens (at least 1 when anything is
    maskable), so the realised rate is 15% up to rounding (BERT: 15%; RoBERTa's dynamic masking
    draws a new selection on every call).

    Modes:
        - plain (``word_starts`` None, ``span`` False): the budget's positions uniformly without
          replacement among the maskable ones (BERT §3.1).
        - whole-word (``word_starts`` given): words in random order; a word is taken whole when it
          still fits in the budget, skipped otherwise (so later, shorter words can fill the rest),
          stopping once the budget is met — Google BERT's ``create_pretraining_data.py`` rule. The
          budget is never exceeded, except that a single word is taken when every word is longer
          than the whole budget.
        - span (``span`` True, SpanBERT §3.1): repeat — draw a length ℓ in words from
          Geometric(``geometric_p``) truncated to [1, ``max_span``] and renormalised (SpanBERT's
          code; mean 3.8 words for p=0.2, max 10), a start word uniformly among the unselected
          words that fit in the remaining budget, and select ℓ consecutive whole words from it;
          the span stops early at an already-selected word, at a non-maskable token, at the end, or
          before a word that would exceed the budget. Without ``word_starts`` every token is a word.

    A *word* is a maskable token marked in ``word_starts`` together with the maskable continuation
    tokens after it; a continuation token right after a non-maskable one (e.g. a block cut
    mid-word after [CLS]) starts a word of its own, so words never contain special tokens.

    Args:
        tokens: (T,) token ids (only the length is used).
        rng: the generator every random choice is drawn from.
        rate: fraction of the maskable tokens to select, in [0, 1].
        maskable: (T,) bool, False for special and padding tokens (never selected).
        word_starts: (T,) bool, True where a token begins a word (WordPiece: no ``##`` prefix).
        span: SpanBERT span masking instead of independent positions/words.
        geometric_p: success probability of the span-length geometric distribution.
        max_span: longest span, in words.

    Returns:
        (T,) bool, True at the selected positions.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D (T,), got shape {tokens.shape}")
    maskable = _bool_like(maskable, tokens, "maskable")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate ({rate}) must be in [0, 1]")
    n_maskable = int(maskable.sum())
    budget = max(1, round(rate * n_maskable)) if n_maskable > 0 and rate > 0 else 0
    selected = np.zeros(tokens.shape[0], dtype=bool)
    if budget == 0:
        return selected
    if word_starts is None and not span:
        selected[rng.choice(np.flatnonzero(maskable), size=budget, replace=False)] = True
        return selected

    word_starts = np.ones_like(maskable) if word_starts is None else _bool_like(word_starts, tokens, "word_starts")
    starts, ends = _word_bounds(maskable, word_starts)  # (W,), (W,): word w is tokens[starts[w]:ends[w]]
    if span:
        if not 0.0 < geometric_p <= 1.0:
            raise ValueError(f"geometric_p ({geometric_p}) must be in (0, 1]")
        if max_span < 1:
            raise ValueError(f"max_span ({max_span}) must be >= 1")
        chosen = _choose_spans(starts, ends, budget, rng, geometric_p, max_span)
    else:
        chosen = _choose_whole_words(ends - starts, budget, rng)
    return _fill_ranges(tokens.shape[0], starts[chosen], ends[chosen])


def apply_mask(tokens: np.ndarray, selected: np.ndarray, rng: np.random.Generator, *, mask_id: int,
               vocab_size: int, special_ids: Iterable[int] = (), mask_prob: float = 0.8,
               random_prob: float = 0.1, random_low: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """BERT's corruption of the selected positions (Devlin et al. 2019 §3.1, appendix A.1).

    Each selected position independently becomes ``mask_id`` with probability ``mask_prob`` (0.8),
    a random token with probability ``random_prob`` (0.1), and stays unchanged otherwise (0.1),
    as Google BERT and Hugging Face's ``DataCollatorForLanguageModeling`` do. Random tokens are
    uniform over [``random_low``, ``vocab_size``) minus ``special_ids``.

    Args:
        tokens: (T,) original token ids.
        selected: (T,) bool from ``select_for_masking``.
        rng: the generator every random choice is drawn from.
        mask_id: id of the [MASK] token.
        vocab_size: random replacements are < vocab_size.
        special_ids: ids never used as random replacements ([CLS], [SEP], [PAD], [MASK], ...).
        mask_prob, random_prob: the 80% / 10% shares; the rest is kept unchanged.
        random_low: smallest id a random replacement may take (e.g. to skip [unusedN] slots).

    Returns:
        corrupted: (T,) int64, the model input.
        labels: (T,) int64, the original token at selected positions, ``IGNORE`` elsewhere.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D (T,), got shape {tokens.shape}")
    selected = _bool_like(selected, tokens, "selected")
    if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1:
        raise ValueError(f"mask_prob ({mask_prob}) and random_prob ({random_prob}) must be >= 0 and sum to <= 1")
    special = np.unique(np.fromiter(special_ids, dtype=np.int64))
    n_allowed = (vocab_size - random_low) - int(((special >= random_low) & (special < vocab_size)).sum())
    if n_allowed <= 0:
        raise ValueError(f"no non-special id in [random_low, vocab_size) = [{random_low}, {vocab_size}) "
                         f"to use as a random replacement")

    labels = np.full(tokens.shape, IGNORE, dtype=np.int64)
    labels[selected] = tokens[selected]
    corrupted = tokens.copy()
    positions = np.flatnonzero(selected)
    u = rng.random(positions.size)
    corrupted[positions[u < mask_prob]] = mask_id
    to_randomise = positions[(u >= mask_prob) & (u < mask_prob + random_prob)]
    corrupted[to_randomise] = _random_non_special(rng, to_randomise.size, random_low, vocab_size, special)
    return corrupted, labels


def mlm_example(tokens: np.ndarray, rng: np.random.Generator, *, rate: float = 0.15, mask_id: int,
                vocab_size: int, special_ids: Iterable[int], word_start_vocab: np.ndarray | None = None,
                whole_word: bool = False, span: bool = False, mask_prob: float = 0.8,
                random_prob: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Select and corrupt one example: ``select_for_masking`` then ``apply_mask``.

    Tokens whose id is in ``special_ids`` are not maskable (and never a random replacement).
    With ``whole_word`` or ``span`` the word starts are ``word_start_vocab[tokens]``
    (see ``word_start_vocab``); ``span`` without a vocabulary table treats every token as a word.

    Args:
        tokens: (T,) token ids.
        word_start_vocab: (vocab_size,) bool, True for ids that begin a word.

    Returns:
        corrupted: (T,) int64; labels: (T,) int64 with ``IGNORE`` at unselected positions.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    special_ids = tuple(special_ids)
    maskable = ~np.isin(tokens, special_ids)
    word_starts = None
    if whole_word or span:
        if word_start_vocab is not None:
            word_starts = np.asarray(word_start_vocab, dtype=bool)[tokens]
        elif whole_word:
            raise ValueError("whole_word=True needs word_start_vocab, a (vocab_size,) bool table of word-start ids")
    selected = select_for_masking(tokens, rng, rate=rate, maskable=maskable, word_starts=word_starts, span=span)
    return apply_mask(tokens, selected, rng, mask_id=mask_id, vocab_size=vocab_size, special_ids=special_ids,
                      mask_prob=mask_prob, random_prob=random_prob)


def word_start_vocab(id_to_token: Sequence[str], *, continuation_prefix: str | None = "##",
                     start_prefix: str | None = None) -> np.ndarray:
    """(vocab_size,) bool table of the ids that begin a word, for whole-word and span masking.

    WordPiece (BERT) marks continuations (``continuation_prefix="##"``); SentencePiece ("▁") and
    byte-level BPE ("Ġ") mark word starts instead (``continuation_prefix=None, start_prefix="▁"``).

    Args:
        id_to_token: token string of every id, in id order.
    """
    if (continuation_prefix is None) == (start_prefix is None):
        raise ValueError(f"give exactly one of continuation_prefix ({continuation_prefix!r}) "
                         f"and start_prefix ({start_prefix!r})")
    if continuation_prefix is not None:
        return np.array([not t.startswith(continuation_prefix) for t in id_to_token], dtype=bool)
    return np.array([t.startswith(start_prefix) for t in id_to_token], dtype=bool)


def electra_labels(original: np.ndarray, corrupted: np.ndarray) -> np.ndarray:
    """Replaced-token-detection targets (ELECTRA, Clark et al. 2020 §2).

    A generator sample that happens to equal the original token counts as original (label 0).

    Args:
        original, corrupted: (T,) or (B, T) token ids of the same shape.

    Returns:
        int64 array of that shape: 1 where ``corrupted != original``, else 0.
    """
    original, corrupted = np.asarray(original), np.asarray(corrupted)
    if original.shape != corrupted.shape:
        raise ValueError(f"original {original.shape} and corrupted {corrupted.shape} must have the same shape")
    return (corrupted != original).astype(np.int64)


def sentence_pair(sentences_a_doc: list[np.ndarray], rng: np.random.Generator, *, task: Literal["nsp", "sop"],
                  max_tokens: int,
                  random_sentences: Callable[[np.random.Generator], list[np.ndarray]] | None = None,
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """Build one (segment A, segment B, label) example for NSP or SOP.

    The document's consecutive sentences are split at a uniform boundary k in [1, n-1] into
    A = sentences[:k] and B = sentences[k:] (a one-sentence document is split inside the sentence
    at a uniform token boundary). Then, with probability 0.5 each:
        - ``"nsp"`` (BERT §3.1): B is kept (label 0, IsNext) or replaced by the concatenation of
          ``random_sentences(rng)``, sentences from another document (label 1, NotNext).
        - ``"sop"`` (ALBERT §4.1): the order is kept (label 0) or A and B are swapped (label 1).
    Finally BERT's ``truncate_seq_pair``: while len(A) + len(B) > ``max_tokens``, drop one token
    from the longer segment (B on a tie), from its front or back with probability 0.5 each
    (computed in closed form: the same distribution as BERT's token-by-token loop).

    Args:
        sentences_a_doc: consecutive sentences of one document, each a 1-D token-id array.
        rng: the generator every random choice is drawn from (``random_sentences`` gets it too).
        task: ``"nsp"`` or ``"sop"``.
        max_tokens: budget for A and B together, without special tokens (BERT: max_seq_len - 3).
        random_sentences: returns sentences of a random other document; required for ``"nsp"``.

    Returns:
        segment_a, segment_b: 1-D int64 arrays, both non-empty; label: 0 or 1.
    """
    if task not in ("nsp", "sop"):
        raise ValueError(f"task ({task!r}) must be 'nsp' or 'sop'")
    if task == "nsp" and random_sentences is None:
        raise ValueError("task='nsp' needs random_sentences, a function rng -> sentences of another document")
    if max_tokens < 2:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 2 to fit a token from each segment")
    sentences = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sentences_a_doc]
    sentences = [s for s in sentences if s.size > 0]
    if len(sentences) == 1:
        (only,) = sentences
        if only.size < 2:
            raise ValueError(f"a one-sentence document needs >= 2 tokens to split, got {only.size}")
        cut = int(rng.integers(1, only.size))
        a, b = only[:cut], only[cut:]
    elif len(sentences) > 1:
        k = int(rng.integers(1, len(sentences)))
        a, b = np.concatenate(sentences[:k]), np.concatenate(sentences[k:])
    else:
        raise ValueError("sentences_a_doc has no non-empty sentence")

    label = int(rng.random() < 0.5)
    if label and task == "nsp":
        other = [np.asarray(s, dtype=np.int64).reshape(-1) for s in random_sentences(rng)]
        b = np.concatenate(other) if other else np.zeros(0, dtype=np.int64)
        if b.size == 0:
            raise ValueError("random_sentences returned no tokens")
    elif label:  # sop: swapped order
        a, b = b, a
    return (*_truncate_pair(a, b, max_tokens, rng), label)


def _bool_like(mask: np.ndarray, tokens: np.ndarray, name: str) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.shape != tokens.shape:
        raise ValueError(f"{name} has shape {mask.shape}, expected {tokens.shape} like tokens")
    return mask.astype(bool, copy=False)


def _word_bounds(maskable: np.ndarray, word_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    prev_maskable = np.concatenate([[False], maskable[:-1]])
    is_start = maskable & (word_starts | ~prev_maskable)  # a continuation after a special token starts a word
    starts = np.flatnonzero(is_start)
    breaks = np.flatnonzero(np.append(is_start | ~maskable, True))  # positions a word cannot extend into; T last
    ends = breaks[np.searchsorted(breaks, starts, side="right")]
    return starts, ends


def _choose_whole_words(lengths: np.ndarray, budget: int, rng: np.random.Generator) -> np.ndarray:
    order = rng.permutation(lengths.size)
    chosen, count = [], 0
    for w in order:
        if count + lengths[w] <= budget:
            chosen.append(w)
            count += lengths[w]
            if count == budget:
                break
    if not chosen:  # every word is longer than the whole budget: take one anyway
        chosen.append(order[0])
    return np.array(chosen, dtype=np.int64)


def _choose_spans(starts: np.ndarray, ends: np.ndarray, budget: int, rng: np.random.Generator,
                  p: float, max_span: int) -> np.ndarray:
    lengths = ends - starts  # (W,) tokens per word
    adjacent = np.append(ends[:-1] == starts[1:], False)  # (W,) word w+1 follows word w with nothing between
    span_lengths = np.arange(1, max_span + 1)
    probs = p * (1 - p) ** (span_lengths - 1)  # SpanBERT: Geometric(p) truncated to [1, max_span], renormalised
    cdf = np.cumsum(probs) / probs.sum()  # (max_span,)
    free = np.ones(lengths.size, dtype=bool)
    count = 0
    while count < budget:
        candidates = np.flatnonzero(free & (lengths <= budget - count))
        if candidates.size == 0:
            if count > 0:
                break
            candidates = np.flatnonzero(free)  # every word exceeds the budget: take one anyway
        n_words = span_lengths[min(int(np.searchsorted(cdf, rng.random(), side="right")), max_span - 1)]
        w = candidates[rng.integers(candidates.size)]
        free[w] = False
        count += lengths[w]
        for _ in range(n_words - 1):
            if not (adjacent[w] and free[w + 1] and count + lengths[w + 1] <= budget):
                break
            w += 1
            free[w] = False
            count += lengths[w]
    return np.flatnonzero(~free)


def _fill_ranges(size: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    edges = np.zeros(size + 1, dtype=np.int64)
    np.add.at(edges, starts, 1)
    np.add.at(edges, ends, -1)
    return np.cumsum(edges[:-1]) > 0


def _truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    excess = a.size + b.size - max_tokens
    if excess <= 0:
        return a, b
    # BERT's loop trims the longer segment (B on ties) one token at a time: first the length gap,
    # then alternately B, A, B, ... — so B loses ceil and A floor of the remainder.
    gap = min(abs(a.size - b.size), excess)
    rest = excess - gap
    cut_a = rest // 2 + (gap if a.size > b.size else 0)
    cut_b = rest - rest // 2 + (gap if a.size <= b.size else 0)
    return _trim_random_ends(a, cut_a, rng), _trim_random_ends(b, cut_b, rng)


def _trim_random_ends(x: np.ndarray, n_cut: int, rng: np.random.Generator) -> np.ndarray:
    front = int(rng.binomial(n_cut, 0.5))  # each dropped token is the first or the last with probability 0.5
    return x[front:x.size - (n_cut - front)]


def _random_non_special(rng: np.random.Generator, n: int, low: int, high: int, special: np.ndarray) -> np.ndarray:
    ids = rng.integers(low, high, size=n)
    bad = np.isin(ids, special)
    while bad.any():  # rejection sampling: uniform over the allowed ids, fast since specials are few
        ids[bad] = rng.integers(low, high, size=int(bad.sum()))
        bad = np.isin(ids, special)
    return ids
