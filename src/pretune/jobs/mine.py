"""Hard-negative mining: (anchor, positive) pairs -> triplets whose negatives are texts a model ranks close to the
anchor but that are not its positive, for ``--task embedding`` (MNRL with hard negatives).

In-batch negatives are mostly easy (random texts of the batch); a negative the current model ranks near the top
teaches it the distinctions it still gets wrong (Karpukhin et al. 2020, DPR; Xiong et al. 2021, ANCE). Some
top-ranked texts are in fact relevant, unlabelled ("false negatives"): ``range_min`` skips the very top ranks and
the margins drop candidates scored almost as high as the known positive (Moreira et al. 2024, NV-Retriever: a
negative must score below 95 % of the positive, ``relative_margin=0.05``, worked best)::

    model, tok = load_encoder("runs/embed/model")
    embed = lambda texts: embed_texts(model, tok, texts, normalize=True)
    mined = mine_negatives(anchors, positives, embed, settings=MineSettings(num_negatives=3, relative_margin=0.05))
    mined[0].negatives, mined[0].scores, mined[0].positive_score

What is ranked and kept (every score is the cosine of the two texts' embeddings):

* the corpus is every distinct positive of the data, then every distinct text of ``corpus`` (extra documents);
* for an anchor, the candidates are the corpus without the anchor's own positives (an anchor that occurs in several
  records has all of their positives removed) and without the anchor's own text; ``rank`` 1 is the candidate most
  similar to the anchor (ties: the earlier corpus text first);
* ``range_min=K`` skips ranks 1..K, ``range_max=M`` looks no further than rank M (default: every candidate);
* within that range a candidate ``n`` of the record with positive ``p`` is kept when
  ``s(a, n) <= s(a, p) - margin`` (absolute), ``s(a, n) <= s(a, p) - |s(a, p)| * relative_margin`` (relative),
  ``s(a, n) <= max_score`` and ``s(a, n) >= min_score`` (each only when set), and it is not already one of the
  record's negatives;
* ``sampling="top"`` takes the first ``num_negatives`` kept candidates by rank, ``"random"`` that many drawn
  uniformly from all kept candidates (the same draw for the same ``seed`` and record), written in rank order.

A record may get fewer negatives than asked (the filters left fewer), or none. The CLI is ``pretune mine``.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from ..config import ConfigError
from ..data.readers import DataError, iter_records, record_text, record_where

__all__ = ["MineSettings", "Mined", "MineReport", "PairFile", "mine_negatives", "read_pairs_for_mining", "read_corpus",
           "mine_file", "DEFAULT_NUM_NEGATIVES"]

DEFAULT_NUM_NEGATIVES = 3  # sentence-transformers' mine_hard_negatives default, so files mined either way compare;
# each anchor's negatives join every anchor's candidates in MNRL, so B pairs become 5B rows a step (1: 3B rows)
_SEARCH_ROWS = 256  # anchors scored against the corpus per matrix product, at most (memory: this x corpus floats)
_SEARCH_FLOATS = 1 << 25  # ... and at most this many scores at once (128 MiB): fewer rows for a large corpus
_FIRST_LOOK = 64  # ranks sorted beyond what "top" needs before sorting a whole row (most rows need no more)


@dataclass(frozen=True)
class MineSettings:
    """Which ranked texts become negatives (the module docstring defines each exactly)."""

    num_negatives: int = DEFAULT_NUM_NEGATIVES  # negatives mined per record (fewer if the filters leave fewer)
    range_min: int = 0  # skip the K top-ranked candidates (often unlabelled positives: false negatives)
    range_max: int | None = None  # look no further than rank M; None: every candidate
    margin: float | None = None  # absolute: keep s(a,n) <= s(a,p) - margin (0: never closer than the positive)
    relative_margin: float | None = None  # keep s(a,n) <= s(a,p) - |s(a,p)| * r (0.05: NV-Retriever's 95 %)
    max_score: float | None = None  # keep s(a,n) <= max_score (near-duplicates of the anchor out)
    min_score: float | None = None  # keep s(a,n) >= min_score (too easy to teach anything out)
    sampling: Literal["top", "random"] = "top"  # top: the best-ranked kept candidates; random: drawn among them
    seed: int = 0  # sampling="random": the draw (per record, so it does not depend on batching)

    def validate(self) -> None:
        """Raise ConfigError naming the setting (with its flag) that is out of range."""
        if self.num_negatives < 1:
            raise ConfigError(f"num_negatives (--num-negatives) must be >= 1, got {self.num_negatives}")
        if self.range_min < 0:
            raise ConfigError(f"range_min (--range-min) must be >= 0, got {self.range_min}")
        if self.range_max is not None and self.range_max - self.range_min < self.num_negatives:
            raise ConfigError(f"range_max (--range-max) {self.range_max} leaves {self.range_max - self.range_min} "
                              f"ranks after range_min {self.range_min}; it must leave at least num_negatives "
                              f"({self.num_negatives})")
        for name, flag, value in (("margin", "--margin", self.margin), ("max_score", "--max-score", self.max_score),
                                  ("min_score", "--min-score", self.min_score),
                                  ("relative_margin", "--relative-margin", self.relative_margin)):
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name} ({flag}) must be a finite number, got {value}")
        if self.relative_margin is not None and not 0 <= self.relative_margin < 1:
            raise ConfigError(f"relative_margin (--relative-margin) is a fraction of the positive's score, in "
                              f"[0, 1); got {self.relative_margin}")
        if self.max_score is not None and self.min_score is not None and self.min_score > self.max_score:
            raise ConfigError(f"min_score {self.min_score} is above max_score {self.max_score}: nothing could be kept")
        if self.sampling not in ("top", "random"):
            raise ConfigError(f"sampling (--sampling) must be top or random, got {self.sampling!r}")

    def ceiling(self, positive_score: float) -> float:
        """The highest score a negative of a record whose positive scored ``positive_score`` may have."""
        hi = math.inf
        if self.margin is not None:
            hi = min(hi, positive_score - self.margin)
        if self.relative_margin is not None:
            hi = min(hi, positive_score - abs(positive_score) * self.relative_margin)
        if self.max_score is not None:
            hi = min(hi, self.max_score)
        return hi


@dataclass
class Mined:
    """One record's result: its mined negatives by rank, their scores, and the anchor-positive score."""

    negatives: list[str]
    scores: list[float]
    positive_score: float


# --------------------------------------------------------------------------------------------------
# Mining
# --------------------------------------------------------------------------------------------------

def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _ranked(scores: np.ndarray, depth: int) -> np.ndarray:
    """The corpus ids of the ``depth`` highest finite ``scores`` (excluded ones are -inf), highest first, ties by id
    (as a stable full sort would order them, but only the top ``depth`` sorted)."""
    finite = int(np.isfinite(scores).sum())
    depth = min(depth, finite)
    if depth == 0:
        return np.zeros(0, dtype=np.int64)
    if depth < len(scores):
        kth = -np.partition(-scores, depth - 1)[depth - 1]  # the depth-th highest score
        ids = np.flatnonzero(scores >= kth)  # every id tied at the boundary, so ties break by id below
    else:
        ids = np.flatnonzero(np.isfinite(scores))
    return ids[np.lexsort((ids, -scores[ids]))][:depth]


def _pick(ids: np.ndarray, scores: np.ndarray, *, lo: float, hi: float, skip: set[int], settings: MineSettings,
          rng: np.random.Generator | None) -> list[int]:
    """Positions (into ``ids``, ranks - 1) of the candidates one record keeps, in rank order."""
    s = scores[ids]
    ok = (s <= hi) & (s >= lo)
    ok[: settings.range_min] = False
    if skip:
        ok &= ~np.isin(ids, list(skip))
    kept = np.flatnonzero(ok)
    if rng is None or len(kept) <= settings.num_negatives:
        return kept[: settings.num_negatives].tolist()
    return sorted(rng.choice(kept, size=settings.num_negatives, replace=False).tolist())


def mine_negatives(anchors: Sequence[str], positives: Sequence[str], embed: Callable[[list[str]], np.ndarray], *,
                   corpus: Sequence[str] = (), settings: MineSettings = MineSettings(),
                   existing: Sequence[Sequence[str]] | None = None, show_progress: bool = False) -> list[Mined]:
    """Hard negatives for each record ``(anchors[i], positives[i])``, ranked by ``embed``'s vectors (module docstring).

    Args:
        anchors, positives: the records' two texts, aligned (an anchor may repeat with other positives).
        embed: texts -> ``(len(texts), dim)`` array (e.g. :func:`pretune.jobs.embed.embed_texts` of a model); called
            once, on every distinct anchor, positive and corpus text; scores are cosines (its vectors are normalised
            here).
        corpus: extra candidate texts besides the positives.
        settings: what is kept (:class:`MineSettings`).
        existing: per record, negatives it already has: never mined again for it.
        show_progress: a progress bar over the anchors' search (stderr; `pretune.io.progress`).

    Returns:
        One :class:`Mined` per record, in order.
    """
    settings.validate()
    if len(anchors) != len(positives):
        raise ValueError(f"{len(anchors)} anchors but {len(positives)} positives; expected one positive per anchor")
    if existing is not None and len(existing) != len(anchors):
        raise ValueError(f"existing holds {len(existing)} lists for {len(anchors)} records")
    docs = list(dict.fromkeys([*positives, *corpus]))  # the corpus: distinct positives, then the extra texts
    doc_id = {t: k for k, t in enumerate(docs)}
    queries = list(dict.fromkeys(anchors))
    texts = list(dict.fromkeys([*queries, *docs]))  # everything embedded once
    row = {t: k for k, t in enumerate(texts)}
    vectors = _unit(embed(texts))
    if vectors.shape[0] != len(texts):
        raise ValueError(f"embed returned {vectors.shape[0]} vectors for {len(texts)} texts")
    Q, D = vectors[[row[t] for t in queries]], vectors[[row[t] for t in docs]]  # (A, dim), (M, dim)

    by_query: dict[str, list[int]] = {}
    for i, a in enumerate(anchors):
        by_query.setdefault(a, []).append(i)
    own = {a: {doc_id[positives[i]] for i in recs} | ({doc_id[a]} if a in doc_id else set())
           for a, recs in by_query.items()}
    limit = settings.range_max  # ranks looked at; None: all
    need = settings.range_min + settings.num_negatives + _FIRST_LOOK  # what "top" usually needs sorted
    out: list[Mined | None] = [None] * len(anchors)

    bar = None
    if show_progress:
        from ..io.progress import progress

        bar = progress(total=len(queries), unit="anchor", desc="mining", dynamic_ncols=True)
    try:
        rows = max(1, min(_SEARCH_ROWS, _SEARCH_FLOATS // max(1, len(docs))))
        for lo_q in range(0, len(queries), rows):
            block = queries[lo_q:lo_q + rows]
            sims = Q[lo_q:lo_q + len(block)] @ D.T  # (c, M) cosines
            for r, a in enumerate(block):
                s = sims[r].astype(np.float64)  # the positives' scores are read from it before they are excluded
                pos_of = {i: float(s[doc_id[positives[i]]]) for i in by_query[a]}
                s[list(own[a])] = -np.inf  # the anchor's positives and itself are never candidates
                full = int(np.isfinite(s).sum()) if limit is None else limit
                depth = full if settings.sampling == "random" else min(full, need)
                ids = _ranked(s, depth)
                for i in by_query[a]:
                    pos = pos_of[i]
                    hi = settings.ceiling(pos)
                    lo = -math.inf if settings.min_score is None else settings.min_score
                    skip = {doc_id[t] for t in existing[i] if t in doc_id} if existing is not None else set()
                    rng = np.random.default_rng([settings.seed, i]) if settings.sampling == "random" else None
                    picked = _pick(ids, s, lo=lo, hi=hi, skip=skip, settings=settings, rng=rng)
                    # "top" looked at the first ranks only: look at all of them when those kept too few and the
                    # ranks not looked at could still pass (scores fall with rank, so once one is below min_score
                    # none further is kept)
                    if (len(picked) < settings.num_negatives and len(ids) < full and len(ids) == depth
                            and s[ids[-1]] >= lo):
                        ids = _ranked(s, full)
                        depth = full
                        picked = _pick(ids, s, lo=lo, hi=hi, skip=skip, settings=settings, rng=rng)
                    out[i] = Mined(negatives=[docs[ids[p]] for p in picked],
                                   scores=[float(s[ids[p]]) for p in picked], positive_score=pos)
            if bar is not None:
                bar.update(len(block))
    finally:
        if bar is not None:
            bar.close()
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------

def _nonempty(record: dict, name: str, where: str, flag: str) -> str:
    text = record_text(record, name, where, hint=flag)
    if not text.strip():
        raise DataError(f"{where}: field {name!r} is empty; expected a text")
    return text


def _negatives_of(record: dict, name: str, where: str) -> list[str]:
    if name not in record:
        return []
    value = record[name]
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) and t.strip() for t in texts):
        raise DataError(f"{where}: field {name!r} already holds {str(value)[:60]!r}; expected a non-empty text or a "
                        f"list of them (the mined negatives are added after them)")
    return texts


@dataclass
class PairFile:
    """A file of pairs as read for mining, one entry per record in each list."""

    records: list[dict]  # the records as read (every field)
    wheres: list[str]  # where each is (file:line, or file: row N)
    anchors: list[str]
    positives: list[str]
    existing: list[list[str]]  # the negatives each record already has


def read_pairs_for_mining(path: str | os.PathLike, *, anchor_field: str = "anchor",
                          positive_field: str = "positive", negative_field: str = "negative") -> PairFile:
    """The records of a .jsonl/.csv/.tsv/.parquet file of pairs. A missing, non-text or empty anchor/positive, or a
    negative field that is not a text or a list of texts, is a DataError naming the file, line (row) and field."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    pairs = PairFile([], [], [], [], [])
    for num, rec in iter_records(path):
        where = record_where(path, num)
        pairs.anchors.append(_nonempty(rec, anchor_field, where, "--anchor-field"))
        pairs.positives.append(_nonempty(rec, positive_field, where, "--positive-field"))
        pairs.existing.append(_negatives_of(rec, negative_field, where))
        pairs.records.append(rec)
        pairs.wheres.append(where)
    return pairs


def read_corpus(path: str | os.PathLike, *, field: str = "text") -> list[str]:
    """Extra candidate texts: a .txt file (one per line, blank lines skipped) or a record file's ``field`` (an empty
    text is a DataError naming its line)."""
    from .embed import read_texts

    path = Path(path)
    if path.name.lower().removesuffix(".gz").endswith((".txt", ".text")):
        return read_texts(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return [_nonempty(rec, field, record_where(path, num), "--corpus-field") for num, rec in iter_records(path)]


def _check_out(out: Path) -> None:
    if not out.name.lower().endswith((".jsonl", ".jsonl.gz")):
        raise ConfigError(f"--out {out}: the triplets are written as JSONL; expected a .jsonl (or .jsonl.gz) file")


def _write_records(path: Path, rows) -> None:
    from ..io.outputs import write_atomic

    def write(fh):
        stream = gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) if path.name.lower().endswith(".gz") else fh
        for where, row in rows:
            try:
                line = json.dumps(row, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise DataError(f"{where}: the record cannot be written as JSON ({e})") from None
            stream.write((line + "\n").encode("utf-8"))
        if stream is not fh:
            stream.close()

    write_atomic(path, write)


@dataclass
class MineReport:
    """What :func:`mine_file` read and wrote."""

    out: Path
    records: int  # records read
    anchors: int  # distinct anchors among them
    corpus: int  # distinct candidate texts (positives + --corpus)
    written: int  # records written
    no_candidate: int  # records for which no candidate passed the range and filters
    dropped: int  # of those, records not written (no negative at all, and keep_unmined off)
    short: int  # records that got some negatives but fewer than asked
    negatives: int  # mined negatives written
    mean_positive: float  # mean cosine anchor-positive over the records
    mean_negative: float | None  # mean cosine anchor-mined negative (None: none mined)
    how: str = ""  # the embedding: pooling, max length
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A few lines for the terminal: the counts and mean scores."""
        lines = [f"mined {self.negatives:,} negatives for {self.records - self.no_candidate:,} of {self.records:,} "
                 f"records ({self.anchors:,} distinct anchors) from a corpus of {self.corpus:,} texts ({self.how})"]
        if self.no_candidate:
            fate = (f"{self.dropped:,} of them dropped (no negative at all; --keep-unmined writes them as they are)"
                    if self.dropped else "written as they were")
            lines.append(f"  {self.no_candidate:,} records had no candidate left after the range and filters; {fate}")
        if self.short:
            lines.append(f"  {self.short:,} records got fewer negatives than asked")
        neg = "-" if self.mean_negative is None else f"{self.mean_negative:.4f}"
        lines.append(f"  mean cosine: anchor-positive {self.mean_positive:.4f}, anchor-negative {neg}")
        lines += [f"  {n}" for n in self.notes]
        lines.append(f"wrote {self.written:,} records -> {self.out}")
        return "\n".join(lines)


def mine_file(model: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, *,
              corpus: Sequence[str | os.PathLike] = (), corpus_field: str = "text", anchor_field: str = "anchor",
              positive_field: str = "positive", negative_field: str = "negative",
              settings: MineSettings = MineSettings(), pooling: str | None = None, batch_size: int = 32,
              max_len: int | None = None, tokenizer: str | os.PathLike | None = None, device: str = "cpu",
              keep_unmined: bool = False, overwrite: bool = False, show_progress: bool = False) -> MineReport:
    """Mine hard negatives for the pairs in ``data`` with ``model`` and write the triplets to ``out`` (JSONL).

    Every record is written as it was read (all its fields), its ``negative_field`` set to a list: the negatives it
    had, then the mined ones. A record with no negative at all afterwards is dropped unless ``keep_unmined``.
    ``out`` is written through a temporary file renamed into place; an existing ``out`` needs ``overwrite``.

    Args:
        model: a pretune checkpoint, Hugging Face or sentence-transformers folder (its modules' pooling and max
            length apply unless ``pooling`` / ``max_len`` say otherwise).
        data: .jsonl/.csv/.tsv/.parquet pairs (``anchor_field``, ``positive_field``).
        out: the .jsonl (or .jsonl.gz) to write.
        corpus: files of extra candidate texts (.txt lines, or ``corpus_field`` of records).
        pooling: mean, cls or last; default the folder's sentence-transformers Pooling, else the model's own
            pooling, else its family's first (the rule ``--task embedding`` trains with).
        device: where the model embeds (``"auto"``: cuda when available); the ranking runs on the CPU.
        settings, batch_size, max_len, tokenizer, show_progress: as in :class:`MineSettings` and
            :func:`pretune.jobs.embed.embed_texts`.
    """
    import torch

    from ..interop.st_folder import read_st_modules
    from ..io.outputs import check_file
    from ..model.layout import layout_of
    from .embed import _PROGRESS_MIN, _check_pooling, embed_texts, load_encoder

    settings.validate()
    if isinstance(corpus, (str, os.PathLike)):
        corpus = [corpus]
    out = Path(out)
    _check_out(out)
    check_file(out, overwrite=overwrite, what="output file")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: not a torch device; expected cpu, cuda, cuda:1, ... or auto") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is available here; use cpu (or auto)")
    pairs = read_pairs_for_mining(data, anchor_field=anchor_field, positive_field=positive_field,
                                  negative_field=negative_field)
    anchors, positives, existing = pairs.anchors, pairs.positives, pairs.existing
    extra = [t for path in corpus for t in read_corpus(path, field=corpus_field)]
    st = read_st_modules(model) if Path(model).is_dir() else None
    net, tok = load_encoder(model, tokenizer=tokenizer, device=device)
    if pooling is None and st is not None:
        pooling = st.pooling
    if pooling is None:  # the embedding task's default: the model's own pooling, else its family's first
        allowed = layout_of(net.config).poolings
        pooling = net.config.pooling if net.config.pooling in allowed else allowed[0]
    _check_pooling(pooling, net)
    max_len = max_len or (st.max_seq_length if st else None)

    def embed(texts: list[str]) -> np.ndarray:
        return embed_texts(net, tok, texts, pooling=pooling, normalize=True, batch_size=batch_size, max_len=max_len,
                           show_progress=show_progress and len(texts) >= _PROGRESS_MIN)

    mined = mine_negatives(anchors, positives, embed, corpus=extra, settings=settings, existing=existing,
                           show_progress=show_progress and len(set(anchors)) >= _PROGRESS_MIN)
    rows, written, dropped, short, n_neg = [], 0, 0, 0, 0
    for where, rec, had, m in zip(pairs.wheres, pairs.records, existing, mined):
        if not m.negatives:
            if not had and not keep_unmined:
                dropped += 1
                continue
        elif len(m.negatives) < settings.num_negatives:
            short += 1
        n_neg += len(m.negatives)
        row = dict(rec)
        if had or m.negatives:
            row[negative_field] = [*had, *m.negatives]
        rows.append((where, row))
        written += 1
    _write_records(out, rows)
    neg_scores = [s for m in mined for s in m.scores]
    no_candidate = sum(not m.negatives for m in mined)
    notes = []
    if any(existing):
        notes.append(f"{sum(bool(e) for e in existing):,} records already had negatives: kept, the mined ones after")
    return MineReport(out=out, records=len(pairs.records), anchors=len(set(anchors)),
                      corpus=len(dict.fromkeys([*positives, *extra])), written=written, no_candidate=no_candidate,
                      dropped=dropped, short=short, negatives=n_neg,
                      mean_positive=float(np.mean([m.positive_score for m in mined])),
                      mean_negative=float(np.mean(neg_scores)) if neg_scores else None,
                      how=f"{pooling} pooling, cosine" + (f", max {max_len} tokens" if max_len else ""), notes=notes)
