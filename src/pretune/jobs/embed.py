"""Contextual sentence embeddings: one vector per text from a pretrained model, and cosine similarity.

A text goes through the whole transformer, so each token's hidden state depends on its context
("bank" in "river bank" and in "bank account" get different vectors); pooling the token states
gives one sentence vector, and the cosine of two such vectors measures how close their meanings are
(Reimers & Gurevych 2019, Sentence-BERT)::

    model, tok = load_encoder(minilm_dir())                 # an HF folder or a pretune checkpoint folder
    emb = embed_texts(model, tok, ["A man plays a guitar.", "Someone plays the guitar."], normalize=True)
    cosine_matrix(emb)                                       # (2, 2)

Pooling: ``"mean"`` averages the real tokens' states (the attention mask weights, as sentence-transformers
does; what all-MiniLM-L6-v2 was trained with), ``"cls"`` takes the first token's state (encoders: BERT's
[CLS]), ``"last"`` the last real token's (decoders: the only token that has seen the whole text).
Encoder-decoders (T5) are embedded with their encoder. The CLI is ``pretune embed``.
"""

from __future__ import annotations

import gzip
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..data.readers import DataError, iter_records
from ..io.tokenization import Tokenizer, TokenizerError

__all__ = ["POOLINGS", "load_encoder", "embed_texts", "special_tokens", "cosine_matrix", "pairwise_cosine",
           "rank_pairs", "rank_all_pairs", "read_texts", "read_pairs"]

POOLINGS = ("mean", "cls", "last")  # every pooling; which apply to a model: its layout's ``poolings`` (first:
# the default; decoders have no "cls": their first token has seen only itself; encoder-decoders pool the encoder)
_PROBE = "hello world"  # to find the tokens a tokenizer's post-processor puts around a text
_PROGRESS_MIN = 512  # the CLI shows a progress bar from this many texts on
_MAX_ALL_PAIRS = 2_000_000  # --similarity on a list: more pairs than this need --top (all would be O(N^2))


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

def load_encoder(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None,
                 device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Tokenizer]:
    """A pretrained model and its tokenizer, ready to embed text.

    Args:
        path: a pretune checkpoint folder (config.json + model.safetensors + tokenizer.json) or a Hugging
            Face folder (its config.json names a ``model_type``: BERT, RoBERTa, GPT-2, T5, Llama).
        tokenizer: a tokenizer.json (or folder holding one) to use instead of the one in ``path``.
        device: where the model goes.

    Returns:
        ``(model, tokenizer)``: the TransformerLM in eval mode and the :class:`~pretune.io.tokenization.Tokenizer`.

    Raises:
        ConfigError / CheckpointError / InteropError: the folder cannot be loaded (named);
        TokenizerError: no tokenizer.json in the folder (and no ``tokenizer`` given).
    """
    from ..loading import load_pretrained

    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{path}: not a folder; expected a pretune checkpoint or a Hugging Face model folder")
    loaded = load_pretrained(path, tokenizer=tokenizer, need_tokenizer=False, device=device)
    if loaded.tokenizer is None:
        raise TokenizerError(f"{path} holds no tokenizer.json; give the model's tokenizer explicitly "
                             f"(tokenizer=... / --tokenizer FILE)")
    return loaded.model, loaded.tokenizer


# --------------------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------------------

def special_tokens(tok: Tokenizer, model_or_layout) -> tuple[list[int], list[int]]:
    """(prefix, suffix) token ids put around every text for a model (or its :class:`~pretune.model.layout.Layout`).

    Encoders: ``[cls] text [sep]`` when the tokenizer has both roles (BERT [CLS]/[SEP]; RoBERTa
    <s>/</s> through the cls <- bos and sep <- eos fallbacks). Otherwise (decoders, encoder-decoders,
    encoder tokenizers without those roles) what the tokenizer's own post-processor adds to a single
    text, as ``transformers`` does: nothing for GPT-2, ``<s>`` for Llama, ``</s>`` after T5 text.
    """
    layout = _layout(model_or_layout)
    if layout.pair_style == "bert" and tok.cls_id is not None and tok.sep_id is not None:  # [CLS]-style encoders
        return [tok.cls_id], [tok.sep_id]
    plain = tok.tk.encode(_PROBE, add_special_tokens=False).ids
    full = tok.tk.encode(_PROBE, add_special_tokens=True).ids
    n = len(plain)
    for start in range(len(full) - n + 1):
        if full[start:start + n] == plain:
            return full[:start], full[start + n:]
    return [], []  # a post-processor that rewrites the text itself: add nothing


def _layout(model_or_layout):
    from ..model.layout import Layout, layout_of

    if isinstance(model_or_layout, Layout):
        return model_or_layout
    return layout_of(model_or_layout.config)


def _check_pooling(pooling: str, model) -> None:
    layout = _layout(model)
    allowed = layout.poolings
    if pooling in allowed:
        return
    family = model.config.arch
    if pooling not in POOLINGS:
        raise ConfigError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)} "
                          f"({family} models: {', '.join(allowed)})")
    raise ConfigError(f"pooling {pooling!r} does not apply to {family} models; use one of {', '.join(allowed)}")


def _max_tokens(model) -> int:
    """Longest input the model's positions allow (RoBERTa's learned table starts at position_offset)."""
    cfg = model.config
    offset = cfg.position_offset if cfg.position == "learned" else 0
    return cfg.max_seq_len - offset


def _hidden(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, dim) last hidden states of the stack that reads the text, without running the LM head."""
    if getattr(model, "transformer", None) is None:  # not a TransformerLM: anything returning .last_hidden_state
        return model(ids, attention_mask=mask).last_hidden_state
    return _layout(model).packed_hidden_states(model, ids, mask)  # encoders (T5's encoder), or the decoder


def embed_texts(model, tok: Tokenizer, texts: Sequence[str], *, pooling: str = "mean", normalize: bool = False,
                batch_size: int = 32, max_len: int | None = None, show_progress: bool = False,
                streams: int = 1) -> np.ndarray:
    """One vector per text: the pooled last hidden states of ``model``.

    Texts are tokenized with the model family's special tokens (see :func:`special_tokens`), truncated to
    ``max_len`` tokens (the special tokens kept), sorted by length into batches (little padding), right
    padded with an attention mask, run under ``torch.no_grad`` in eval mode, and returned in input order.

    Args:
        model: a TransformerLM (see :func:`load_encoder`); the LM head is not run.
        tok: its tokenizer.
        texts: the strings to embed.
        pooling: ``"mean"`` (mean over real tokens, weighted by the attention mask, as sentence-transformers),
            ``"cls"`` (first token; encoders and encoder-decoders) or ``"last"`` (last real token; decoders).
        normalize: scale each vector to unit length (then dot product = cosine).
        batch_size: texts per forward pass.
        max_len: most tokens per text, special tokens included (default: what the model's positions allow).
        show_progress: a progress bar (stderr; `pretune.io.progress`).
        streams: on a CPU, batches embedded at once, each on one thread (torch's thread count is set to 1 while they
            run, then put back; the batch of the shortest texts runs first, alone on every thread): two batches on
            one thread each outrun one batch on two threads (MiniLM, 2 cores: ~16 % more texts/s), as a batch's
            small matrix products share two threads poorly. It sets torch's thread count for the whole process, so
            only a process doing nothing else asks for it (``pretune embed``: one per thread); 1 (the default): one
            batch after the other on every thread.

    Returns:
        ``(len(texts), dim)`` float32 array.

    Raises:
        ConfigError: a pooling the model family has no use for, a bad batch_size/max_len, a token id
            outside the model's vocabulary (a tokenizer that does not belong to the model).
        DataError: a text with no tokens at all (empty, with a tokenizer that adds no special tokens).
    """
    cfg = model.config
    _check_pooling(pooling, model)
    if isinstance(texts, str):
        raise TypeError("embed_texts expects a list of strings, not one string")
    texts = list(texts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"texts[{bad}] is {type(texts[bad]).__name__}; expected str")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if streams < 1:
        raise ConfigError(f"streams must be >= 1, got {streams}")
    prefix, suffix = special_tokens(tok, model)
    limit = _max_tokens(model)
    max_len = limit if max_len is None else max_len
    if max_len > limit:
        raise ConfigError(f"max_len {max_len} is longer than the model's {limit} positions")
    if max_len < len(prefix) + len(suffix) + 1:
        raise ConfigError(f"max_len must leave room for a token besides the {len(prefix) + len(suffix)} special "
                          f"ones, got {max_len}")
    dim = cfg.dim
    out = np.zeros((len(texts), dim), dtype=np.float32)
    if not texts:
        return out

    room = max_len - len(prefix) - len(suffix)
    seqs = [prefix + ids[:room] + suffix for ids in tok.encode_batch(texts)]
    empty = next((i for i, s in enumerate(seqs) if not s), None)
    if empty is not None:
        raise DataError(f"text {empty} ({texts[empty]!r}) has no tokens, and the tokenizer adds no special "
                        f"tokens; remove empty texts")
    top = max(max(s) for s in seqs)
    if top >= cfg.vocab_size:
        raise ConfigError(f"the tokenizer produced id {top}, but the model's vocabulary has {cfg.vocab_size} "
                          f"ids: is it the model's own tokenizer?")
    lengths = np.array([len(s) for s in seqs])
    order = np.argsort(-lengths, kind="stable")  # longest first: an out-of-memory shows up at once
    pad = tok.pad_id if tok.pad_id is not None else 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bar = None
    if show_progress:
        from ..io.progress import progress

        bar = progress(total=len(texts), unit="text", desc="embedding", dynamic_ncols=True)

    def embed_batch(rows: np.ndarray) -> np.ndarray:
        width = int(lengths[rows].max())
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, k in enumerate(rows):
            ids[r, :lengths[k]] = torch.tensor(seqs[k])
            mask[r, :lengths[k]] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():  # (grad mode is per thread: each stream sets it)
            h = _hidden(model, ids, mask).float()  # (B, T, dim)
            if pooling == "cls":
                pooled = h[:, 0]
            elif pooling == "last":
                pooled = h[torch.arange(len(rows), device=device), mask.sum(1) - 1]
            else:
                m = mask.unsqueeze(-1).to(h.dtype)
                pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().numpy()

    batches = [order[start:start + batch_size] for start in range(0, len(texts), batch_size)]
    threads = torch.get_num_threads()
    streams = min(streams, len(batches) - 1) if device.type == "cpu" else 1

    def collect(batches_, vectors) -> None:
        for rows, v in zip(batches_, vectors):
            out[rows] = v
            if bar is not None:
                bar.update(len(rows))

    try:
        # the last batch (the shortest texts) alone, on every thread: what the model builds on its first call
        # (stacked weights) is built once, before several threads read it
        collect(batches[-1:], map(embed_batch, batches[-1:]))
        if streams > 1:
            from concurrent.futures import ThreadPoolExecutor

            torch.set_num_threads(1)
            with ThreadPoolExecutor(streams, thread_name_prefix="pretune-embed") as pool:
                collect(batches[:-1], pool.map(embed_batch, batches[:-1]))
        else:
            collect(batches[:-1], map(embed_batch, batches[:-1]))
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
        model.train(was_training)
    return out


# --------------------------------------------------------------------------------------------------
# Similarity
# --------------------------------------------------------------------------------------------------

def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a (N, dim) matrix of embeddings, got shape {x.shape}")
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def cosine_matrix(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``(N, M)`` cosine similarities of the rows of ``a`` (N, dim) and ``b`` (M, dim; default ``a``)."""
    ua = _unit(a)
    return ua @ (ua if b is None else _unit(b)).T


def pairwise_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(N,)`` cosine of each aligned pair of rows ``a[k]``, ``b[k]``."""
    ua, ub = _unit(a), _unit(b)
    if ua.shape != ub.shape:
        raise ValueError(f"pairs need matrices of the same shape, got {ua.shape} and {ub.shape}")
    return np.einsum("nd,nd->n", ua, ub)


def rank_pairs(emb_a: np.ndarray, emb_b: np.ndarray) -> list[tuple[int, float]]:
    """Aligned pairs ``(emb_a[k], emb_b[k])`` ranked by cosine, highest first: ``[(k, cosine), ...]``
    (ties keep input order)."""
    sims = pairwise_cosine(emb_a, emb_b)
    order = np.argsort(-sims, kind="stable")
    return [(int(k), float(sims[k])) for k in order]


def rank_all_pairs(emb: np.ndarray, *, top: int | None = None, chunk: int = 1024) -> list[tuple[int, int, float]]:
    """Every pair ``i < j`` of the rows of ``emb`` ranked by cosine, highest first: ``[(i, j, cosine), ...]``.

    With ``top`` only the best ``top`` pairs are kept, computed in row chunks, so memory stays
    ``O(chunk * N + top)`` however many pairs there are (all of them take ``O(N^2)``).
    """
    u = _unit(emb)
    n = len(u)
    keep_i, keep_j, keep_s = [], [], []
    for lo in range(0, n, chunk):
        sims = u[lo:lo + chunk] @ u.T  # (c, N)
        i, j = np.nonzero(np.arange(n)[None, :] > np.arange(lo, lo + len(sims))[:, None])  # upper triangle
        s = sims[i, j]
        i = i + lo
        if top is not None and len(s) > top:
            best = np.argpartition(-s, top - 1)[:top]
            i, j, s = i[best], j[best], s[best]
        keep_i.append(i)
        keep_j.append(j)
        keep_s.append(s)
    if not keep_s:
        return []
    i, j, s = np.concatenate(keep_i), np.concatenate(keep_j), np.concatenate(keep_s)
    order = np.lexsort((j, i, -s))  # highest cosine first; ties by (i, j)
    if top is not None:
        order = order[:top]
    return [(int(i[k]), int(j[k]), float(s[k])) for k in order]


# --------------------------------------------------------------------------------------------------
# Reading inputs
# --------------------------------------------------------------------------------------------------

def _is_plain(path: Path) -> bool:
    return path.name.lower().removesuffix(".gz").endswith((".txt", ".text"))


def _plain_lines(path: Path):
    """(1-based line number, line without its line ending) of a UTF-8 text file (.gz too); blank lines skipped."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as fh:
            for lineno, line in enumerate(fh, start=1):
                line = line.rstrip("\r\n")
                if lineno == 1:
                    line = line.removeprefix("\ufeff")
                if line.strip():
                    yield lineno, line
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno + 1}: not valid UTF-8 ({e.reason}); expected UTF-8 text") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read it ({e})") from None


def _field(path: Path, num: int, record: dict, field: str) -> str:
    from ..data.readers import record_text, record_where

    return record_text(record, field, record_where(path, num), hint="--field")


def _check_input(path: Path) -> None:
    if not path.is_file():
        raise DataError(f"{path}: no such file")


def read_texts(path: str | os.PathLike, *, field: str = "text") -> list[str]:
    """Texts of a .txt file (one per line, blank lines skipped) or of a .jsonl/.csv/.tsv/.parquet file
    (column ``field``; every record is one text). Raises DataError for an empty file or a missing field."""
    path = Path(path)
    _check_input(path)
    if _is_plain(path):
        texts = [line for _, line in _plain_lines(path)]
    else:
        texts = [_field(path, num, rec, field) for num, rec in iter_records(path)]
    if not texts:
        raise DataError(f"{path}: no texts (empty file?)")
    return texts


def read_pairs(path: str | os.PathLike, *, field: str = "text", field_a: str = "text_a",
               field_b: str = "text_b") -> tuple[list[str], list[tuple[str, str]] | None]:
    """The input of ``--similarity``: ``(texts, None)`` for a list of texts (all pairs are compared) or
    ``([], pairs)`` for explicit pairs.

    A .txt file holds pairs when its first non-blank line has a tab (then every line must be
    ``a<TAB>b``), else one text per line. A record file holds pairs when its first record has
    ``field_a`` (then every record needs ``field_a`` and ``field_b``), else texts in ``field``.
    """
    path = Path(path)
    _check_input(path)
    pairs: list[tuple[str, str]] = []
    texts: list[str] = []
    if _is_plain(path):
        lines = _plain_lines(path)
        first = next(lines, None)
        if first is None:
            raise DataError(f"{path}: no texts (empty file?)")
        if "\t" not in first[1]:
            return [line for _, line in itertools.chain([first], lines)], None
        for lineno, line in itertools.chain([first], lines):
            parts = line.split("\t")
            if len(parts) != 2:
                raise DataError(f"{path}:{lineno}: {len(parts) - 1} tabs; expected one pair per line, "
                                f"'text a<TAB>text b' (the first line is a pair)")
            pairs.append((parts[0], parts[1]))
        return [], pairs
    records = iter_records(path)
    first_num, first = next(records)
    paired = field_a in first
    if not paired and field not in first:
        where = f"{path}:{first_num}" if not path.name.lower().endswith(".parquet") else f"{path}: row {first_num}"
        raise DataError(f"{where}: record has neither {field_a!r} (pairs, with {field_b!r}) nor {field!r} (a list "
                        f"of texts); it has fields {sorted(first)} (pick them with --field-a/--field-b or --field)")
    for num, rec in itertools.chain([(first_num, first)], records):
        if paired:
            pairs.append((_field(path, num, rec, field_a), _field(path, num, rec, field_b)))
        else:
            texts.append(_field(path, num, rec, field))
    return (texts, None) if not paired else ([], pairs)


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------
