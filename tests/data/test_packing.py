"""RoBERTa packing (FULL-/DOC-SENTENCES), held-out splits and deterministic, bucketed batch plans."""

import gzip
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from pretune.data.packing import BlockIndex, batch_plan, pack_blocks, split_index
from pretune.data.store import build_store

CORPUS = Path("/work/shared/data/corpus/austen.txt.gz")
SEP = 3  # [SEP] of the tokenizer below


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not available")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read()
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()][50:350]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(paragraphs, trainers.WordPieceTrainer(vocab_size=1000, special_tokens=specials,
                                                                  show_progress=False))
    assert tok.token_to_id("[SEP]") == SEP
    return build_store(paragraphs, tok, tmp_path_factory.mktemp("store"), show_progress=False)


def _doc_of_token(store, positions):
    doc_starts = np.asarray(store.sent_offsets)[np.asarray(store.doc_offsets)]
    return np.searchsorted(doc_starts, positions, "right") - 1


def _check_blocks(store, index: BlockIndex, block_size: int, sep: int | None):
    """Invariants shared by both modes; returns the blocks."""
    blocks = list(index)
    stream = np.asarray(store.tokens, dtype=np.int64)
    sent_starts = np.asarray(store.sent_offsets)
    sent_len = np.diff(sent_starts)
    is_sent_start = np.zeros(store.n_tokens + 1, dtype=bool)
    is_sent_start[sent_starts] = True
    token_doc = _doc_of_token(store, np.arange(store.n_tokens))
    assert len(index) == len(index.lengths) and index.lengths.sum() == sum(len(b.tokens) for b in blocks)
    pieces = []
    for i, block in enumerate(blocks):
        assert 1 <= len(block.tokens) == index.lengths[i] <= block_size
        assert block.tokens.dtype == np.int64 and block.sent_starts.dtype == np.int64
        assert block.sent_starts[0] == 0 and np.all(np.diff(block.sent_starts) > 0)
        assert block.sent_starts[-1] < len(block.tokens)
        start, end = index.starts[i], index.ends[i]
        assert block.doc_id == _doc_of_token(store, start)
        is_sep = block.tokens == sep if sep is not None else np.zeros(len(block.tokens), bool)
        content = block.tokens[~is_sep]
        np.testing.assert_array_equal(content, stream[start:end])
        pieces.append(content)
        # sentence starts: the store's sentence starts inside the block, plus each separator and what follows it
        stream_pos = start + np.cumsum(~is_sep) - 1  # stream position of each non-separator token
        expected = {0} | {int(p) for p in np.flatnonzero(is_sep)} | {int(p) + 1 for p in np.flatnonzero(is_sep)}
        expected |= set(np.flatnonzero(~is_sep & is_sent_start[stream_pos]).tolist())
        assert set(block.sent_starts.tolist()) == expected, i
        # separators sit exactly at the document boundaries inside the block
        assert is_sep.sum() == (token_doc[end - 1] - token_doc[start] if sep is not None else 0)
        # a block starts at a sentence start, or is a block_size piece of an oversized sentence
        s = np.searchsorted(sent_starts, start, "right") - 1
        assert start == sent_starts[s] or (sent_len[s] > block_size and (start - sent_starts[s]) % block_size == 0)
    np.testing.assert_array_equal(np.concatenate(pieces), stream)  # the whole stream, in order
    return blocks


@pytest.mark.parametrize("block_size", [8, 48, 128])
def test_full_sentences_pack_the_whole_stream(store, block_size):
    index = pack_blocks(store, block_size=block_size, mode="full", doc_sep_id=SEP, cache=False)
    blocks = _check_blocks(store, index, block_size, SEP)
    assert any((b.tokens == SEP).any() for b in blocks)  # blocks do cross documents
    # filled as much as possible: the first sentence of the next block would not have fit
    sent_starts = np.asarray(store.sent_offsets)
    doc_starts = set(np.asarray(store.sent_offsets)[np.asarray(store.doc_offsets)].tolist())
    for i in range(len(index) - 1):
        nxt = index.starts[i + 1]
        s = np.searchsorted(sent_starts, nxt, "right") - 1
        if sent_starts[s] != nxt:
            continue  # a piece of an oversized sentence
        first_len = min(sent_starts[s + 1] - nxt, block_size)
        assert index.lengths[i] + (nxt in doc_starts) + first_len > block_size, i


def test_full_sentences_without_separator(store):
    index = pack_blocks(store, block_size=64, mode="full", cache=False)
    _check_blocks(store, index, 64, None)
    assert np.array_equal(index.lengths, index.ends - index.starts)


@pytest.mark.parametrize("block_size", [8, 128])
def test_doc_sentences_never_cross_documents(store, block_size):
    index = pack_blocks(store, block_size=block_size, mode="doc", doc_sep_id=SEP, cache=False)  # sep is ignored
    assert index.doc_sep_id is None
    _check_blocks(store, index, block_size, None)
    first_doc = _doc_of_token(store, index.starts)
    np.testing.assert_array_equal(first_doc, _doc_of_token(store, index.ends - 1))
    full = pack_blocks(store, block_size=block_size, mode="full", cache=False)
    assert len(index) >= max(len(full), store.n_docs)


def test_full_blocks_are_mostly_full(store):
    # greedy packing of whole sentences; Austen's long sentences (~27 tokens on average with this
    # 1000-word vocabulary) leave ~16% of a 128 block empty on average, <10% of a 512 block
    fill_128 = pack_blocks(store, block_size=128, doc_sep_id=SEP, cache=False).lengths.mean() / 128
    fill_512 = pack_blocks(store, block_size=512, doc_sep_id=SEP, cache=False).lengths.mean() / 512
    assert fill_128 > 0.8 and fill_512 > 0.9, (fill_128, fill_512)
    doc_fill = pack_blocks(store, block_size=128, mode="doc", cache=False).lengths.mean() / 128
    assert doc_fill < fill_128


def test_block_index_cache(store):
    path = store.path / f"blocks_full_40_sep{SEP}.npy"
    path.unlink(missing_ok=True)
    first = pack_blocks(store, block_size=40, doc_sep_id=SEP)
    assert path.is_file()
    second = pack_blocks(store, block_size=40, doc_sep_id=SEP)
    np.testing.assert_array_equal(first.table, second.table)
    np.save(path, np.array([[0, 5, 5]], dtype=np.int64))  # a table of some other store is not used
    third = pack_blocks(store, block_size=40, doc_sep_id=SEP)
    np.testing.assert_array_equal(first.table, third.table)
    assert not (store.path / "blocks_full_41_sepnone.npy").exists()
    pack_blocks(store, block_size=41, cache=False)
    assert not (store.path / "blocks_full_41_sepnone.npy").exists()
    np.testing.assert_array_equal(first[-1].tokens, first[len(first) - 1].tokens)
    with pytest.raises(IndexError, match="out of range"):
        first[len(first)]


def test_pack_errors(store):
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="block_size"):
            pack_blocks(store, block_size=bad)
    with pytest.raises(ValueError, match="mode"):
        pack_blocks(store, block_size=16, mode="sentences")
    with pytest.raises(ValueError, match=r"doc_sep_id \(1000\)"):
        pack_blocks(store, block_size=16, doc_sep_id=1000)


def test_split_index_is_fixed_and_disjoint():
    train, held = split_index(1000, eval_fraction=0.05, seed=3)
    assert len(held) == 50 and len(train) == 950
    np.testing.assert_array_equal(np.sort(np.concatenate([train, held])), np.arange(1000))
    train2, held2 = split_index(1000, eval_blocks=50, seed=3)
    np.testing.assert_array_equal(held, held2)
    assert not np.array_equal(held, split_index(1000, eval_blocks=50, seed=4)[1])
    assert len(split_index(10, eval_fraction=0.01)[1]) == 1  # at least one block
    assert len(split_index(10, eval_blocks=0)[1]) == 0
    for kwargs in ({}, {"eval_fraction": 0.1, "eval_blocks": 1}, {"eval_fraction": 1.0}, {"eval_blocks": 10}):
        with pytest.raises(ValueError):
            split_index(10, **kwargs)


def test_batch_plan_is_a_deterministic_permutation_per_epoch():
    plan = batch_plan(103, batch_size=10, epoch=0, seed=7)
    assert len(plan) == 10 and all(len(b) == 10 and b.dtype == np.int64 for b in plan)
    assert len(np.unique(np.concatenate(plan))) == 100  # drop_last: 3 left out
    for a, b in zip(plan, batch_plan(103, batch_size=10, epoch=0, seed=7)):
        np.testing.assert_array_equal(a, b)
    other_epoch = batch_plan(103, batch_size=10, epoch=1, seed=7)
    assert not np.array_equal(np.concatenate(plan), np.concatenate(other_epoch))
    other_seed = batch_plan(103, batch_size=10, epoch=0, seed=8)
    assert not np.array_equal(np.concatenate(plan), np.concatenate(other_seed))
    whole = batch_plan(103, batch_size=10, epoch=0, seed=7, drop_last=False)
    assert [len(b) for b in whole] == [10] * 10 + [3]
    np.testing.assert_array_equal(np.sort(np.concatenate(whole)), np.arange(103))
    ids = np.array([5, 9, 11, 40, 41, 77])  # e.g. the training ids of split_index
    np.testing.assert_array_equal(np.sort(np.concatenate(batch_plan(ids, batch_size=2, epoch=3, seed=0))), ids)
    assert batch_plan(0, batch_size=4, epoch=0, seed=0) == []


def test_bucketing_gathers_similar_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 513, size=5000)
    kwargs = dict(batch_size=16, epoch=2, seed=1, lengths=lengths)
    plain = batch_plan(5000, **kwargs)
    bucketed = batch_plan(5000, bucket=True, bucket_window=50, **kwargs)
    np.testing.assert_array_equal(np.sort(np.concatenate(bucketed)), np.sort(np.concatenate(plain)))
    spread = lambda plan: np.mean([np.ptp(lengths[b]) for b in plan])
    assert spread(bucketed) < 0.05 * spread(plain), (spread(bucketed), spread(plain))
    # the batch order is still random: batch lengths do not increase through the epoch
    means = np.array([lengths[b].mean() for b in bucketed])
    assert abs(np.corrcoef(np.arange(len(means)), means)[0, 1]) < 0.2
    for a, b in zip(bucketed, batch_plan(5000, bucket=True, bucket_window=50, **kwargs)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(bucketed[0], batch_plan(5000, bucket=True, bucket_window=50,
                                                      **{**kwargs, "epoch": 3})[0])


def test_bucketing_real_block_lengths(store):
    index = pack_blocks(store, block_size=128, mode="doc", cache=False)
    train, _ = split_index(index, eval_fraction=0.1, seed=0)
    kwargs = dict(batch_size=8, epoch=0, seed=0, lengths=index.lengths)
    spread = lambda plan: np.mean([np.ptp(index.lengths[b]) for b in plan])
    bucketed, plain = batch_plan(train, bucket=True, bucket_window=20, **kwargs), batch_plan(train, **kwargs)
    assert spread(bucketed) < 0.2 * spread(plain), (spread(bucketed), spread(plain))


def test_batch_plan_errors():
    with pytest.raises(ValueError, match="batch_size"):
        batch_plan(10, batch_size=0, epoch=0, seed=0)
    with pytest.raises(ValueError, match="needs lengths"):
        batch_plan(10, batch_size=2, epoch=0, seed=0, bucket=True)
    with pytest.raises(ValueError, match="lengths has 5 entries"):
        batch_plan(10, batch_size=2, epoch=0, seed=0, bucket=True, lengths=np.ones(5))
    with pytest.raises(ValueError, match="bucket_window"):
        batch_plan(10, batch_size=2, epoch=0, seed=0, bucket_window=0)
