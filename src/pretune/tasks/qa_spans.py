"""Extractive question answering (SQuAD 1.1 / 2.0): features for a span head and decoding its logits.

Pure functions on numpy arrays (torch tensors are accepted where logits go in):

* :func:`find_answer`: check that a gold answer really is in its context and return its character span.
* :func:`qa_features`: one feature (model input + labels) per sliding window over a long context.
* :func:`best_span` / :func:`top_spans`: the best legal (start, end) token spans of one window's logits.
* :func:`decode_answer`: the answer text of one example from the logits of all its windows, or ``""``
  when the "no answer" score wins (SQuAD 2.0).

Layout of a window (``layout="bert"``, the default)::

    [CLS] question [SEP] context_window [SEP]
      0   0 ... 0    0   1 ........ 1    1     token_type_ids

``layout="roberta"`` is ``<s> question </s></s> context_window </s>`` with every token type 0 (RoBERTa's
type vocabulary has one entry). Position 0 is always the "null" token that stands for "no answer": the
tokenizer's cls token (which falls back to bos), else its pad token; the separator is sep (falls back to
eos). A tokenizer with neither cls/bos nor pad, or with neither sep nor eos, is refused.

Stride (as Hugging Face's ``doc_stride`` / ``tokenizers`` ``stride``): ``stride`` is the number of
*context tokens* that two consecutive windows share. With ``room`` context tokens per window, window ``k``
covers context tokens ``[k * (room - stride), k * (room - stride) + room)``, the last window is cut at the
end of the context (it may be shorter, and still overlaps its predecessor by exactly ``stride`` tokens),
and windows stop at the first one that reaches the end of the context.

Null convention (SQuAD 2.0, as Hugging Face's ``run_qa`` post-processing and Google's BERT ``run_squad``):
the null score of an example is the *minimum* over its windows of ``start_logits[0] + end_logits[0]``; the
best span score is the maximum over windows of ``start_logits[s] + end_logits[e]`` over legal spans; the
prediction is ``""`` iff ``null_score > best_span_score + null_threshold`` (a tie keeps the span).
``null_threshold=float("inf")`` never predicts ``""`` (SQuAD 1.1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ..config import ConfigError
from ..data.readers import DataError
from ..io.tokenization import Tokenizer

__all__ = ["LAYOUTS", "best_span", "decode_answer", "find_answer", "qa_features", "top_spans"]

Layout = Literal["bert", "roberta"]
LAYOUTS: tuple[str, ...] = ("bert", "roberta")
Span = tuple[int, int]


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# --------------------------------------------------------------------------------------------------
# Gold answers
# --------------------------------------------------------------------------------------------------

def find_answer(context: str, answer_text: str, answer_start: int | None = None, where: str = "") -> Span:
    """Character span ``(start, end)`` (end exclusive) of a gold answer in its context, checked.

    Args:
        context: the passage.
        answer_text: the answer, exactly as it appears in the context (non-empty).
        answer_start: the character index of the answer in the context (SQuAD's ``answer_start``); when
            given, ``context[answer_start:answer_start + len(answer_text)]`` must equal the answer. When
            None, the first occurrence of the answer is used.
        where: the row, for messages (e.g. ``"train.jsonl:12"``).

    Returns:
        ``(start, start + len(answer_text))``, so ``context[start:end] == answer_text``.

    Raises:
        DataError: an empty answer, an answer that does not occur in the context, or an ``answer_start``
            where the context does not read the answer (the message says where it does occur, if anywhere).
    """
    if not isinstance(context, str) or not isinstance(answer_text, str):
        raise DataError(f"{_at(where)}context and answer must be strings, got {type(context).__name__} and "
                        f"{type(answer_text).__name__}")
    if not answer_text:
        raise DataError(f"{_at(where)}the answer is empty; an unanswerable question has no answers at all")
    if answer_start is None:
        start = context.find(answer_text)
        if start < 0:
            raise DataError(f"{_at(where)}answer {_short(answer_text)} does not occur in its context")
        return start, start + len(answer_text)
    if isinstance(answer_start, bool) or not isinstance(answer_start, (int, np.integer)):
        raise DataError(f"{_at(where)}answer_start must be an integer, got {answer_start!r}")
    start = int(answer_start)
    end = start + len(answer_text)
    if 0 <= start and end <= len(context) and context[start:end] == answer_text:
        return start, end
    found, i = [], context.find(answer_text)
    while i >= 0 and len(found) < 5:
        found.append(i)
        i = context.find(answer_text, i + 1)
    if 0 <= start < len(context):
        there = f"the context there reads {_short(context[start:end])}"
    else:
        there = f"the context has only {len(context)} characters"
    elsewhere = (f"it occurs at character {', '.join(map(str, found))}" + (" and later" if i >= 0 else "")
                 if found else "it does not occur in its context at all")
    raise DataError(f"{_at(where)}answer {_short(answer_text)} is not at answer_start={start} ({there}); "
                    f"{elsewhere}")


# --------------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------------

def _special_ids(tok: Tokenizer) -> tuple[int, int]:
    null = tok.cls_id if tok.cls_id is not None else tok.pad_id
    if null is None:
        raise ConfigError("extractive QA needs a token for position 0 ('no answer'): the tokenizer has no cls, "
                         "bos or pad token")
    if tok.sep_id is None:
        raise ConfigError("extractive QA needs a separator between question and context: the tokenizer has no "
                         "sep or eos token")
    return null, tok.sep_id


def _trimmed(context: str, offsets: Sequence[Span]) -> list[Span | None]:
    """Token offsets with surrounding whitespace removed; None for a token that covers only whitespace.

    Byte-level BPE tokens carry their leading space (``"Ġword"`` covers ``" word"``) and SentencePiece
    emits lone ``"▁"`` tokens: trimming makes every decoded span start and end on a visible character.
    """
    out: list[Span | None] = []
    for a, b in offsets:
        while a < b and context[a].isspace():
            a += 1
        while b > a and context[b - 1].isspace():
            b -= 1
        out.append((a, b) if a < b else None)
    return out


def _budget(max_len: int, stride: int, n_special: int, max_question_len: int | None) -> int:
    """Question tokens kept at most; raises ValueError when max_len/stride cannot give windows that advance."""
    for name, value in (("max_len", max_len), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if stride < 0:
        raise ConfigError(f"stride must be >= 0 (context tokens shared by consecutive windows), got {stride}")
    if max_len < n_special + 2:
        raise ConfigError(f"max_len={max_len} is too small: a window holds {n_special} special tokens, at least "
                         f"one question token and one context token, so max_len must be >= {n_special + 2}")
    avail = max_len - n_special
    if max_question_len is None:
        max_q = avail // 2
    else:
        if isinstance(max_question_len, bool) or not isinstance(max_question_len, (int, np.integer)) \
                or max_question_len < 1:
            raise ConfigError(f"max_question_len must be a positive integer or None, got {max_question_len!r}")
        max_q = int(max_question_len)
    min_room = avail - max_q
    if min_room <= stride:
        raise ConfigError(
            f"max_len={max_len} is too small for stride={stride}: after {n_special} special tokens and up to {max_q} "
            f"question tokens a window holds only {min_room} context tokens, and it must hold more than stride "
            f"(the tokens shared with the next window) to advance; raise max_len, lower stride"
            + (" or lower max_question_len" if max_question_len is not None else ""))
    return max_q


def _windows(n: int, room: int, stride: int) -> list[Span]:
    """Context-token ranges ``[a, b)`` of the windows (see the module docstring for the stride rule)."""
    step = room - stride
    out, a = [], 0
    while True:
        b = min(a + room, n)
        out.append((a, b))
        if b >= n:
            return out
        a += step


def qa_features(tok: Tokenizer, question: str, context: str, answer_spans: Sequence[Span], *, max_len: int,
                stride: int, where: str = "", layout: Layout = "bert", max_question_len: int | None = None,
                pad_to_max_len: bool = False) -> list[dict[str, Any]]:
    """Model inputs and span labels of one QA example, one feature per sliding window over its context.

    Windows run over the context *tokens*; consecutive windows share exactly ``stride`` context tokens (Hugging
    Face ``doc_stride`` semantics: window ``k`` starts at context token ``k * (room - stride)``, where ``room``
    is the number of context tokens a window holds; the last window is cut at the end of the context). Every
    context token is in at least one window.

    Question truncation: the question keeps at most ``max_question_len`` tokens (its first ones); by default
    ``(max_len - n_special) // 2``, so the context always gets at least half of the non-special positions.
    ``room = max_len - n_special - len(kept question tokens)``. ``n_special`` is 3 for ``"bert"``
    (``[CLS] q [SEP] c [SEP]``) and 4 for ``"roberta"`` (``<s> q </s></s> c </s>``).

    Labels: the first gold span (``answer_spans[0]``) is mapped to the first and last context tokens that
    overlap it (a span that starts or ends inside a token widens to whole tokens). A window that holds both
    of them labels their positions in ``input_ids``; any other window, and every window of an unanswerable
    example (``answer_spans == []``), labels ``start_positions = end_positions = 0`` (the null token).

    Args:
        tok: a pretune Tokenizer (offsets come from ``tok.tk``).
        question: the question text.
        context: the passage.
        answer_spans: gold ``(char_start, char_end)`` spans (end exclusive; see :func:`find_answer`); the first
            is the training label; an empty list means unanswerable.
        max_len: the most tokens of a feature, special tokens included.
        stride: context tokens shared by consecutive windows (0 <= stride < context tokens per window).
        where: the row, for DataError messages (e.g. ``"train.jsonl:12"``).
        layout: ``"bert"`` (token types 0 for ``[CLS] q [SEP]``, 1 for ``c [SEP]``) or ``"roberta"`` (all 0).
        max_question_len: question tokens kept at most; None for ``(max_len - n_special) // 2``.
        pad_to_max_len: pad every feature to ``max_len`` (pad id, attention 0, token type 0, offset None).

    Returns:
        A list of dicts, one per window, in context order, with ``input_ids``, ``token_type_ids``,
        ``attention_mask`` (1-d np.int64 arrays of one length <= max_len), ``start_positions``,
        ``end_positions`` (ints), ``offsets`` (a list as long as ``input_ids``: the ``(char_start, char_end)``
        of each context token, whitespace trimmed; None for question, special and padding tokens, and for
        context tokens that cover only whitespace: None marks positions that cannot start or end an answer),
        ``window`` (0, 1, ...) and ``context_tokens`` (the window's ``[first, end)`` range of context-token
        indices).

    Raises:
        DataError: an empty question or context, or a gold span outside the context or covering no token.
        ValueError: a bad layout, a tokenizer without the special tokens needed, or a ``max_len`` too small
            for ``stride`` and the question budget (checked before the data, so it never depends on a row).
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    null_id, sep_id = _special_ids(tok)
    seps = [sep_id] if layout == "bert" else [sep_id, sep_id]
    n_special = 2 + len(seps)
    max_q = _budget(max_len, stride, n_special, max_question_len)
    if pad_to_max_len and tok.pad_id is None:
        raise ConfigError("pad_to_max_len=True needs a pad token, and the tokenizer has none")
    if not isinstance(question, str) or not isinstance(context, str):
        raise DataError(f"{_at(where)}question and context must be strings, got {type(question).__name__} and "
                        f"{type(context).__name__}")

    q_ids = tok.tk.encode(question, add_special_tokens=False).ids
    if not q_ids:
        raise DataError(f"{_at(where)}the question {_short(question)} is empty (it has no tokens)")
    enc = tok.tk.encode(context, add_special_tokens=False)
    c_ids, c_offsets = enc.ids, _trimmed(context, enc.offsets)
    if not c_ids:
        raise DataError(f"{_at(where)}the context {_short(context)} is empty (it has no tokens)")
    q_ids = q_ids[:max_q]

    gold: Span | None = None
    for k, span in enumerate(answer_spans):
        try:
            cs, ce = (int(x) for x in span)
        except (TypeError, ValueError):
            raise DataError(f"{_at(where)}answer span {k} is {span!r}; expected (char_start, char_end)") from None
        if not 0 <= cs < ce <= len(context):
            raise DataError(f"{_at(where)}answer span {k} ({cs}, {ce}) is not a non-empty span of the context "
                            f"({len(context)} characters)")
        if k == 0:
            hit = [i for i, o in enumerate(c_offsets) if o is not None and o[1] > cs and o[0] < ce]
            if not hit:
                raise DataError(f"{_at(where)}answer {_short(context[cs:ce])} at ({cs}, {ce}) covers no context "
                                f"token (only whitespace?)")
            gold = (hit[0], hit[-1])

    prefix = [null_id, *q_ids, *seps]
    room = max_len - n_special - len(q_ids)
    features = []
    for w, (a, b) in enumerate(_windows(len(c_ids), room, stride)):
        ids = prefix + c_ids[a:b] + [sep_id]
        if layout == "bert":
            types = [0] * len(prefix) + [1] * (b - a + 1)
        else:
            types = [0] * len(ids)
        offsets: list[Span | None] = [None] * len(prefix) + c_offsets[a:b] + [None]
        start = end = 0
        if gold is not None and a <= gold[0] and gold[1] < b:
            start, end = len(prefix) + gold[0] - a, len(prefix) + gold[1] - a
        mask = [1] * len(ids)
        if pad_to_max_len and len(ids) < max_len:
            extra = max_len - len(ids)
            ids, types, mask = ids + [tok.pad_id] * extra, types + [0] * extra, mask + [0] * extra
            offsets = offsets + [None] * extra
        features.append({
            "input_ids": np.asarray(ids, dtype=np.int64),
            "token_type_ids": np.asarray(types, dtype=np.int64),
            "attention_mask": np.asarray(mask, dtype=np.int64),
            "start_positions": int(start),
            "end_positions": int(end),
            "offsets": offsets,
            "window": w,
            "context_tokens": (a, b),
        })
    return features


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------

def _vector(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, maybe on an accelerator or in bf16
        x = x.detach().float().cpu().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be 1-d (one window's logits), got shape {arr.shape}")
    if np.isnan(arr).any():
        raise ConfigError(f"{name} holds NaN")
    return arr


def _span_scores(start_logits: Any, end_logits: Any, offsets: Sequence[Span | None],
                 max_answer_len: int) -> np.ndarray | None:
    """(n, m) band ``scores[s, j] = start[s] + end[s + j]`` over legal spans, -inf elsewhere; None if none."""
    if isinstance(max_answer_len, bool) or not isinstance(max_answer_len, (int, np.integer)) or max_answer_len < 1:
        raise ConfigError(f"max_answer_len must be a positive integer, got {max_answer_len!r}")
    start, end = _vector(start_logits, "start_logits"), _vector(end_logits, "end_logits")
    n = len(offsets)
    if len(start) < n or len(end) < n:
        raise ConfigError(f"logits of lengths {len(start)} (start) and {len(end)} (end) are shorter than the "
                         f"window's {n} positions")
    legal = np.fromiter((o is not None for o in offsets), dtype=bool, count=n)
    if not legal.any():
        return None
    s_all = np.where(legal, start[:n], -np.inf)
    e_all = np.where(legal, end[:n], -np.inf)
    m = min(int(max_answer_len), n)
    e_pad = np.concatenate([e_all, np.full(m - 1, -np.inf)])
    band = np.lib.stride_tricks.sliding_window_view(e_pad, m)  # band[s, j] = end[s + j]
    return s_all[:, None] + band


def top_spans(start_logits: Any, end_logits: Any, offsets: Sequence[Span | None], *, max_answer_len: int,
              top_k: int = 20) -> list[tuple[int, int, float]]:
    """The ``top_k`` best legal spans of one window, best first (exact, not a top-k-per-side heuristic).

    A legal span ``(s, e)`` has ``offsets[s]`` and ``offsets[e]`` not None (context tokens), ``s <= e`` and
    ``e - s + 1 <= max_answer_len``; its score is ``start_logits[s] + end_logits[e]``. All legal spans are
    scored at once on the ``(positions, max_answer_len)`` band, O(n * max_answer_len). Equal scores come in
    (s, e) order. Logits longer than ``offsets`` (batch padding) are cut to its length.

    Returns:
        Up to ``top_k`` ``(s, e, score)`` (fewer if there are fewer legal spans).
    """
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    scores = _span_scores(start_logits, end_logits, offsets, max_answer_len)
    if scores is None:
        return []
    flat = scores.ravel()
    finite = np.flatnonzero(np.isfinite(flat))
    if len(finite) > top_k:
        keep = np.argpartition(-flat[finite], top_k - 1)[:top_k]
        finite = finite[keep]
    order = finite[np.lexsort((finite, -flat[finite]))]
    m = scores.shape[1]
    return [(int(i // m), int(i // m + i % m), float(flat[i])) for i in order]


def best_span(start_logits: Any, end_logits: Any, offsets: Sequence[Span | None], *,
              max_answer_len: int) -> tuple[int, int, float] | None:
    """The best legal span ``(s, e, score)`` of one window, or None if the window has no context token.

    Exact: the maximum of ``start_logits[s] + end_logits[e]`` over ``s <= e``, ``e - s + 1 <= max_answer_len``,
    ``offsets[s]`` and ``offsets[e]`` not None (see :func:`top_spans`); the first such span in (s, e) order on
    ties. Never returns ``e < s``.
    """
    scores = _span_scores(start_logits, end_logits, offsets, max_answer_len)
    if scores is None:
        return None
    i = int(np.argmax(scores))  # first maximum in row-major = (s, e) order
    m = scores.shape[1]
    score = float(scores.flat[i])
    if not math.isfinite(score):
        return None
    return i // m, i // m + i % m, score


def decode_answer(features: Sequence[dict[str, Any]], start_logits_per_feature: Sequence[Any],
                  end_logits_per_feature: Sequence[Any], context: str, *, max_answer_len: int,
                  null_threshold: float = 0.0) -> tuple[str, float]:
    """The predicted answer of one example from the logits of all its windows.

    The best span is the best legal span over all windows (:func:`best_span`); the null score is the
    *minimum* over windows of ``start_logits[0] + end_logits[0]`` (Hugging Face ``run_qa``). The answer is
    ``""`` iff ``null_score > best_span_score + null_threshold`` (a tie keeps the span); raise
    ``null_threshold`` to answer more often, ``float("inf")`` never answers ``""`` (SQuAD 1.1). With no legal
    span at all the answer is ``""``.

    Args:
        features: the example's features from :func:`qa_features` (their ``offsets`` are used).
        start_logits_per_feature, end_logits_per_feature: one 1-d array (or tensor) per feature, at least as long
            as its ``offsets``.
        context: the passage the features were built from.
        max_answer_len: the longest answer, in tokens.
        null_threshold: see above.

    Returns:
        ``(answer_text, score)``: ``context[offsets[s][0]:offsets[e][1]]`` and the span's score, or
        ``("", null_score)``.
    """
    if not (len(features) == len(start_logits_per_feature) == len(end_logits_per_feature)):
        raise ConfigError(f"{len(features)} features but {len(start_logits_per_feature)} start and "
                         f"{len(end_logits_per_feature)} end logit rows; expected one row per feature")
    if not features:
        raise ConfigError("decode_answer needs at least one feature")
    null_score = math.inf
    best: tuple[float, int, int, int] | None = None  # score, feature, s, e
    for k, (feat, start, end) in enumerate(zip(features, start_logits_per_feature, end_logits_per_feature)):
        start, end = _vector(start, "start_logits"), _vector(end, "end_logits")
        null_score = min(null_score, float(start[0] + end[0]))
        found = best_span(start, end, feat["offsets"], max_answer_len=max_answer_len)
        if found is not None and (best is None or found[2] > best[0]):
            best = (found[2], k, found[0], found[1])
    if best is None or null_score > best[0] + null_threshold:
        return "", null_score
    score, k, s, e = best
    offsets = features[k]["offsets"]
    return context[offsets[s][0]:offsets[e][1]], score
