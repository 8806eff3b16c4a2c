"""MLM / NSP / SOP example construction, checked by invariants on real WordPiece-tokenized text
(Jane Austen, BERT-uncased vocabulary from the MiniLM checkpoint, or a 3000-entry WordPiece trained
here when that checkpoint is absent)."""

import gzip
import re
from pathlib import Path

import numpy as np
import pytest

from pretune.objectives.masking import (
    IGNORE,
    _truncate_pair,
    apply_mask,
    electra_labels,
    mlm_example,
    select_for_masking,
    sentence_pair,
    word_start_vocab,
)

CORPUS = Path("/work/shared/data/corpus/austen.txt.gz")
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BLOCK = 128


def _paragraphs() -> list[str]:
    if not CORPUS.exists():
        pytest.skip(f"corpus {CORPUS} not present")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read(1_000_000)
    return [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) > 20]


def _load_tokenizer(paragraphs: list[str]):
    tokenizers = pytest.importorskip("tokenizers")
    try:
        from pretune.realmodels import minilm_dir

        path = minilm_dir() / "tokenizer.json"
    except Exception:  # any failure to locate the checkpoint means: train our own
        path = None
    if path is not None and path.exists():
        tok = tokenizers.Tokenizer.from_file(str(path))
        tok.no_padding()  # the checkpoint's tokenizer.json pads/truncates to 128 by default
        tok.no_truncation()
        return tok
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(paragraphs, trainers.WordPieceTrainer(vocab_size=3000, special_tokens=SPECIAL_TOKENS))
    return tok


@pytest.fixture(scope="module")
def text():
    """Tokenizer, vocab tables and ~400 blocks of 128 ids ([CLS] ... [SEP]) from a few hundred paragraphs."""
    paragraphs = _paragraphs()
    tok = _load_tokenizer(paragraphs)
    vocab = tok.get_vocab()
    id_to_token = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        id_to_token[i] = token
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    stream = np.concatenate([np.array(e.ids, dtype=np.int64)
                             for e in tok.encode_batch(paragraphs[:700], add_special_tokens=False)])
    n = BLOCK - 2
    blocks = [np.concatenate([[ids["[CLS]"]], stream[i:i + n], [ids["[SEP]"]]]).astype(np.int64)
              for i in range(0, stream.size - n, n)][:400]
    return dict(tok=tok, id_to_token=id_to_token, vocab_size=len(id_to_token), ids=ids,
                special=np.array(list(ids.values())), blocks=blocks, stream=stream,
                paragraphs=paragraphs, word_starts=word_start_vocab(id_to_token))


def _mlm(text, block, rng, **kw):
    return mlm_example(block, rng, rate=0.15, mask_id=text["ids"]["[MASK]"], vocab_size=text["vocab_size"],
                       special_ids=text["special"], word_start_vocab=text["word_starts"], **kw)


def _runs(selected: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate([[0], selected.astype(np.int64), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


# --- masked LM: selection and 80/10/10 ---------------------------------------------------------

def test_mlm_selects_15_percent_and_corrupts_80_10_10(text):
    rng = np.random.default_rng(0)
    n_maskable = n_selected = n_mask = n_random = n_kept = 0
    for block in text["blocks"]:
        corrupted, labels = _mlm(text, block, rng)
        special = np.isin(block, text["special"])
        selected = labels != IGNORE
        assert not (selected & special).any(), "a special token was selected"
        np.testing.assert_array_equal(labels[selected], block[selected])  # target = original token
        np.testing.assert_array_equal(corrupted[~selected], block[~selected])  # unselected untouched
        assert corrupted.dtype == labels.dtype == np.int64
        c, o = corrupted[selected], block[selected]
        is_mask = c == text["ids"]["[MASK]"]
        is_random = ~is_mask & (c != o)
        assert not np.isin(c[is_random], text["special"]).any(), "a random replacement is a special token"
        assert ((c[is_random] >= 0) & (c[is_random] < text["vocab_size"])).all()
        n_maskable += int((~special).sum())
        n_selected += int(selected.sum())
        n_mask, n_random, n_kept = n_mask + is_mask.sum(), n_random + is_random.sum(), n_kept + (c == o).sum()
    assert abs(n_selected / n_maskable - 0.15) < 0.005
    assert n_mask + n_random + n_kept == n_selected
    # ~7600 selected positions: one standard deviation of the 10% share is ~0.35%
    assert abs(n_mask / n_selected - 0.8) < 0.015
    assert abs(n_random / n_selected - 0.1) < 0.015
    assert abs(n_kept / n_selected - 0.1) < 0.015


def test_plain_selection_is_exactly_the_rounded_budget(text):
    block = text["blocks"][0]
    maskable = ~np.isin(block, text["special"])
    for seed in range(20):
        selected = select_for_masking(block, np.random.default_rng(seed), maskable=maskable)
        assert selected.sum() == round(0.15 * maskable.sum())


def test_dynamic_masking_differs_across_epochs_static_with_same_seed(text):
    block = text["blocks"][3]
    epoch0 = _mlm(text, block, np.random.default_rng([1234, 0]))  # seed (run seed, epoch)
    epoch1 = _mlm(text, block, np.random.default_rng([1234, 1]))
    again0 = _mlm(text, block, np.random.default_rng([1234, 0]))
    assert not np.array_equal(epoch0[1] != IGNORE, epoch1[1] != IGNORE)  # RoBERTa: a new mask each epoch
    for a, b in zip(epoch0, again0):  # BERT's static masking: the same seed reproduces the example
        np.testing.assert_array_equal(a, b)


def test_random_replacements_avoid_special_ids_and_respect_range():
    tokens = np.arange(5, 205, dtype=np.int64) % 10 + 5  # ids 5..14
    selected = np.ones_like(tokens, dtype=bool)
    corrupted, _ = apply_mask(tokens, selected, np.random.default_rng(0), mask_id=3, vocab_size=15,
                              special_ids=(0, 1, 2, 3, 4, 10), mask_prob=0.0, random_prob=1.0, random_low=2)
    assert set(np.unique(corrupted)) <= set(range(5, 15)) - {10}
    assert len(np.unique(corrupted)) == 9  # every allowed id shows up among 200 uniform draws


# --- whole-word and span masking ---------------------------------------------------------------

def _assert_whole_words(text, block, selected):
    """WordPiece rule: a '##' token continues the word of the token before it (unless that is special)."""
    tokens = [text["id_to_token"][i] for i in block]
    special = np.isin(block, text["special"])
    for i in range(1, len(block)):
        if tokens[i].startswith("##") and not special[i - 1]:
            assert selected[i] == selected[i - 1], f"word split at {i}: {tokens[max(0, i - 3):i + 2]}"


def test_whole_word_masking_selects_whole_words_at_15_percent(text):
    rng = np.random.default_rng(1)
    n_maskable = n_selected = n_multi_piece = 0
    for block in text["blocks"]:
        corrupted, labels = _mlm(text, block, rng, whole_word=True)
        selected = labels != IGNORE
        assert not (selected & np.isin(block, text["special"])).any()
        _assert_whole_words(text, block, selected)
        n_maskable += int((~np.isin(block, text["special"])).sum())
        n_selected += int(selected.sum())
        n_multi_piece += sum(text["id_to_token"][i].startswith("##") for i in block[selected])
    assert abs(n_selected / n_maskable - 0.15) < 0.01
    assert n_multi_piece > 50  # the check above is not vacuous: many selected words have several pieces


@pytest.mark.parametrize("block_len, tol", [(128, 0.5), (512, 0.25)])
def test_span_masking_mean_span_length_matches_spanbert(text, block_len, tol):
    # SpanBERT §3.1: ℓ ~ Geometric(0.2) truncated at 10 words has mean 3.8 (sum k·0.2·0.8^(k-1) / (1-0.8^10)
    # over k = 1..10 = 3.797). Measured runs fall short when the 15% budget cuts the last span (worse in
    # 128-token blocks, 19 tokens of budget; SpanBERT used 512) and run long when two spans touch.
    stream, n = text["stream"], block_len - 2
    cls, sep = text["ids"]["[CLS]"], text["ids"]["[SEP]"]
    blocks = [np.concatenate([[cls], stream[i:i + n], [sep]]) for i in range(0, stream.size - n, n)][:300]
    rng = np.random.default_rng(2)
    run_words, n_maskable, n_selected = [], 0, 0
    for block in blocks:
        _, labels = _mlm(text, block, rng, span=True)
        selected = labels != IGNORE
        assert not (selected & np.isin(block, text["special"])).any()
        _assert_whole_words(text, block, selected)
        starts = text["word_starts"][block]
        run_words += [1 + int(starts[a + 1:b].sum()) for a, b in _runs(selected)]
        n_maskable += int((~np.isin(block, text["special"])).sum())
        n_selected += int(selected.sum())
    assert abs(n_selected / n_maskable - 0.15) < 0.01
    assert abs(np.mean(run_words) - 3.8) < tol
    assert max(run_words) > 10  # touching spans merge; single spans stay <= 10 words


def test_span_masking_without_word_starts_uses_tokens_as_words():
    tokens = np.arange(2000, dtype=np.int64)
    maskable = np.ones_like(tokens, dtype=bool)
    maskable[::500] = False  # spans must not cross these
    rng = np.random.default_rng(3)
    lengths = []
    for _ in range(20):
        selected = select_for_masking(tokens, rng, maskable=maskable, span=True)
        assert selected.sum() == round(0.15 * maskable.sum())
        assert not (selected & ~maskable).any()
        lengths += [b - a for a, b in _runs(selected)]
    assert abs(np.mean(lengths) - 3.8) < 0.3


def test_selection_edge_cases():
    tokens = np.arange(6, dtype=np.int64)
    rng = np.random.default_rng(0)
    nothing = np.zeros(6, dtype=bool)
    assert not select_for_masking(tokens, rng, maskable=nothing).any()
    one = np.array([False, True, True, False, False, False])
    assert select_for_masking(tokens, rng, maskable=one).sum() == 1  # round(0.3) = 0, but at least 1
    starts = np.array([True, True, False, False, False, True])  # word 1..2 is the only maskable word, 2 tokens
    chosen = select_for_masking(tokens, rng, maskable=one, word_starts=starts)
    np.testing.assert_array_equal(chosen, one)  # budget 1 < word length 2: the word is taken whole
    with pytest.raises(ValueError, match="maskable has shape"):
        select_for_masking(tokens, rng, maskable=one[:3])
    with pytest.raises(ValueError, match="word_start_vocab"):
        mlm_example(tokens, rng, rate=0.15, mask_id=0, vocab_size=6, special_ids=(), whole_word=True)
    with pytest.raises(ValueError, match="random_low"):
        apply_mask(tokens, one, rng, mask_id=0, vocab_size=3, special_ids=(0, 1, 2))


# --- ELECTRA ------------------------------------------------------------------------------------

def test_electra_labels_mark_exactly_the_changed_tokens(text):
    block = text["blocks"][5]
    selected = select_for_masking(block, np.random.default_rng(4), maskable=~np.isin(block, text["special"]))
    # a "generator" that samples the original token back at some positions: those count as original
    corrupted, _ = apply_mask(block, selected, np.random.default_rng(5), mask_id=text["ids"]["[MASK]"],
                              vocab_size=text["vocab_size"], mask_prob=0.0, random_prob=1.0)
    corrupted[np.flatnonzero(selected)[:3]] = block[np.flatnonzero(selected)[:3]]
    labels = electra_labels(block, corrupted)
    np.testing.assert_array_equal(labels, (corrupted != block).astype(np.int64))
    assert labels.dtype == np.int64 and labels.sum() == selected.sum() - 3
    with pytest.raises(ValueError, match="same shape"):
        electra_labels(block, corrupted[:-1])


# --- NSP / SOP ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docs(text):
    """Paragraphs with >= 3 sentences, each sentence a token-id array."""
    out = []
    for p in text["paragraphs"][:400]:
        sentences = [s for s in re.split(r"(?<=[.!?;])\s+", p) if s]
        if len(sentences) >= 3:
            enc = text["tok"].encode_batch(sentences, add_special_tokens=False)
            out.append([np.array(e.ids, dtype=np.int64) for e in enc])
    assert len(out) > 50
    return out


def _random_doc_sampler(docs, returned):
    def random_sentences(rng):
        doc = docs[rng.integers(len(docs))]
        start = int(rng.integers(len(doc)))
        returned.append(np.concatenate(doc[start:]))
        return doc[start:]
    return random_sentences


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_sentence_pair_labels_balanced_and_pairs_well_formed(docs, task):
    rng = np.random.default_rng(6)
    returned = []
    labels = []
    for i in range(2000):
        doc = docs[i % len(docs)]
        whole = np.concatenate(doc)
        boundaries = set(np.cumsum([s.size for s in doc])[:-1].tolist())
        a, b, label = sentence_pair(doc, rng, task=task, max_tokens=10_000,
                                    random_sentences=_random_doc_sampler(docs, returned))
        labels.append(label)
        assert a.dtype == b.dtype == np.int64 and a.size > 0 and b.size > 0
        if label == 0:  # IsNext / in order: A then B is the document, split at a sentence boundary
            np.testing.assert_array_equal(np.concatenate([a, b]), whole)
            assert a.size in boundaries
        elif task == "sop":  # swapped: the originals in swapped order
            np.testing.assert_array_equal(np.concatenate([b, a]), whole)
            assert b.size in boundaries
        else:  # NotNext: A is a sentence-aligned prefix, B the other document's sentences
            np.testing.assert_array_equal(a, whole[:a.size])
            assert a.size in boundaries
            np.testing.assert_array_equal(b, returned[-1])
    assert abs(np.mean(labels) - 0.5) < 0.04


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_sentence_pair_truncates_to_max_tokens(docs, task):
    rng = np.random.default_rng(7)
    fronts_cut = 0
    for i in range(300):
        doc = docs[i % len(docs)]
        a, b, label = sentence_pair(doc, rng, task=task, max_tokens=24, random_sentences=_random_doc_sampler(docs, []))
        assert 0 < a.size and 0 < b.size and a.size + b.size <= 24
        if task == "sop":  # each truncated segment is a contiguous piece of the document
            whole = np.concatenate(doc)
            for seg in (a, b):
                hits = np.flatnonzero(whole == seg[0])
                assert any(np.array_equal(whole[h:h + seg.size], seg) for h in hits)
                fronts_cut += seg[0] != whole[0]
    if task == "sop":
        assert fronts_cut > 0  # trimming happens at the front too, not only at the back


def test_truncate_pair_lengths_follow_bert_truncate_seq_pair():
    def bert_lengths(la, lb, max_tokens):  # google-research/bert create_pretraining_data.truncate_seq_pair
        while la + lb > max_tokens:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    rng = np.random.default_rng(8)
    for la in range(1, 15):
        for lb in range(1, 15):
            for max_tokens in range(2, 30):
                a, b = _truncate_pair(np.arange(la), np.arange(100, 100 + lb), max_tokens, rng)
                assert (a.size, b.size) == bert_lengths(la, lb, max_tokens)
    front = [_truncate_pair(np.arange(40), np.arange(10), 30, rng)[0][0] for _ in range(2000)]
    assert abs(np.mean(front) - 20 * 0.5) < 0.3  # 20 cuts, all from A (the longer), each at the front w.p. 0.5


def test_sentence_pair_single_sentence_is_split_inside():
    sentence = np.arange(10, 30, dtype=np.int64)
    for seed in range(20):
        a, b, label = sentence_pair([sentence], np.random.default_rng(seed), task="sop", max_tokens=100)
        np.testing.assert_array_equal(np.concatenate([b, a] if label else [a, b]), sentence)
    with pytest.raises(ValueError, match="random_sentences"):
        sentence_pair([sentence], np.random.default_rng(0), task="nsp", max_tokens=100)
