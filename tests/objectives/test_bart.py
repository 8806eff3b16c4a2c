"""BART noising functions by invariants: what survives is the original in order, the noised amount
matches the ratio, permutation and rotation only reorder, every combination runs."""

import itertools

import numpy as np
import pytest

from pretune.objectives.bart import (
    DenoiseConfig,
    denoise,
    document_rotation,
    sentence_permutation,
    text_infilling,
    token_deletion,
    token_masking,
)

MASK = 3
# "Thank you for inviting me to your party last week ." -> ids 10..20
SENTENCE = np.arange(10, 21, dtype=np.int64)


def _tokenized(n: int, seed: int) -> np.ndarray:
    """Zipf-distributed ids in [200, 32000), like a real tokenized text; never the mask id."""
    rng = np.random.default_rng(seed)
    return (200 + rng.zipf(1.2, size=n) % 31800).astype(np.int64)


def _is_subsequence(short: np.ndarray, long: np.ndarray) -> bool:
    it = iter(long.tolist())
    return all(tok in it for tok in short.tolist())


def _document(n_sentences: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Distinct token ids (position + 1000) in sentences of 3..15 tokens; returns (tokens, sent_starts)."""
    lengths = rng.integers(3, 16, size=n_sentences)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return np.arange(lengths.sum(), dtype=np.int64) + 1000, starts


def test_token_masking_changes_only_masked_positions():
    rng = np.random.default_rng(0)
    for n in (1, 11, 100, 512):
        tokens = _tokenized(n, n)
        source = token_masking(tokens, rng, mask_id=MASK, ratio=0.15)
        assert source.shape == tokens.shape and source.dtype == np.int64
        changed = source != tokens
        assert np.all(source[changed] == MASK)
        assert changed.sum() in (int(n * 0.15), int(n * 0.15) + 1)  # stochastic rounding of ratio * T
    masked = sum((token_masking(_tokenized(100, s), rng, mask_id=MASK) == MASK).sum() for s in range(300))
    assert abs(masked / 30_000 - 0.15) < 0.005  # unbiased even where 0.15 * T is not an integer


def test_token_deletion_is_an_ordered_subsequence_with_ratio_removed():
    rng = np.random.default_rng(1)
    removed = 0
    for seed in range(100):
        tokens = _tokenized(301, seed)
        source = token_deletion(tokens, rng, ratio=0.2)
        assert _is_subsequence(source, tokens)
        assert len(tokens) - len(source) in (60, 61)  # 301 * 0.2 = 60.2
        removed += len(tokens) - len(source)
    assert abs(removed / (100 * 301) - 0.2) < 0.005


def _check_infilling(tokens: np.ndarray, source: np.ndarray) -> tuple[int, int]:
    """For distinct increasing ids: kept tokens in order, every gap of removed tokens holds >= 1 mask.

    Returns (number of masks, number of inserted masks with no removed token beside them).
    """
    kept = source[source != MASK]
    assert np.all(np.diff(kept) > 0) and np.isin(kept, tokens).all()
    pos = np.concatenate(([-1], np.searchsorted(tokens, kept), [len(tokens)]))  # original positions, padded
    masks_between = np.diff(np.concatenate(([-1], np.flatnonzero(source != MASK), [len(source)]))) - 1
    gaps = np.diff(pos) - 1  # removed tokens between consecutive kept tokens
    assert np.all(masks_between[gaps > 0] >= 1)
    inserted = int(masks_between[gaps == 0].sum())
    return int((source == MASK).sum()), inserted


def test_text_infilling_spans_become_one_mask_each():
    rng = np.random.default_rng(2)
    tokens = np.arange(1000, 1512, dtype=np.int64)
    n_masks = n_inserted = removed = 0
    for _ in range(200):
        source = text_infilling(tokens, rng, mask_id=MASK, ratio=0.3, poisson_lambda=3.0)
        masks, inserted = _check_infilling(tokens, source)
        n_masks += masks
        n_inserted += inserted
        removed += len(tokens) - (len(source) - masks)
    assert abs(removed / (200 * 512) - 0.3) < 0.005
    # spans cover 0.3 * 512 = 153.6 tokens at 3 per span on average: ~51 spans (one mask each), plus about
    # one for the trimmed last span; a fraction e^-3 = 5% of them have length 0 and insert a mask
    assert abs(n_masks / 200 - 153.6 / 3) < 3
    assert 0.02 < n_inserted / n_masks < 0.1


@pytest.mark.parametrize(("ratio", "lam"), [(0.0, 3.0), (0.05, 0.5), (0.5, 10.0), (0.9, 3.0)])
def test_text_infilling_other_settings(ratio, lam):
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 20, 200):
        tokens = np.arange(1000, 1000 + n, dtype=np.int64)
        source = text_infilling(tokens, rng, mask_id=MASK, ratio=ratio, poisson_lambda=lam)
        masks, _ = _check_infilling(tokens, source)
        assert len(tokens) - (len(source) - masks) in (int(n * ratio), int(n * ratio) + 1)
    if ratio == 0.0:
        assert np.array_equal(text_infilling(SENTENCE, rng, mask_id=MASK, ratio=0.0), SENTENCE)


def test_sentence_permutation_keeps_the_sentences():
    rng = np.random.default_rng(4)
    changed = 0
    for _ in range(50):
        tokens, starts = _document(int(rng.integers(1, 8)), rng)
        source = sentence_permutation(tokens, starts, rng)
        assert sorted(source.tolist()) == tokens.tolist()
        sentences = sorted(tuple(s) for s in np.split(tokens, starts[1:]))
        # cut the source where a sentence's first token appears: the pieces are the original sentences
        cuts = np.flatnonzero(np.isin(source, tokens[starts]))
        assert cuts[0] == 0
        assert sorted(tuple(s) for s in np.split(source, cuts[1:])) == sentences
        changed += not np.array_equal(source, tokens)
    assert changed > 30
    thanks = sentence_permutation(np.array([1, 2, 3, 4, 5, 6, 7]), np.array([0, 3]), np.random.default_rng(0))
    assert thanks.tolist() in ([1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 1, 2, 3])


@pytest.mark.parametrize("starts", [[1, 3], [0, 3, 3], [0, 5, 2], [0, 11]])
def test_sentence_permutation_rejects_bad_starts(starts):
    with pytest.raises(ValueError, match="sent_starts"):
        sentence_permutation(SENTENCE, np.array(starts), np.random.default_rng(0))


def test_document_rotation_is_a_cyclic_rotation():
    rng = np.random.default_rng(5)
    offsets = set()
    for _ in range(200):
        source = document_rotation(SENTENCE, rng)
        k = int(np.flatnonzero(SENTENCE == source[0])[0])
        assert np.array_equal(source, np.roll(SENTENCE, -k))
        offsets.add(k)
    assert offsets == set(range(11))  # every token can start the document
    word_starts = np.isin(SENTENCE, [10, 13, 17])  # pretend "inviting" and "party" start multi-token words
    firsts = {int(document_rotation(SENTENCE, rng, word_starts=word_starts)[0]) for _ in range(100)}
    assert firsts == {10, 13, 17}
    assert document_rotation(SENTENCE[:0], rng).shape == (0,)
    with pytest.raises(ValueError, match="word_starts"):
        document_rotation(SENTENCE, rng, word_starts=np.ones(5, dtype=bool))
    with pytest.raises(ValueError, match="no word start"):
        document_rotation(SENTENCE, rng, word_starts=np.zeros(11, dtype=bool))


def test_denoise_every_combination():
    rng = np.random.default_rng(6)
    for mask_ratio, delete_ratio, infill_ratio, permute, rotate in itertools.product(
        (0.0, 0.15), (0.0, 0.1), (0.0, 0.3), (False, True), (False, True)
    ):
        cfg = DenoiseConfig(mask_ratio=mask_ratio, delete_ratio=delete_ratio, infill_ratio=infill_ratio,
                            permute_sentences=permute, rotate=rotate)
        for _ in range(3):
            tokens, starts = _document(6, rng)
            word_starts = tokens % 2 == 0
            source, target = denoise(tokens, rng, cfg, mask_id=MASK, sent_starts=starts, word_starts=word_starts)
            assert np.array_equal(target, tokens) and target is not tokens
            assert source.ndim == 1 and source.dtype == np.int64
            kept = source[source != MASK]
            assert len(set(kept.tolist())) == len(kept) and np.isin(kept, tokens).all()  # nothing invented
            if not (mask_ratio or infill_ratio):
                assert not (source == MASK).any()
            if not (mask_ratio or delete_ratio or infill_ratio):
                assert sorted(source.tolist()) == tokens.tolist()
                if rotate:
                    assert source[0] % 2 == 0  # a word start of the original, followed through the permutation
            if not (permute or rotate):
                assert _is_subsequence(kept, tokens)
            if not (mask_ratio or delete_ratio or infill_ratio or permute or rotate):
                assert np.array_equal(source, tokens)


def test_denoise_defaults_are_infilling_plus_permutation():
    cfg = DenoiseConfig()
    assert (cfg.infill_ratio, cfg.poisson_lambda, cfg.permute_sentences) == (0.3, 3.0, True)
    assert (cfg.mask_ratio, cfg.delete_ratio, cfg.rotate) == (0.0, 0.0, False)
    tokens, starts = _document(20, np.random.default_rng(7))
    source, target = denoise(tokens, np.random.default_rng(7), cfg, mask_id=MASK, sent_starts=starts)
    assert (source == MASK).any() and not _is_subsequence(source[source != MASK], tokens)


def test_bad_arguments_raise():
    rng = np.random.default_rng(8)
    with pytest.raises(ValueError, match=r"infill_ratio \(1.0\)"):
        DenoiseConfig(infill_ratio=1.0)
    with pytest.raises(ValueError, match=r"mask_ratio \(-0.1\)"):
        DenoiseConfig(mask_ratio=-0.1)
    with pytest.raises(ValueError, match=r"poisson_lambda \(0"):
        DenoiseConfig(poisson_lambda=0)
    with pytest.raises(ValueError, match="mask_id"):
        denoise(SENTENCE, rng, DenoiseConfig(permute_sentences=False), mask_id=None)
    with pytest.raises(ValueError, match="sent_starts"):
        denoise(SENTENCE, rng, DenoiseConfig(), mask_id=MASK)
    with pytest.raises(ValueError, match=r"ratio \(1.5\)"):
        token_deletion(SENTENCE, rng, ratio=1.5)
    with pytest.raises(ValueError, match="poisson_lambda"):
        text_infilling(SENTENCE, rng, mask_id=MASK, poisson_lambda=-1.0)
    with pytest.raises(ValueError, match="mask_id"):
        token_masking(SENTENCE, rng, mask_id=None)
    # no mask needed when only deletion and permutation are on
    source, _ = denoise(SENTENCE, rng, DenoiseConfig(infill_ratio=0.0, delete_ratio=0.2), mask_id=None,
                        sent_starts=np.array([0, 4]))
    assert len(source) in (8, 9)  # 11 * 0.2 = 2.2 deleted
