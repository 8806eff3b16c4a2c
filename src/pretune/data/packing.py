"""Blocks for pretraining: RoBERTa packing of a token store, held-out splits, deterministic batch plans.

Packing (Liu et al. 2019, RoBERTa §4.2):
    FULL-SENTENCES ("full"): complete sentences packed contiguously up to block_size tokens, crossing
        document boundaries, with an extra separator token between documents when ``doc_sep_id`` is given.
    DOC-SENTENCES ("doc"): the same, but a block never crosses a document boundary, so the last block of
        a document may be short.
A sentence longer than block_size is cut into block_size pieces (its last piece then starts a block like
a sentence does). Blocks carry no special tokens: the objective adds its own ([CLS]/[SEP], BOS/EOS, ...).

A block is a contiguous token range of the store plus the separators at the document boundaries inside
it, so a :class:`BlockIndex` is one (n_blocks, 3) int64 table (start, end, length), cached as .npy
beside the store.

Batch plans: ``batch_plan`` shuffles example ids with ``np.random.default_rng([seed, epoch])``, optionally
gathering examples of similar length into the same batch (length bucketing), so a trainer can resume at
(epoch, batch index) and each DDP rank can take its slice of every global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from pretune.data.store import TokenStore

PackMode = Literal["full", "doc"]
PACK_MODES = ("full", "doc")


@dataclass
class Block:
    """One training example before the objective adds its special tokens.

    A document separator counts as a one-token sentence: its position and the position after it are
    both in ``sent_starts``. A block that begins with a piece of an oversized sentence still lists 0.
    """

    tokens: np.ndarray  # int64 (L,), L <= block_size
    sent_starts: np.ndarray  # int64 (S,): increasing positions in tokens where a sentence begins, 0 first
    doc_id: int  # document of the first token


class BlockIndex:
    """The blocks of a token store, as a table of token ranges; ``index[i]`` materialises block i.

    Attributes:
        store: the :class:`TokenStore` the ranges point into.
        block_size, mode, doc_sep_id: how it was packed (``doc_sep_id`` is None in "doc" mode).
        starts, ends: (n_blocks,) int64 token range [start, end) of each block in ``store.tokens``.
        lengths: (n_blocks,) int64 tokens per block, separators included.
    """

    def __init__(self, store: TokenStore, table: np.ndarray, *, block_size: int, mode: PackMode,
                 doc_sep_id: int | None):
        self.store = store
        self.block_size = block_size
        self.mode = mode
        self.doc_sep_id = doc_sep_id
        self.table = table  # (n_blocks, 3) int64: start, end, length
        self.starts, self.ends, self.lengths = table[:, 0], table[:, 1], table[:, 2]
        self._doc_starts = np.asarray(store.sent_offsets[np.asarray(store.doc_offsets)])  # (n_docs + 1,) tokens

    def __len__(self) -> int:
        return len(self.table)

    def __repr__(self) -> str:
        return (f"BlockIndex(n_blocks={len(self)}, block_size={self.block_size}, mode={self.mode!r}, "
                f"doc_sep_id={self.doc_sep_id}, mean_fill={self.lengths.mean() / self.block_size:.3f})")

    def __getitem__(self, i: int) -> Block:
        n = len(self.table)
        if not -n <= i < n:
            raise IndexError(f"block {i} out of range for {n} blocks")
        start, end, length = (int(v) for v in self.table[i])
        tokens = np.asarray(self.store.tokens[start:end], dtype=np.int64)
        offsets = self.store.sent_offsets
        inner = np.asarray(offsets[np.searchsorted(offsets, start, "right"):np.searchsorted(offsets, end, "left")])
        inner = inner - start  # sentence starts after position 0
        doc_starts = self._doc_starts
        doc_id = int(np.searchsorted(doc_starts, start, "right")) - 1
        if length > end - start:  # separators at the document boundaries inside the block
            seps = doc_starts[np.searchsorted(doc_starts, start, "right"):np.searchsorted(doc_starts, end, "left")]
            seps = seps - start
            tokens = np.insert(tokens, seps, self.doc_sep_id)
            sep_positions = seps + np.arange(len(seps))
            shifted = inner + np.searchsorted(seps, inner, "right")
            sent_starts = np.sort(np.concatenate([[0], shifted, sep_positions]))
        else:
            sent_starts = np.concatenate([[0], inner])
        assert len(tokens) == length, (i, len(tokens), length)
        return Block(tokens=tokens, sent_starts=sent_starts.astype(np.int64), doc_id=doc_id)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def pack_blocks(store: TokenStore, *, block_size: int, mode: PackMode = "full", doc_sep_id: int | None = None,
                cache: bool = True) -> BlockIndex:
    """Pack the sentences of ``store`` into blocks of at most ``block_size`` tokens (RoBERTa §4.2).

    Args:
        store: an opened :class:`TokenStore`.
        block_size: most tokens per block, separators included (leave room for the objective's specials).
        mode: "full" (FULL-SENTENCES: blocks cross documents) or "doc" (DOC-SENTENCES: they never do).
        doc_sep_id: in "full" mode, a token inserted between two documents inside a block (it counts toward
            the length); None: nothing is inserted. Ignored in "doc" mode.
        cache: load/save the table as ``blocks_{mode}_{block_size}_sep{doc_sep_id}.npy`` in the store's folder.

    Returns:
        A :class:`BlockIndex`; blocks are in stream order (shuffle with :func:`batch_plan`).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size ({block_size!r}) must be an integer >= 1")
    if mode not in PACK_MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {PACK_MODES}")
    if mode == "doc":
        doc_sep_id = None
    if doc_sep_id is not None and not 0 <= doc_sep_id < store.vocab_size:
        raise ValueError(f"doc_sep_id ({doc_sep_id}) must be a token id in [0, {store.vocab_size})")
    block_size = int(block_size)
    path = Path(store.path) / f"blocks_{mode}_{block_size}_sep{'none' if doc_sep_id is None else doc_sep_id}.npy"
    table = _load_table(path, store) if cache else None
    if table is None:
        table = _pack(np.asarray(store.sent_offsets), np.asarray(store.doc_offsets), block_size=block_size,
                      doc_mode=mode == "doc", with_sep=doc_sep_id is not None)
        if cache:
            _save_table(path, table)
    return BlockIndex(store, table, block_size=block_size, mode=mode, doc_sep_id=doc_sep_id)


def _pack(sent_offsets: np.ndarray, doc_offsets: np.ndarray, *, block_size: int, doc_mode: bool,
          with_sep: bool) -> np.ndarray:
    """Greedy packing, one pass over the sentences: the (n_blocks, 3) table of (start, end, length)."""
    n_sents = len(sent_offsets) - 1
    doc_first = np.zeros(n_sents, dtype=bool)
    doc_first[doc_offsets[:-1]] = True
    offsets = sent_offsets.tolist()
    starts_doc = doc_first.tolist()
    table: list[tuple[int, int, int]] = []
    emit = table.append
    sep = 1 if with_sep else 0
    block_start, fill = 0, 0  # current block: first token, tokens so far (separators included)
    for s in range(n_sents):
        a, b = offsets[s], offsets[s + 1]
        extra = sep if starts_doc[s] and fill else 0
        if fill and ((doc_mode and starts_doc[s]) or fill + extra + b - a > block_size):
            emit((block_start, a, fill))
            fill, extra = 0, 0
        if not fill:
            while b - a > block_size:  # a sentence longer than a block: full pieces, the rest starts a block
                emit((a, a + block_size, block_size))
                a += block_size
            block_start = a
        fill += extra + b - a
    if fill:
        emit((block_start, offsets[-1], fill))
    return np.asarray(table, dtype=np.int64).reshape(-1, 3)


def _load_table(path: Path, store: TokenStore) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        table = np.load(path)
    except (OSError, ValueError):
        return None
    # a table from another build of the store would not cover exactly this token stream
    if table.ndim != 2 or table.shape[1] != 3 or len(table) == 0 or table[0, 0] != 0 or table[-1, 1] != store.n_tokens:
        return None
    return table


def _save_table(path: Path, table: np.ndarray) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")  # atomic: DDP ranks may race to write it
    try:
        np.save(tmp, table)
        os.replace(tmp, path)
    except OSError:  # a read-only store: packing is cheap enough to redo
        tmp.unlink(missing_ok=True)


def split_index(index_or_n: BlockIndex | int, *, eval_fraction: float | None = None, eval_blocks: int | None = None,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A fixed held-out split of block ids: (train_ids, eval_ids), both sorted int64.

    Args:
        index_or_n: a :class:`BlockIndex` (or any sized collection) or the number of blocks.
        eval_fraction: share of blocks held out, in [0, 1) (at least one block when > 0); or
        eval_blocks: number of blocks held out, in [0, n). Give exactly one of the two.
        seed: the ids are drawn with ``np.random.default_rng(seed)``; the same seed gives the same split.
    """
    n = index_or_n if isinstance(index_or_n, (int, np.integer)) else len(index_or_n)
    if (eval_fraction is None) == (eval_blocks is None):
        raise ValueError(f"give exactly one of eval_fraction ({eval_fraction}) and eval_blocks ({eval_blocks})")
    if eval_fraction is not None:
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"eval_fraction ({eval_fraction}) must be in [0, 1)")
        eval_blocks = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
    if eval_blocks < 0 or (eval_blocks > 0 and eval_blocks >= n):
        raise ValueError(f"eval_blocks ({eval_blocks}) must leave training blocks: expected 0 <= eval_blocks < {n}")
    held_out = np.zeros(n, dtype=bool)
    held_out[np.random.default_rng(seed).permutation(n)[:eval_blocks]] = True
    return np.flatnonzero(~held_out).astype(np.int64), np.flatnonzero(held_out).astype(np.int64)


def batch_plan(n_or_ids: int | np.ndarray, *, batch_size: int, epoch: int, seed: int, lengths: np.ndarray | None = None,
               bucket: bool = False, drop_last: bool = True, bucket_window: int = 100) -> list[np.ndarray]:
    """The batches of one epoch: a pure function of (ids, seed, epoch, ...), cheap to recompute on resume.

    Ids are shuffled with ``np.random.default_rng([seed, epoch])`` and cut into batches. With ``bucket``
    ("gather sentences of similar length"), each window of ``bucket_window * batch_size`` shuffled ids is
    sorted by length before it is cut, then the order of the batches is shuffled, so a batch holds
    examples of similar length (less padding) while the batch order stays random.

    Args:
        n_or_ids: number of examples (ids 0..n-1) or an array of example ids (e.g. train ids of :func:`split_index`).
        batch_size: examples per (global) batch; under DDP each rank takes its slice of every batch.
        epoch, seed: with the ids, all that decides the plan.
        lengths: length of each example, indexed by example id (e.g. ``BlockIndex.lengths``); needed for bucket.
        bucket: gather examples of similar length into a batch.
        drop_last: drop a final batch smaller than batch_size; otherwise it is kept as the last batch.
        bucket_window: batches per sorting window (larger: less length spread per batch, less randomness).

    Returns:
        A list of int64 (batch_size,) id arrays (the last one shorter when drop_last is False).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    if bucket_window < 1:
        raise ValueError(f"bucket_window ({bucket_window}) must be >= 1")
    if epoch < 0:
        raise ValueError(f"epoch ({epoch}) must be >= 0")
    if isinstance(n_or_ids, (int, np.integer)):
        if n_or_ids < 0:
            raise ValueError(f"number of examples ({n_or_ids}) must be >= 0")
        ids = np.arange(n_or_ids, dtype=np.int64)
    else:
        ids = np.asarray(n_or_ids, dtype=np.int64).reshape(-1)
    if bucket:
        if lengths is None:
            raise ValueError("bucket=True needs lengths (one per example id)")
        lengths = np.asarray(lengths)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(lengths)):
            raise ValueError(f"lengths has {len(lengths)} entries but the ids range over [{ids.min()}, {ids.max()}]")
    rng = np.random.default_rng([seed, epoch])
    ids = rng.permutation(ids)
    n_full = len(ids) // batch_size
    ids, rest = ids[:n_full * batch_size], ids[n_full * batch_size:]  # the ids of a partial batch: random ones
    if bucket and n_full:
        window = bucket_window * batch_size  # a multiple of batch_size, so every batch stays inside one window
        windows = np.split(ids, range(window, len(ids), window))
        ids = np.concatenate([w[np.argsort(lengths[w], kind="stable")] for w in windows])
    batches = [ids[i * batch_size:(i + 1) * batch_size] for i in range(n_full)]
    if bucket:
        batches = [batches[i] for i in rng.permutation(n_full)]
    if not drop_last and len(rest):
        batches.append(rest)
    return batches
