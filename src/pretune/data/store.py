"""Tokenize a corpus once into a memory-mapped token store: parallel, with a progress bar, resumable.

A store is a folder of flat arrays that every later step (packing, objectives, the trainer's data
workers) memory-maps instead of re-tokenizing:

    tokens.bin         uint16 (vocab_size <= 65535) or uint32; every document concatenated, no special tokens
    sent_offsets.bin   int64 (n_sents + 1,): token offset where each sentence starts, then n_tokens
    doc_offsets.bin    int64 (n_docs + 1,): sentence index where each document starts, then n_sents
    progress.json      while building: how far the build got (rewritten atomically after every batch)
    meta.json          written last, with "complete": true

Document d is ``tokens[sent_offsets[doc_offsets[d]]:sent_offsets[doc_offsets[d + 1]]]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import numpy as np
import tokenizers

from pretune.data.text import sentence_spans
from pretune.io.progress import progress

TOKENS_FILE = "tokens.bin"
SENTS_FILE = "sent_offsets.bin"
DOCS_FILE = "doc_offsets.bin"
PROGRESS_FILE = "progress.json"
META_FILE = "meta.json"
BLOCKS_GLOB = "blocks_*.npy"  # packing caches (pretune.data.packing) derived from this store
FORMAT_VERSION = 1


class StoreError(ValueError):
    """A token store that is missing, incomplete, damaged or built from other inputs."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= 1")
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def tokenizer_fingerprint(tokenizer: tokenizers.Tokenizer) -> str:
    """sha256 of the tokenizer's JSON (padding and truncation left out): the default ``tokenizer_sha``."""
    return hashlib.sha256(_plain_tokenizer(tokenizer).to_str().encode("utf-8")).hexdigest()


class TokenStore:
    """A finished token store, memory-mapped read-only (open it with :meth:`TokenStore.open`).

    Attributes:
        path: the store's folder.
        tokens: (n_tokens,) uint16/uint32 memmap, all documents concatenated, no special tokens.
        sent_offsets: (n_sents + 1,) int64 memmap, token offset of each sentence start, then n_tokens.
        doc_offsets: (n_docs + 1,) int64 memmap, sentence index of each document start, then n_sents.
        meta: tokenizer_sha, vocab_size, dtype, source_desc, n_bytes_text, build_seconds, complete, ...
    """

    def __init__(self, path: Path, *, tokens: np.ndarray, sent_offsets: np.ndarray, doc_offsets: np.ndarray,
                 meta: dict):
        self.path = path
        self.tokens = tokens
        self.sent_offsets = sent_offsets
        self.doc_offsets = doc_offsets
        self.meta = meta

    @classmethod
    def open(cls, path) -> TokenStore:
        """Memory-map the complete store in folder ``path`` (read-only)."""
        path = Path(path)
        meta = _read_json(path / META_FILE)
        if meta is None or not meta.get("complete"):
            why = "meta.json is missing" if meta is None else "meta.json does not mark it complete"
            if (path / PROGRESS_FILE).is_file():
                why += " (progress.json says a build was interrupted)"
            raise StoreError(f"{path}: not a complete token store: {why}; run build_store again: it resumes")
        dtype = np.dtype(meta["dtype"])
        n_tokens, n_sents, n_docs = int(meta["n_tokens"]), int(meta["n_sents"]), int(meta["n_docs"])
        expected = {TOKENS_FILE: n_tokens * dtype.itemsize, SENTS_FILE: (n_sents + 1) * 8, DOCS_FILE: (n_docs + 1) * 8}
        for name, size in expected.items():
            have = (path / name).stat().st_size if (path / name).is_file() else None
            if have != size:
                raise StoreError(f"{path / name}: {'missing' if have is None else f'{have} bytes'}, meta.json expects "
                                 f"{size} bytes; the store is damaged: rebuild it with build_store(..., resume=False)")
        return cls(
            path,
            tokens=np.memmap(path / TOKENS_FILE, dtype=dtype, mode="r", shape=(n_tokens,)),
            sent_offsets=np.memmap(path / SENTS_FILE, dtype=np.int64, mode="r", shape=(n_sents + 1,)),
            doc_offsets=np.memmap(path / DOCS_FILE, dtype=np.int64, mode="r", shape=(n_docs + 1,)),
            meta=meta,
        )

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_sents(self) -> int:
        return len(self.sent_offsets) - 1

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return self.n_docs

    def __reduce__(self):
        return (TokenStore.open, (self.path,))  # workers re-map the files instead of receiving a copy

    def __repr__(self) -> str:
        return (f"TokenStore({str(self.path)!r}, n_tokens={self.n_tokens}, n_sents={self.n_sents}, "
                f"n_docs={self.n_docs}, dtype={self.tokens.dtype})")

    def document(self, d: int) -> np.ndarray:
        """Tokens of document ``d``: a read-only (L,) view in the store's dtype."""
        s0, s1 = self._sentence_range(d)
        return self.tokens[self.sent_offsets[s0]:self.sent_offsets[s1]]

    def sentences(self, d: int) -> list[np.ndarray]:
        """The sentences of document ``d``: read-only views whose concatenation is ``document(d)``."""
        s0, s1 = self._sentence_range(d)
        bounds = self.sent_offsets[s0:s1 + 1].tolist()
        return [self.tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def _sentence_range(self, d: int) -> tuple[int, int]:
        n = self.n_docs
        if not -n <= d < n:
            raise IndexError(f"document {d} out of range for a store of {n} documents")
        d = d % n
        return int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])


def store_stats(store: TokenStore) -> dict:
    """Summary numbers of a store (for the CLI): sizes, mean lengths, bytes per token, build time."""
    n_bytes = int(store.meta.get("n_bytes_text", 0))
    return {
        "path": str(store.path),
        "tokens": store.n_tokens,
        "docs": store.n_docs,
        "sents": store.n_sents,
        "mean_doc_len": store.n_tokens / store.n_docs,  # tokens per document
        "mean_sent_len": store.n_tokens / store.n_sents,  # tokens per sentence
        "vocab_size": store.vocab_size,
        "dtype": str(store.tokens.dtype),
        "n_bytes_text": n_bytes,
        "bytes_per_token": n_bytes / store.n_tokens,
        "build_seconds": float(store.meta.get("build_seconds", 0.0)),
        "tokenizer_sha": store.meta.get("tokenizer_sha", ""),
        "source_desc": store.meta.get("source_desc", ""),
    }


def build_store(documents: Iterable[str], tokenizer: tokenizers.Tokenizer, out_dir, *, tokenizer_sha: str = "",
                source_desc: str = "", batch_docs: int = 1000, total_docs: int | None = None,
                total_bytes: int | None = None, show_progress: bool = True, resume: bool = True) -> TokenStore:
    """Tokenize ``documents`` once into a token store in ``out_dir`` and open it.

    Each batch of ``batch_docs`` documents is tokenized by ``tokenizer.encode_batch`` (the Rust side
    spreads a batch over all cores unless ``TOKENIZERS_PARALLELISM`` is false; the next batch is
    tokenized while this one is written). Sentence boundaries come from :func:`sentence_spans`
    mapped to tokens through the encoding's character offsets. Empty documents and sentences
    without tokens are skipped.

    Args:
        documents: the texts, streamed once (resuming skips the documents already stored).
        tokenizer: a ``tokenizers.Tokenizer``; its padding and truncation are ignored, no special tokens are added.
        out_dir: the store's folder (created if needed).
        tokenizer_sha: identifies the tokenizer; default: sha256 of its JSON (:func:`tokenizer_fingerprint`).
        source_desc: identifies the documents (e.g. file names); a store built from others is not resumed.
        batch_docs: documents per batch; progress.json is rewritten after each.
        total_docs, total_bytes: totals for the progress bar (bytes, when given, is what it counts).
        show_progress: draw a progress bar with tokens and MB/s.
        resume: continue an interrupted build (or open a complete one) made from the same tokenizer and
            sources; a store from other ones is an error. False: delete any store there and rebuild.

    Returns:
        The opened :class:`TokenStore`.
    """
    if batch_docs < 1:
        raise ValueError(f"batch_docs ({batch_docs}) must be >= 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _plain_tokenizer(tokenizer)
    tokenizer_sha = tokenizer_sha or tokenizer_fingerprint(tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    if not resume:
        _remove_store_files(out_dir)

    meta = _read_json(out_dir / META_FILE)
    if meta is not None and meta.get("complete"):
        _check_same_inputs(out_dir, meta, tokenizer_sha, source_desc)
        return TokenStore.open(out_dir)
    state = _read_json(out_dir / PROGRESS_FILE)
    if state is not None:
        _check_same_inputs(out_dir, state, tokenizer_sha, source_desc)
        _truncate_to(out_dir, state["file_bytes"])
    else:
        _remove_store_files(out_dir)
        state = _start(out_dir, tokenizer_sha=tokenizer_sha, source_desc=source_desc, vocab_size=vocab_size,
                       dtype=dtype)

    docs = _checked_texts(islice(iter(documents), state["docs_read"], None), first_index=state["docs_read"])
    count_bytes = total_bytes is not None
    bar = progress(total=total_bytes if count_bytes else total_docs,
                   initial=state["n_bytes_text"] if count_bytes else state["docs_read"],
                   unit="B" if count_bytes else "doc", unit_scale=True, disable=not show_progress,
                   desc=f"tokenize {out_dir.name}", dynamic_ncols=True)
    start_time, start_bytes, start_seconds = time.perf_counter(), state["n_bytes_text"], state["build_seconds"]
    with _parallelism(), ThreadPoolExecutor(max_workers=1) as pool, bar:
        encode = lambda texts: tokenizer.encode_batch(texts, add_special_tokens=False)
        batch, error = _next_batch(docs, batch_docs)
        pending = pool.submit(encode, batch) if batch else None
        while pending is not None:
            encodings = pending.result()
            next_batch, error = _next_batch(docs, batch_docs) if error is None else ([], error)
            following = pool.submit(encode, next_batch) if next_batch else None  # overlaps the writing below
            n_bytes = _append_batch(out_dir, state, batch, encodings, dtype)
            elapsed = time.perf_counter() - start_time
            state["build_seconds"] = start_seconds + elapsed
            _write_json(out_dir / PROGRESS_FILE, state)
            bar.update(n_bytes if count_bytes else len(batch))
            bar.set_postfix({"tokens": f"{state['n_tokens']:,}",
                             "MB/s": f"{(state['n_bytes_text'] - start_bytes) / 1e6 / max(elapsed, 1e-9):.2f}"},
                            refresh=False)
            batch, pending = next_batch, following
    if error is not None:
        raise error

    if state["n_tokens"] == 0:
        _remove_store_files(out_dir)
        raise StoreError(f"{out_dir}: no tokens: all {state['docs_read']} documents are empty "
                         f"(source {source_desc!r})")
    meta = {key: value for key, value in state.items() if key != "file_bytes"}
    meta["complete"] = True
    _write_json(out_dir / META_FILE, meta)
    (out_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return TokenStore.open(out_dir)


def sentence_token_bounds(text: str, token_char_ends: np.ndarray) -> np.ndarray:
    """Token boundaries of the sentences of ``text``: (n + 1,) int64 from 0 to the number of tokens.

    A sentence starts at the first token whose character end lies past the sentence's first
    character (for tokens that begin at that character, as with BERT/WordPiece, this is the first
    token starting at or after it; a byte-level token that carries the preceding space also counts).
    Sentences that get no token are dropped.

    Args:
        text: the document.
        token_char_ends: (T,) character end offset of each token in ``text`` (``Encoding.offsets[:, 1]``).
    """
    n_tok = len(token_char_ends)
    spans = sentence_spans(text)
    if n_tok == 0:
        return np.zeros(1, dtype=np.int64)
    sent_first_chars = np.fromiter((start for start, _ in spans[1:]), dtype=np.int64, count=max(len(spans) - 1, 0))
    ends = np.maximum.accumulate(token_char_ends)  # offsets are monotone for usual tokenizers; make sure
    bounds = np.empty(len(sent_first_chars) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, n_tok
    bounds[1:-1] = np.searchsorted(ends, sent_first_chars, side="right")
    nonempty = np.flatnonzero(bounds[1:] > bounds[:-1])
    return np.append(bounds[nonempty], n_tok)


# ---------------------------------------------------------------------------------------------- helpers


def _plain_tokenizer(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    if not isinstance(tokenizer, tokenizers.Tokenizer):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    if tokenizer.padding is None and tokenizer.truncation is None:
        return tokenizer
    plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # a copy: the caller's settings stay as they are
    plain.no_padding()
    plain.no_truncation()
    return plain


@contextmanager
def _parallelism():
    """Let encode_batch use every core unless the user set TOKENIZERS_PARALLELISM; restore it after."""
    if "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _checked_texts(texts: Iterator, *, first_index: int) -> Iterator[str]:
    for i, text in enumerate(texts, start=first_index):
        if not isinstance(text, str):
            raise TypeError(f"document {i} is a {type(text).__name__}, expected str")
        yield text


def _next_batch(docs: Iterator[str], n: int) -> tuple[list[str], BaseException | None]:
    """Up to n documents, and the error that stopped the reading (the documents before it still count)."""
    batch: list[str] = []
    try:
        for text in docs:
            batch.append(text)
            if len(batch) == n:
                break
    except BaseException as error:  # re-raised by build_store once the documents before it are stored
        return batch, error
    return batch, None


def _append_batch(out_dir: Path, state: dict, texts: list[str], encodings: list, dtype: np.dtype) -> int:
    ids, sent_ends, doc_ends = [], [], []
    n_tokens, n_sents = state["n_tokens"], state["n_sents"]
    for text, enc in zip(texts, encodings):
        n = len(enc.ids)
        if n == 0:
            continue
        token_char_ends = np.fromiter((end for _, end in enc.offsets), dtype=np.int64, count=n)
        bounds = sentence_token_bounds(text, token_char_ends)  # (S + 1,) from 0 to n
        ids.append(np.asarray(enc.ids, dtype=dtype))
        sent_ends.append(bounds[1:] + n_tokens)
        n_tokens += n
        n_sents += len(bounds) - 1
        doc_ends.append(n_sents)
    if ids:
        _append(out_dir / TOKENS_FILE, np.concatenate(ids))
        _append(out_dir / SENTS_FILE, np.concatenate(sent_ends))
        _append(out_dir / DOCS_FILE, np.asarray(doc_ends, dtype=np.int64))
    state["docs_read"] += len(texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    state["n_bytes_text"] += n_bytes
    state["n_docs"] += len(doc_ends)
    state["n_tokens"], state["n_sents"] = n_tokens, n_sents
    state["file_bytes"] = {name: (out_dir / name).stat().st_size for name in (TOKENS_FILE, SENTS_FILE, DOCS_FILE)}
    return n_bytes


def _append(path: Path, array: np.ndarray) -> None:
    with open(path, "ab") as f:
        f.write(array.tobytes())
        f.flush()
        os.fsync(f.fileno())  # data on disk before progress.json says so


def _start(out_dir: Path, *, tokenizer_sha: str, source_desc: str, vocab_size: int, dtype: np.dtype) -> dict:
    (out_dir / TOKENS_FILE).write_bytes(b"")
    zero = np.zeros(1, dtype=np.int64).tobytes()  # the leading 0 of both offset arrays
    (out_dir / SENTS_FILE).write_bytes(zero)
    (out_dir / DOCS_FILE).write_bytes(zero)
    state = {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha": tokenizer_sha,
        "source_desc": source_desc,
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "docs_read": 0,  # input documents consumed, empty ones included
        "n_docs": 0,
        "n_sents": 0,
        "n_tokens": 0,
        "n_bytes_text": 0,  # UTF-8 bytes of the documents read
        "build_seconds": 0.0,
        "file_bytes": {TOKENS_FILE: 0, SENTS_FILE: 8, DOCS_FILE: 8},
    }
    _write_json(out_dir / PROGRESS_FILE, state)
    return state


def _check_same_inputs(out_dir: Path, recorded: dict, tokenizer_sha: str, source_desc: str) -> None:
    problems = []
    if recorded.get("tokenizer_sha") != tokenizer_sha:
        problems.append(f"tokenizer {str(recorded.get('tokenizer_sha'))[:12]}…, not {tokenizer_sha[:12]}…")
    if recorded.get("source_desc") != source_desc:
        problems.append(f"sources {recorded.get('source_desc')!r}, not {source_desc!r}")
    if problems:
        kind = "complete store" if recorded.get("complete") else "interrupted build"
        raise StoreError(f"{out_dir}: the {kind} there was made from {' and '.join(problems)}; "
                         "pass resume=False to delete it and rebuild, or choose another folder")


def _truncate_to(out_dir: Path, file_bytes: dict) -> None:
    for name, size in file_bytes.items():
        path = out_dir / name
        have = path.stat().st_size if path.is_file() else -1
        if have < size:
            raise StoreError(f"{path}: {have} bytes, progress.json recorded {size}; cannot resume: "
                             "pass resume=False to rebuild")
        if have > size:  # a batch written after the last progress.json: it is read again
            os.truncate(path, size)


def _remove_store_files(out_dir: Path) -> None:
    for name in (META_FILE, PROGRESS_FILE, TOKENS_FILE, SENTS_FILE, DOCS_FILE):
        (out_dir / name).unlink(missing_ok=True)
    for path in out_dir.glob(BLOCKS_GLOB):
        path.unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise StoreError(f"{path}: not valid JSON ({error}); pass resume=False to rebuild the store") from error


def _write_json(path: Path, data: dict) -> None:
    """Write atomically: a temporary file in the same folder, then os.replace."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
