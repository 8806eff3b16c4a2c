"""T5 objectives by invariants: span corruption round-trips to the original, noise statistics match
the paper's 15% / mean span 3, the other Table 3 variants keep what they promise."""

import numpy as np
import pytest

from pretune.objectives.t5 import (
    bert_style,
    deshuffle,
    drop_tokens,
    iid_mask_tokens,
    iid_replace_spans,
    mask_to_sentinels,
    merge_span_corruption,
    prefix_lm_split,
    random_spans_noise_mask,
    span_corruption,
)

# "Thank you for inviting me to your party last week ." -> ids 10..20
THANK, YOU, FOR, INVITING, ME, TO, YOUR, PARTY, LAST, WEEK, DOT = range(10, 21)
SENTENCE = np.arange(10, 21, dtype=np.int64)
SENTINELS = list(range(100, 200))  # <X> = 100, <Y> = 101, <Z> = 102, ...
X, Y, Z = SENTINELS[:3]


def _tokenized(n: int, seed: int) -> np.ndarray:
    """Zipf-distributed ids in [200, 32000), like a real tokenized text; never a sentinel."""
    rng = np.random.default_rng(seed)
    return (200 + rng.zipf(1.2, size=n) % 31800).astype(np.int64)


def _is_sentinel(arr: np.ndarray) -> np.ndarray:
    return np.isin(arr, SENTINELS)


def test_sentinel_format_reproduces_the_paper_example():
    mask = np.isin(SENTENCE, [FOR, INVITING, LAST])
    source, target = mask_to_sentinels(SENTENCE, mask, sentinel_ids=SENTINELS)
    assert source.tolist() == [THANK, YOU, X, ME, TO, YOUR, PARTY, Y, WEEK, DOT]
    assert target.tolist() == [X, FOR, INVITING, Y, LAST, Z]
    assert source.dtype == target.dtype == np.int64
    assert merge_span_corruption(source, target, SENTINELS).tolist() == SENTENCE.tolist()


def test_span_corruption_round_trips_and_sentinels_are_in_order():
    lengths = list(range(1, 40)) + [64, 127, 128, 255, 256, 511, 512, 600]
    for seed in range(5):
        rng = np.random.default_rng(seed)
        for n in lengths:
            tokens = _tokenized(n, seed * 1000 + n)
            source, target = span_corruption(tokens, rng, sentinel_ids=SENTINELS)
            assert np.array_equal(merge_span_corruption(source, target, SENTINELS), tokens)
            k = int(_is_sentinel(source).sum())
            assert source[_is_sentinel(source)].tolist() == SENTINELS[:k]
            assert target[_is_sentinel(target)].tolist() == SENTINELS[: k + 1]  # one per span + the final one
            assert target[0] == SENTINELS[0] and target[-1] == SENTINELS[k]
            assert len(source) - k + len(target) - (k + 1) == n  # every token is in exactly one side


def test_span_corruption_noise_statistics_match_the_paper():
    rng = np.random.default_rng(0)
    noise = spans = total = 0
    for n in rng.integers(50, 600, size=300):
        mask = random_spans_noise_mask(int(n), rng)
        noise += mask.sum()
        spans += (mask & ~np.concatenate(([False], mask[:-1]))).sum()
        total += n
    assert abs(noise / total - 0.15) < 0.01  # noise_density = 0.15 (Raffel et al. 2019 §3.1.4)
    assert abs(noise / spans - 3.0) < 0.3  # mean_span = 3


@pytest.mark.parametrize("n", [2, 3, 10, 100, 512])
def test_random_spans_noise_mask_counts_follow_t5(n):
    mask = random_spans_noise_mask(n, np.random.default_rng(n), noise_density=0.15, mean_span=3.0)
    num_noise = min(max(round(n * 0.15), 1), n - 1)
    num_spans = max(round(num_noise / 3.0), 1)
    assert mask.shape == (n,) and mask.dtype == bool
    assert mask.sum() == num_noise
    assert (mask & ~np.concatenate(([False], mask[:-1]))).sum() == num_spans
    assert not mask[0] and mask[-1]  # interleaved non-noise first, so it ends with noise


def test_random_spans_noise_mask_short_and_dense():
    rng = np.random.default_rng(0)
    assert random_spans_noise_mask(0, rng).shape == (0,)
    assert random_spans_noise_mask(1, rng).tolist() == [False]  # T5 computes length 2 and truncates
    mask = random_spans_noise_mask(20, rng, noise_density=0.9, mean_span=1.0)  # spans capped by kept tokens
    assert mask.sum() == 18
    source, target = span_corruption(np.arange(1, dtype=np.int64), rng, sentinel_ids=SENTINELS)
    assert source.tolist() == [0] and target.tolist() == [X]


def test_too_few_sentinels_is_an_error_naming_the_numbers():
    tokens = _tokenized(512, 0)  # 77 noise tokens in 26 spans
    with pytest.raises(ValueError, match=r"26 noise spans need 27 sentinel ids.*got 10"):
        span_corruption(tokens, np.random.default_rng(0), sentinel_ids=SENTINELS[:10])


def test_bad_arguments_raise():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="noise_density"):
        span_corruption(SENTENCE, rng, sentinel_ids=SENTINELS, noise_density=1.0)
    with pytest.raises(ValueError, match="mean_span"):
        random_spans_noise_mask(10, rng, mean_span=0.5)
    with pytest.raises(ValueError, match="1-D"):
        drop_tokens(np.zeros((2, 3), dtype=np.int64), rng)
    with pytest.raises(ValueError, match="random_low"):
        bert_style(SENTENCE, rng, mask_id=5, vocab_size=10, random_low=10)
    with pytest.raises(ValueError, match="not in the target"):
        merge_span_corruption(np.array([1, X, Y]), np.array([X, 2, Z]), SENTINELS)


def test_iid_replace_spans_round_trips_with_the_right_noise_rate():
    rng = np.random.default_rng(1)
    noise = total = 0
    for seed in range(100):
        tokens = _tokenized(int(rng.integers(1, 600)), seed)
        source, target = iid_replace_spans(tokens, rng, sentinel_ids=SENTINELS)
        assert np.array_equal(merge_span_corruption(source, target, SENTINELS), tokens)
        k = int(_is_sentinel(source).sum())
        assert target[_is_sentinel(target)].tolist() == SENTINELS[: k + 1]
        noise += len(target) - (k + 1)
        total += len(tokens)
    assert abs(noise / total - 0.15) < 0.01


def test_iid_mask_tokens_masks_only_noised_positions():
    rng = np.random.default_rng(2)
    tokens = _tokenized(20_000, 2)
    source, target = iid_mask_tokens(tokens, rng, mask_id=7)
    assert np.array_equal(target, tokens)
    changed = source != tokens
    assert np.all(source[changed] == 7)
    assert abs(changed.mean() - 0.15) < 0.01


def test_drop_tokens_splits_the_tokens_in_order():
    rng = np.random.default_rng(3)
    dropped = total = 0
    for seed in range(50):
        tokens = _tokenized(300, seed)
        source, target = drop_tokens(tokens, rng)
        assert len(source) + len(target) == len(tokens)
        assert sorted(np.concatenate([source, target]).tolist()) == sorted(tokens.tolist())
        dropped += len(target)
        total += len(tokens)
    assert abs(dropped / total - 0.15) < 0.01
    ids = np.arange(1000, dtype=np.int64)  # distinct ids: both sides are increasing subsequences
    source, target = drop_tokens(ids, rng)
    assert np.all(np.diff(source) > 0) and np.all(np.diff(target) > 0)


def test_deshuffle_is_a_permutation():
    rng = np.random.default_rng(4)
    source, target = deshuffle(SENTENCE, rng)
    assert np.array_equal(target, SENTENCE)
    assert sorted(source.tolist()) == SENTENCE.tolist()
    assert not np.array_equal(source, SENTENCE)  # 1 / 11! chance of the identity; fixed seed


def test_bert_style_80_10_10_and_never_a_special_random_token():
    rng = np.random.default_rng(5)
    mask_id, vocab_size = 4, 32000
    # 1M tokens: a kept token is invisible, so the rates are relative to the expected 15% selection and
    # carry its sampling noise too (sd 0.002 here; 0.007 at 100k tokens, too close to the 0.015 bound)
    tokens = _tokenized(1_000_000, 5)
    source, target = bert_style(tokens, rng, mask_id=mask_id, vocab_size=vocab_size)
    assert np.array_equal(target, tokens)
    expected_selected = 0.15 * len(tokens)
    masked = (source == mask_id).sum()
    replaced = ((source != tokens) & (source != mask_id)).sum()  # a random id equal to the original is invisible
    assert abs(masked / expected_selected - 0.8) < 0.015
    assert abs(replaced / expected_selected - 0.1) < 0.015

    specials = [0, 1, 2, 3, 4, 17, 49]  # small vocab: exclusion actually bites
    small = 5 + rng.integers(0, 40, size=100_000)
    small = small[~np.isin(small, specials)]
    source, _ = bert_style(small, rng, mask_id=4, vocab_size=50, special_ids=specials, noise_density=0.5)
    random_ids = source[(source != small) & (source != 4)]
    assert not np.isin(random_ids, specials).any()
    allowed = sorted(set(range(50)) - set(specials))
    counts = np.bincount(random_ids, minlength=50)[allowed]
    assert counts.min() > 0.7 * counts.mean()  # uniform over the allowed ids (about 115 each)
    source, _ = bert_style(small, rng, mask_id=4, vocab_size=50, noise_density=0.5, random_low=30)
    assert source[(source != small) & (source != 4)].min() >= 30


def test_prefix_lm_split_concatenates_to_the_original():
    rng = np.random.default_rng(6)
    points = set()
    for _ in range(200):
        source, target = prefix_lm_split(SENTENCE, rng)
        assert np.array_equal(np.concatenate([source, target]), SENTENCE)
        assert len(source) >= 1 and len(target) >= 1
        points.add(len(source))
    assert points == set(range(1, 11))  # uniform in [1, T-1]
    source, target = prefix_lm_split(SENTENCE, rng, split=0.4)
    assert source.tolist() == [THANK, YOU, FOR, INVITING]  # round(11 * 0.4) = 4, the paper's example
    assert prefix_lm_split(np.array([1, 2]), rng, split=0.01)[0].tolist() == [1]
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        prefix_lm_split(np.array([1]), rng)
    with pytest.raises(ValueError, match="split"):
        prefix_lm_split(SENTENCE, rng, split=1.0)
