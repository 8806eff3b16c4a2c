"""The token store: tokens equal the tokenizer's, sentences tile documents, resume is exact, errors are clear."""

import gzip
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from pretune.data.store import (
    META_FILE,
    PROGRESS_FILE,
    TOKENS_FILE,
    StoreError,
    TokenStore,
    build_store,
    sentence_token_bounds,
    store_stats,
    token_dtype,
)
from pretune.data.text import sentence_spans

CORPUS = Path("/work/shared/data/corpus/austen.txt.gz")
FILES = ("tokens.bin", "sent_offsets.bin", "doc_offsets.bin")


def _wordpiece(paragraphs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(paragraphs, trainer)
    return tok


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not available")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read()
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()][50:350]  # past the title pages


@pytest.fixture(scope="module")
def tok(paragraphs) -> Tokenizer:
    return _wordpiece(paragraphs, 1000)


def _interrupted(docs, after: int):
    for i, doc in enumerate(docs):
        if i == after:
            raise RuntimeError("interrupted")
        yield doc


def test_documents_equal_tokenizer_output(tmp_path, paragraphs, tok):
    docs = paragraphs[:120] + ["", "   \n "] + paragraphs[120:150]  # empty documents are skipped
    store = build_store(docs, tok, tmp_path / "s", batch_docs=16, total_bytes=sum(len(d.encode()) for d in docs),
                        show_progress=True)
    kept = [d for d in docs if d.strip()]
    assert store.n_docs == len(kept) == len(store)
    assert store.tokens.dtype == np.uint16 and isinstance(store.tokens, np.memmap)
    assert store.sent_offsets[0] == 0 and store.sent_offsets[-1] == store.n_tokens
    assert store.doc_offsets[0] == 0 and store.doc_offsets[-1] == store.n_sents
    assert np.all(np.diff(store.sent_offsets) > 0)  # no empty sentences
    for d, doc in enumerate(kept):
        expected = tok.encode(doc, add_special_tokens=False).ids
        np.testing.assert_array_equal(store.document(d), expected)
        np.testing.assert_array_equal(np.concatenate(store.sentences(d)), expected)
    assert store.meta["complete"] and store.meta["vocab_size"] == 1000 and store.meta["dtype"] == "uint16"
    assert store.meta["n_bytes_text"] == sum(len(d.encode()) for d in docs)
    stats = store_stats(store)
    assert (stats["tokens"], stats["docs"], stats["sents"]) == (store.n_tokens, store.n_docs, store.n_sents)
    assert stats["mean_doc_len"] == pytest.approx(store.n_tokens / store.n_docs)
    with pytest.raises(IndexError, match="out of range"):
        store.document(len(kept))
    copy = pickle.loads(pickle.dumps(store))  # e.g. sent to a spawned data worker: re-opened, not copied
    assert isinstance(copy.tokens, np.memmap) and len(pickle.dumps(store)) < 1000
    np.testing.assert_array_equal(copy.document(3), store.document(3))


def test_sentence_boundaries_follow_sentence_spans(tmp_path, tok):
    text = 'Emma smiled at her friend. "Was it late?" asked Harriet!\n\nYes, it was; quite late.   It rained.'
    store = build_store([text], tok, tmp_path / "s", show_progress=False)
    spans = sentence_spans(text)
    assert [text[a:b] for a, b in spans] == [
        "Emma smiled at her friend.", '"Was it late?"', "asked Harriet!", "Yes, it was; quite late.", "It rained."]
    sentences = store.sentences(0)
    assert len(sentences) == len(spans)
    for (start, end), sent in zip(spans, sentences):
        np.testing.assert_array_equal(sent, tok.encode(text[start:end], add_special_tokens=False).ids)


def test_sentence_token_bounds_with_leading_space_tokens():
    # byte-level BPE style: a token carries the space before it ("Hi", " there", ".", " Bye", " now", ".")
    text = "Hi there. Bye now."
    ends = np.array([2, 8, 9, 13, 17, 18])
    np.testing.assert_array_equal(sentence_token_bounds(text, ends), [0, 3, 6])
    # a sentence that gets no token of its own (its characters fall inside the previous token) is dropped
    np.testing.assert_array_equal(sentence_token_bounds("A. B. C.", np.array([2, 6, 8])), [0, 1, 2, 3])
    np.testing.assert_array_equal(sentence_token_bounds("A. B. C.", np.array([6, 8])), [0, 1, 2])
    np.testing.assert_array_equal(sentence_token_bounds("", np.array([], dtype=np.int64)), [0])


def test_resume_after_interruption_gives_identical_files(tmp_path, paragraphs, tok):
    docs = paragraphs[:100]
    full = build_store(docs, tok, tmp_path / "full", batch_docs=16, source_desc="austen", show_progress=False)
    part = tmp_path / "part"
    with pytest.raises(RuntimeError, match="interrupted"):
        build_store(_interrupted(docs, 57), tok, part, batch_docs=16, source_desc="austen", show_progress=False)
    assert (part / PROGRESS_FILE).is_file() and not (part / META_FILE).is_file()
    assert json.loads((part / PROGRESS_FILE).read_text())["docs_read"] == 57  # the documents before the error
    with pytest.raises(StoreError, match="run build_store again: it resumes"):
        TokenStore.open(part)
    with open(part / TOKENS_FILE, "ab") as f:  # a batch written after the last progress.json, then a crash
        f.write(b"\x07\x00" * 11)
    resumed = build_store(docs, tok, part, batch_docs=16, source_desc="austen",
                          show_progress=False)
    for name in FILES:
        assert (part / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name
    drop = {"build_seconds"}
    assert {k: v for k, v in resumed.meta.items() if k not in drop} == {
        k: v for k, v in full.meta.items() if k not in drop}
    assert not (part / PROGRESS_FILE).exists()
    # a complete store is opened, not rebuilt: no document is read
    again = build_store(_interrupted(docs, 0), tok, part, source_desc="austen", show_progress=False)
    assert again.n_tokens == full.n_tokens


def test_other_tokenizer_or_sources_is_an_error_unless_rebuilding(tmp_path, paragraphs, tok):
    docs = paragraphs[:40]
    other = _wordpiece(paragraphs, 500)
    out = tmp_path / "s"
    build_store(docs, tok, out, source_desc="austen", show_progress=False)
    with pytest.raises(StoreError, match="tokenizer .* resume=False"):
        build_store(docs, other, out, source_desc="austen", show_progress=False)
    with pytest.raises(StoreError, match="sources 'austen', not 'emma'"):
        build_store(docs, tok, out, source_desc="emma", show_progress=False)
    rebuilt = build_store(docs[:10], other, out, source_desc="austen", show_progress=False, resume=False)
    np.testing.assert_array_equal(rebuilt.document(9), other.encode(docs[9], add_special_tokens=False).ids)
    assert rebuilt.n_docs == 10
    # an interrupted build is not resumed with another tokenizer either
    part = tmp_path / "part"
    with pytest.raises(RuntimeError):
        build_store(_interrupted(docs, 20), tok, part, batch_docs=8, show_progress=False)
    with pytest.raises(StoreError, match="interrupted build .* tokenizer"):
        build_store(docs, other, part, batch_docs=8, show_progress=False)
    # an explicit tokenizer_sha is what is compared
    build_store(docs, tok, tmp_path / "sha", tokenizer_sha="abc", show_progress=False)
    with pytest.raises(StoreError, match="tokenizer abc"):
        build_store(docs, tok, tmp_path / "sha", tokenizer_sha="abd", show_progress=False)


def test_open_missing_or_incomplete_store(tmp_path):
    with pytest.raises(StoreError, match=re.escape(str(tmp_path / "nowhere")) + ".*meta.json is missing"):
        TokenStore.open(tmp_path / "nowhere")


def test_damaged_store_is_reported(tmp_path, paragraphs, tok):
    store = build_store(paragraphs[:5], tok, tmp_path / "s", show_progress=False)
    with open(store.path / TOKENS_FILE, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(StoreError, match="tokens.bin.*damaged"):
        TokenStore.open(store.path)


def test_empty_input_is_an_error(tmp_path, tok):
    with pytest.raises(StoreError, match="no tokens"):
        build_store([], tok, tmp_path / "a", show_progress=False)
    with pytest.raises(StoreError, match="all 2 documents are empty"):
        build_store(["", " \n\t "], tok, tmp_path / "b", show_progress=False)
    assert list((tmp_path / "b").iterdir()) == []
    with pytest.raises(TypeError, match="document 1 is a bytes"):
        build_store(["ok.", b"bytes"], tok, tmp_path / "c", show_progress=False)
    with pytest.raises(ValueError, match="batch_docs"):
        build_store(["ok."], tok, tmp_path / "d", batch_docs=0)


def test_padding_and_truncation_of_the_tokenizer_are_ignored(tmp_path, paragraphs, tok):
    padded = Tokenizer.from_str(tok.to_str())
    padded.enable_truncation(8)
    padded.enable_padding(length=64)
    store = build_store(paragraphs[:3], padded, tmp_path / "s", show_progress=False)
    np.testing.assert_array_equal(store.document(2), tok.encode(paragraphs[2], add_special_tokens=False).ids)
    assert padded.truncation is not None and padded.padding is not None  # the caller's tokenizer is unchanged


def test_large_vocabularies_use_uint32(tmp_path):
    vocab = {"[UNK]": 0} | {f"w{i}": i for i in range(1, 70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    store = build_store(["w69999 w5 w65536. zz w1."], tok, tmp_path / "s", show_progress=False)
    assert store.tokens.dtype == np.uint32
    assert [s.tolist() for s in store.sentences(0)] == [[69999, 5, 0], [0, 0]]  # "w65536." and "w1." are unknown
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
