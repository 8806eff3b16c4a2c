"""T5's unsupervised objectives as (source, target) corruptions of one block of token ids.

Raffel et al. 2019, Table 3 / §3.3, on "Thank you for inviting me to your party last week .":

    objective               source (encoder input)                           target (decoder output)
    prefix LM               Thank you for inviting                           me to your party last week .
    BERT-style              Thank you <M> <M> me to your party apple week .  (original text)
    deshuffling             party me for your to . last fun you inviting week Thank   (original text)
    i.i.d. mask tokens      Thank you <M> <M> me to your party <M> week .    (original text)
    i.i.d. replace spans    Thank you <X> me to your party <Y> week .        <X> for inviting <Y> last <Z>
    i.i.d. drop tokens      Thank you me to your party week .                for inviting last
    random spans (default)  Thank you <X> to <Y> week .                      <X> for inviting me <Y> your party last <Z>

Every function takes a 1-D int64 array of token ids without special tokens and a
``np.random.Generator``, and returns 1-D int64 arrays without EOS (the collator appends it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _as_tokens(tokens) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {arr.shape}")
    return arr


def _check_density(noise_density: float) -> None:
    if not 0.0 <= noise_density < 1.0:
        raise ValueError(f"noise_density ({noise_density}) must be in [0, 1)")


def _iid_noise_mask(length: int, rng: np.random.Generator, noise_density: float) -> np.ndarray:
    return rng.random(length) < noise_density  # T5's iid_noise_mask: each token independently


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random split of ``num_items`` into ``num_segments`` positive parts."""
    cuts = np.sort(rng.choice(num_items - 1, size=num_segments - 1, replace=False)) + 1
    return np.diff(np.concatenate(([0], cuts, [num_items])))


def random_spans_noise_mask(
    length: int, rng: np.random.Generator, *, noise_density: float = 0.15, mean_span: float = 3.0
) -> np.ndarray:
    """T5's span-corruption mask: about ``noise_density`` of the tokens, in spans of mean length ``mean_span``.

    The algorithm of T5's ``random_spans_noise_mask``: ``num_noise = round(length * noise_density)``
    clipped to [1, length - 1], ``num_spans = max(1, round(num_noise / mean_span))``; the noise and the
    non-noise tokens are each split into ``num_spans`` random positive segments, interleaved
    non-noise first (so the mask always starts with kept tokens and ends with a noise span).
    Lengths below 2 are computed as length 2 and truncated, as in T5: length 1 gives ``[False]``.
    ``num_spans`` is also capped at the number of non-noise tokens so that every segment is
    non-empty (only reachable with densities far above 0.15; T5 would emit empty segments there).

    Args:
        length: number of tokens in the block.
        rng: the random generator.
        noise_density: fraction of tokens to corrupt, in [0, 1).
        mean_span: mean noise span length, >= 1.

    Returns:
        (length,) bool array, True = noise.
    """
    _check_density(noise_density)
    if mean_span < 1:
        raise ValueError(f"mean_span ({mean_span}) must be >= 1")
    if length < 0:
        raise ValueError(f"length ({length}) must be >= 0")
    if length == 0:
        return np.zeros(0, dtype=bool)
    orig_length, length = length, max(length, 2)
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_nonnoise = length - num_noise
    num_spans = min(max(int(round(num_noise / mean_span)), 1), num_nonnoise)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    nonnoise_lengths = _random_segmentation(num_nonnoise, num_spans, rng)
    span_lengths = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)  # (2 * num_spans,)
    is_noise = np.tile([False, True], num_spans)
    return np.repeat(is_noise, span_lengths)[:orig_length]


def mask_to_sentinels(tokens, noise_mask: np.ndarray, *, sentinel_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Turn a noise mask into T5's sentinel format: each noise span -> one sentinel in the source.

    Span i (in order) becomes ``sentinel_ids[i]`` in the source; the target is, for every span,
    its sentinel followed by the dropped tokens, then one final sentinel that closes the last span:
    "Thank you <X> me to your party <Y> week ." -> "<X> for inviting <Y> last <Z>".

    Args:
        tokens: (T,) int token ids.
        noise_mask: (T,) bool, True = corrupted.
        sentinel_ids: ids of <extra_id_0>, <extra_id_1>, ...; needs (number of spans + 1) of them.

    Returns:
        source (T - num_noise + num_spans,) and target (num_noise + num_spans + 1,) int64 arrays.
    """
    tokens = _as_tokens(tokens)
    noise_mask = np.asarray(noise_mask, dtype=bool)
    if noise_mask.shape != tokens.shape:
        raise ValueError(f"noise_mask shape {noise_mask.shape} must equal tokens shape {tokens.shape}")
    span_start = noise_mask & ~np.concatenate(([False], noise_mask[:-1]))  # (T,)
    num_spans = int(span_start.sum())
    if num_spans + 1 > len(sentinel_ids):
        raise ValueError(
            f"{num_spans} noise spans need {num_spans + 1} sentinel ids (one per span plus a final one), "
            f"got {len(sentinel_ids)}"
        )
    sentinels = np.asarray(sentinel_ids[: num_spans + 1], dtype=np.int64)
    span_index = np.cumsum(span_start) - 1  # (T,) index of the span a noise token belongs to
    source = np.where(span_start, sentinels[np.maximum(span_index, 0)], tokens)[~noise_mask | span_start]
    starts_in_noise = np.flatnonzero(span_start[noise_mask])  # where each span begins among the noise tokens
    target = np.insert(tokens[noise_mask], starts_in_noise, sentinels[:num_spans])
    return source, np.append(target, sentinels[num_spans])


def merge_span_corruption(source, target, sentinel_ids: Sequence[int]) -> np.ndarray:
    """Rebuild the original tokens from a sentinel-format (source, target) pair (for tests and debugging).

    Each sentinel in ``source`` is replaced by the tokens that follow the same sentinel in
    ``target`` (up to the next sentinel). Inverse of :func:`span_corruption` and
    :func:`iid_replace_spans`; a trailing EOS, if present, must be stripped first.

    Args:
        source: (S,) int ids with sentinels.
        target: (U,) int ids: sentinel, span, sentinel, span, ..., final sentinel.
        sentinel_ids: the sentinel ids used to corrupt.

    Returns:
        (T,) int64 original tokens.
    """
    source, target = _as_tokens(source), _as_tokens(target)
    sentinel_set = {int(s) for s in sentinel_ids}
    is_sentinel = np.isin(target, list(sentinel_set))
    starts = np.flatnonzero(is_sentinel)
    if len(target) and (len(starts) == 0 or starts[0] != 0):
        raise ValueError(f"target must start with a sentinel, got {target[:5].tolist()}...")
    spans = {int(target[s]): target[s + 1 : e] for s, e in zip(starts, np.append(starts[1:], len(target)))}
    pieces = []
    for tok in source:
        if int(tok) in spans:
            pieces.append(spans[int(tok)])
        elif int(tok) in sentinel_set:
            raise ValueError(f"sentinel {int(tok)} is in the source but not in the target")
        else:
            pieces.append(np.array([tok], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def span_corruption(
    tokens,
    rng: np.random.Generator,
    *,
    sentinel_ids: Sequence[int],
    noise_density: float = 0.15,
    mean_span: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """T5's objective: drop ~15% of tokens in spans of mean length 3, each span -> a unique sentinel.

    "Thank you for inviting me to your party last week ." ->
    source "Thank you <X> me to your party <Y> week .", target "<X> for inviting <Y> last <Z>"
    (Raffel et al. 2019 Figure 2; the mask comes from :func:`random_spans_noise_mask`).

    Args:
        tokens: (T,) int token ids, no special tokens.
        rng: the random generator.
        sentinel_ids: ids of <extra_id_0>, <extra_id_1>, ... in order; at least (spans + 1) of them.
        noise_density: fraction of tokens dropped.
        mean_span: mean span length.

    Returns:
        (source, target) 1-D int64 arrays, no EOS.
    """
    tokens = _as_tokens(tokens)
    mask = random_spans_noise_mask(len(tokens), rng, noise_density=noise_density, mean_span=mean_span)
    return mask_to_sentinels(tokens, mask, sentinel_ids=sentinel_ids)


def iid_replace_spans(
    tokens, rng: np.random.Generator, *, sentinel_ids: Sequence[int], noise_density: float = 0.15
) -> tuple[np.ndarray, np.ndarray]:
    """I.i.d. token noise; consecutive noised tokens merge into one span, then the sentinel format.

    "Thank you <X> me to your party <Y> week ." -> "<X> for inviting <Y> last <Z>" (Table 3).
    Each token is noised independently with probability ``noise_density``, so the number of spans
    varies; a ValueError is raised when a block has more spans than ``sentinel_ids`` allow.

    Returns:
        (source, target) 1-D int64 arrays, no EOS.
    """
    tokens = _as_tokens(tokens)
    _check_density(noise_density)
    mask = _iid_noise_mask(len(tokens), rng, noise_density)
    return mask_to_sentinels(tokens, mask, sentinel_ids=sentinel_ids)


def iid_mask_tokens(
    tokens, rng: np.random.Generator, *, mask_id: int, noise_density: float = 0.15
) -> tuple[np.ndarray, np.ndarray]:
    """I.i.d. noise, each noised token -> ``mask_id``; the target is the original text.

    "Thank you <M> <M> me to your party <M> week ." -> "Thank you for inviting me to your party last week ."

    Returns:
        source (T,) and target (T,) int64 arrays.
    """
    tokens = _as_tokens(tokens)
    _check_density(noise_density)
    mask = _iid_noise_mask(len(tokens), rng, noise_density)
    return np.where(mask, np.int64(mask_id), tokens), tokens.copy()


def _uniform_excluding(
    rng: np.random.Generator, size: int, low: int, high: int, excluded: Sequence[int]
) -> np.ndarray:
    """``size`` ids uniform over [low, high) minus ``excluded``, without building the whole range."""
    skip = np.unique(np.asarray([e for e in excluded if low <= e < high], dtype=np.int64))
    if high - low - len(skip) <= 0:
        raise ValueError(f"no id left in [{low}, {high}) after excluding special ids {list(excluded)}")
    out = rng.integers(low, high - len(skip), size=size, dtype=np.int64)
    for s in skip:  # shift past each excluded id in increasing order: a bijection onto the allowed ids
        out += out >= s
    return out


def bert_style(
    tokens,
    rng: np.random.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    noise_density: float = 0.15,
    special_ids: Sequence[int] = (),
    random_low: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking as a text-to-text objective: of the ~15% selected tokens, 80% -> mask,
    10% -> a random token, 10% kept; the target is the original text (Raffel et al. 2019 §3.3.1).

    "Thank you <M> <M> me to your party apple week ." -> "Thank you for inviting me to your party last week ."

    Args:
        tokens: (T,) int token ids.
        rng: the random generator.
        mask_id: id of the mask token.
        vocab_size: random ids are drawn uniformly from [random_low, vocab_size) ...
        noise_density: fraction of tokens selected (i.i.d. per token).
        special_ids: ... never one of these (e.g. pad, EOS, sentinels, the mask itself).
        random_low: lowest id a random replacement may take (skip a block of special ids at 0).

    Returns:
        source (T,) and target (T,) int64 arrays.
    """
    tokens = _as_tokens(tokens)
    _check_density(noise_density)
    if not 0 <= random_low < vocab_size:
        raise ValueError(f"random_low ({random_low}) must be in [0, vocab_size={vocab_size})")
    selected = _iid_noise_mask(len(tokens), rng, noise_density)
    u = rng.random(len(tokens))
    to_mask = selected & (u < 0.8)  # BERT: 80% [MASK], 10% random, 10% unchanged (Devlin et al. 2019 §3.1)
    to_random = selected & (u >= 0.8) & (u < 0.9)
    source = np.where(to_mask, np.int64(mask_id), tokens)
    source[to_random] = _uniform_excluding(rng, int(to_random.sum()), random_low, vocab_size, special_ids)
    return source, tokens.copy()


def drop_tokens(tokens, rng: np.random.Generator, *, noise_density: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """I.i.d. noise, noised tokens removed from the source; the target is the dropped tokens in order.

    "Thank you me to your party week ." -> "for inviting last"

    Returns:
        source (T - k,) and target (k,) int64 arrays, k = number of dropped tokens.
    """
    tokens = _as_tokens(tokens)
    _check_density(noise_density)
    mask = _iid_noise_mask(len(tokens), rng, noise_density)
    return tokens[~mask], tokens[mask]


def deshuffle(tokens, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Source = the tokens in random order; target = the original text.

    "party me for your to . last fun you inviting week Thank" -> "Thank you for inviting me to your party last week ."

    Returns:
        source (T,) and target (T,) int64 arrays.
    """
    tokens = _as_tokens(tokens)
    return rng.permutation(tokens), tokens.copy()


def prefix_lm_split(
    tokens, rng: np.random.Generator, *, split: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Prefix LM: source = a prefix, target = its continuation.

    "Thank you for inviting" -> "me to your party last week ."

    Args:
        tokens: (T,) int token ids, T >= 2.
        rng: the random generator.
        split: None: the split point is uniform in [1, T-1]; a fraction in (0, 1): at round(T * split),
            clipped to [1, T-1].

    Returns:
        source (k,) and target (T - k,) int64 arrays, both non-empty.
    """
    tokens = _as_tokens(tokens)
    if len(tokens) < 2:
        raise ValueError(f"prefix_lm_split needs at least 2 tokens, got {len(tokens)}")
    if split is None:
        k = int(rng.integers(1, len(tokens)))  # uniform in [1, T-1]
    elif 0.0 < split < 1.0:
        k = min(max(int(round(len(tokens) * split)), 1), len(tokens) - 1)
    else:
        raise ValueError(f"split ({split}) must be None or in (0, 1)")
    return tokens[:k].copy(), tokens[k:].copy()
