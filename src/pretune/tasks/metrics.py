"""Evaluation metrics for finetuning, computed with well-kept libraries (scikit-learn, scipy, seqeval,
sacrebleu, rouge-score); only the SQuAD scorer is written out here, following the official script.

Conventions:

* every function takes ``(preds, refs)`` -- predictions first, references second -- and raises ``ValueError``
  on empty input or when the two differ in length (also per sentence for tag sequences);
* scores keep the scale their reference implementation reports: SQuAD exact match / F1, ROUGE-L and BLEU
  are in [0, 100]; accuracy, F1, entity F1/precision/recall and tag accuracy are in [0, 1]; Matthews
  correlation, Pearson and Spearman are in [-1, 1]; MSE and perplexity are unbounded and lower is better
  (see ``HIGHER_IS_BETTER``);
* a metric that yields several numbers (``squad``, ``entity_f1``) returns a dict; ``compute`` flattens it
  into its result under the dict's own keys.

::

    compute(["accuracy", "macro_f1"], preds=["pos", "neg"], refs=["pos", "pos"])
    # {'accuracy': 0.5, 'macro_f1': 0.333...}
    compute(["exact_match", "f1"], preds=["Eiffel"], refs=[["Eiffel Tower"]])   # a task's metrics: Task.metrics
    # {'exact_match': 0.0, 'f1': 66.66...}

Note the registry name ``"f1"`` is SQuAD's token F1 (as in the SQuAD reports); classification F1 is
registered as ``"macro_f1"`` / ``"micro_f1"`` and is the function ``f1``.

The libraries are imported inside the functions so that ``import pretune`` stays fast.
"""

from __future__ import annotations

import collections
import difflib
import functools
import math
import re
import string
import warnings
from collections.abc import Callable, Sequence
from typing import Any

# ----------------------------------------------------------------------------------------------- checks


def _check(preds: Sequence, refs: Sequence, name: str) -> None:
    if len(preds) != len(refs):
        raise ValueError(f"{name}: got {len(preds)} predictions but {len(refs)} references; they must match")
    if len(preds) == 0:
        raise ValueError(f"{name}: no predictions to score (empty input)")


def _check_tags(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]], name: str) -> None:
    _check(pred_tags, gold_tags, name)
    for i, (p, g) in enumerate(zip(pred_tags, gold_tags)):
        if isinstance(p, str) or isinstance(g, str):
            raise ValueError(f"{name}: expected a list of tag lists (one list per sentence), got a string at {i}")
        if len(p) != len(g):
            raise ValueError(f"{name}: sentence {i} has {len(p)} predicted tags but {len(g)} gold tags")


def _ref_list(ref: str | Sequence[str], name: str, i: int) -> list[str]:
    """One reference or a list of references -> a non-empty list of strings."""
    refs = [ref] if isinstance(ref, str) else list(ref)
    if not refs:
        raise ValueError(f"{name}: reference {i} is an empty list; give at least one reference string")
    return refs


# ------------------------------------------------------------------------------------------ classification


def accuracy(preds: Sequence, refs: Sequence) -> float:
    """Fraction of predictions equal to their reference (``sklearn.metrics.accuracy_score``), in [0, 1]."""
    _check(preds, refs, "accuracy")
    from sklearn.metrics import accuracy_score

    return float(accuracy_score(refs, preds))


def f1(preds: Sequence, refs: Sequence, average: str = "macro", pos_label: Any = None) -> float:
    """Classification F1 (``sklearn.metrics.f1_score``), in [0, 1]; labels may be ints or strings.

    ``average``: ``"macro"`` (unweighted mean over the labels seen in preds or refs), ``"micro"`` (global
    counts; equals accuracy for single-label multi-class) or ``"binary"`` (the F1 of ``pos_label``, which
    defaults to sklearn's ``1``; string labels need it). An undefined F1 (no true or predicted positives)
    counts as 0 without a warning."""
    _check(preds, refs, "f1")
    if average not in ("macro", "micro", "binary"):
        raise ValueError(f"f1: average must be 'macro', 'micro' or 'binary', got {average!r}")
    from sklearn.metrics import f1_score

    kwargs = {} if pos_label is None else {"pos_label": pos_label}
    return float(f1_score(refs, preds, average=average, zero_division=0.0, **kwargs))


def matthews(preds: Sequence, refs: Sequence) -> float:
    """Matthews correlation coefficient (``sklearn.metrics.matthews_corrcoef``), in [-1, 1]; 0 when undefined
    (e.g. a single class everywhere), without a warning."""
    _check(preds, refs, "matthews")
    from sklearn.metrics import matthews_corrcoef

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "A single label was found ..." -> sklearn returns 0.0, which we keep
        value = float(matthews_corrcoef(refs, preds))
    return 0.0 if math.isnan(value) else value


# ---------------------------------------------------------------------------------------------- regression


def _as_floats(x: Sequence, name: str):
    import numpy as np

    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.shape[0] != len(x):
        raise ValueError(f"{name}: expected one number per example, got an input of shape {np.shape(x)}")
    return arr


def _correlation(preds: Sequence, refs: Sequence, name: str, fn_name: str) -> float:
    _check(preds, refs, name)
    import numpy as np
    import scipy.stats

    p, r = _as_floats(preds, name), _as_floats(refs, name)
    # a constant input (including a single example) has no correlation: scipy warns and gives nan; we say 0.0
    if np.all(p == p[0]) or np.all(r == r[0]):
        return 0.0
    return float(getattr(scipy.stats, fn_name)(p, r)[0])


def pearson(preds: Sequence[float], refs: Sequence[float]) -> float:
    """Pearson correlation (``scipy.stats.pearsonr``), in [-1, 1]; 0.0 when either side is constant."""
    return _correlation(preds, refs, "pearson", "pearsonr")


def spearman(preds: Sequence[float], refs: Sequence[float]) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``), in [-1, 1]; 0.0 when either side is constant."""
    return _correlation(preds, refs, "spearman", "spearmanr")


def mse(preds: Sequence[float], refs: Sequence[float]) -> float:
    """Mean squared error (``sklearn.metrics.mean_squared_error``); lower is better."""
    _check(preds, refs, "mse")
    from sklearn.metrics import mean_squared_error

    return float(mean_squared_error(_as_floats(refs, "mse"), _as_floats(preds, "mse")))


# -------------------------------------------------------------------------------------------- question answering
# Answer normalisation and scoring follow the official SQuAD v2.0 evaluation script
# ("Official evaluation script for SQuAD version 2.0", evaluate-v2.0.py, linked from
# https://rajpurkar.github.io/SQuAD-explorer/): normalize_answer, get_tokens, compute_exact, compute_f1 and
# get_raw_scores; for answerable questions it scores as the v1.1 script does.


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (SQuAD ``normalize_answer``)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def _squad_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def _squad_exact(gold: str, pred: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(pred))


def _squad_f1(gold: str, pred: str) -> float:
    gold_toks, pred_toks = _squad_tokens(gold), _squad_tokens(pred)
    if not gold_toks or not pred_toks:
        # if either is no-answer, then F1 is 1 if they agree, 0 otherwise
        return float(gold_toks == pred_toks)
    num_same = sum((collections.Counter(gold_toks) & collections.Counter(pred_toks)).values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def squad(preds: Sequence[str], refs: Sequence[Sequence[str] | str]) -> dict[str, float]:
    """SQuAD v1.1 / v2.0 exact match and token F1, each the mean over questions of the max over gold answers,
    ×100: ``{"exact_match": ..., "f1": ...}``.

    ``preds``: one answer string per question, ``""`` for "no answer". ``refs``: per question a list of gold
    answer strings (a bare string counts as one); an empty list, or golds that all normalise to ``""`` (e.g.
    ``[""]``), mark an unanswerable question (SQuAD 2.0), scored 1 iff the prediction normalises to ``""``.
    """
    _check(preds, refs, "squad")
    em_total = f1_total = 0.0
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        if not isinstance(pred, str):
            raise ValueError(f"squad: prediction {i} should be a string, got {type(pred).__name__}")
        golds = [ref] if isinstance(ref, str) else list(ref)
        golds = [g for g in golds if normalize_answer(g)]
        if not golds:
            golds = [""]  # for unanswerable questions, the only correct answer is the empty string
        em_total += max(_squad_exact(g, pred) for g in golds)
        f1_total += max(_squad_f1(g, pred) for g in golds)
    n = len(preds)
    return {"exact_match": 100.0 * em_total / n, "f1": 100.0 * f1_total / n}


# ------------------------------------------------------------------------------------------------- tagging


def seqeval_scores(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level micro F1 / precision / recall over IOB-style tag sequences (``seqeval.metrics`` in its
    default, conlleval-compatible mode, as Hugging Face ``evaluate``'s seqeval), each in [0, 1]:
    ``{"entity_f1", "entity_precision", "entity_recall"}``. Undefined values count as 0."""
    _check_tags(pred_tags, gold_tags, "seqeval_scores")
    from seqeval.metrics import f1_score, precision_score, recall_score

    y_true, y_pred = [list(t) for t in gold_tags], [list(t) for t in pred_tags]
    return {
        "entity_f1": float(f1_score(y_true, y_pred, zero_division=0)),
        "entity_precision": float(precision_score(y_true, y_pred, zero_division=0)),
        "entity_recall": float(recall_score(y_true, y_pred, zero_division=0)),
    }


def tag_accuracy(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]]) -> float:
    """Token-level accuracy over all tags of all sentences (``seqeval.metrics.accuracy_score``), in [0, 1]."""
    _check_tags(pred_tags, gold_tags, "tag_accuracy")
    from seqeval.metrics import accuracy_score

    return float(accuracy_score([list(t) for t in gold_tags], [list(t) for t in pred_tags]))


# ------------------------------------------------------------------------------------------ language modelling

MAX_LOG_PERPLEXITY = 50.0  # exp(50) ~ 5e21: far past any useful perplexity, far below float overflow (~exp(709))


def perplexity(total_nll: float, n_tokens: int) -> float:
    """``exp(total_nll / n_tokens)`` -- the exponential of the mean per-token negative log-likelihood (nats),
    with the mean capped at ``MAX_LOG_PERPLEXITY`` so that a diverged model gives a large finite number."""
    n_tokens = int(n_tokens)
    if n_tokens <= 0:
        raise ValueError(f"perplexity: n_tokens must be positive, got {n_tokens}")
    mean = float(total_nll) / n_tokens
    if math.isnan(mean):
        return math.nan
    return math.exp(min(mean, MAX_LOG_PERPLEXITY))


# ------------------------------------------------------------------------------------------------ seq2seq


def exact_match_text(preds: Sequence[str], refs: Sequence[str | Sequence[str]]) -> float:
    """Fraction of generated strings equal to their reference (or to any of a list of references) after
    stripping leading/trailing whitespace, in [0, 1]."""
    _check(preds, refs, "exact_match_text")
    hits = 0
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        hits += pred.strip() in {r.strip() for r in _ref_list(ref, "exact_match_text", i)}
    return hits / len(preds)


def rouge_l(preds: Sequence[str], refs: Sequence[str | Sequence[str]], use_stemmer: bool = False) -> float:
    """Mean ROUGE-L F-measure ×100 (``rouge_score.rouge_scorer``, ``use_stemmer=False`` as Hugging Face
    ``evaluate``'s default). A list of references scores the best of them (``score_multi``). Note
    rouge-score's default tokenizer keeps only ASCII letters and digits."""
    _check(preds, refs, "rouge_l")
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
    total = 0.0
    for i, (pred, ref) in enumerate(zip(preds, refs)):
        if isinstance(ref, str):
            total += scorer.score(ref, pred)["rougeL"].fmeasure
        else:
            total += scorer.score_multi(_ref_list(ref, "rouge_l", i), pred)["rougeL"].fmeasure
    return 100.0 * total / len(preds)


def bleu(preds: Sequence[str], refs: Sequence[str | Sequence[str]]) -> float:
    """Corpus BLEU in [0, 100] (``sacrebleu.corpus_bleu`` with its defaults: 13a tokenisation, exp
    smoothing). ``refs``: one reference string per prediction, or a list of references per prediction (the
    lists may differ in length)."""
    _check(preds, refs, "bleu")
    import sacrebleu

    per_pred = [_ref_list(r, "bleu", i) for i, r in enumerate(refs)]
    n_streams = max(len(r) for r in per_pred)
    # sacrebleu wants reference *streams* (stream k = the k-th reference of every prediction); None pads
    streams = [[r[k] if k < len(r) else None for r in per_pred] for k in range(n_streams)]
    return float(sacrebleu.corpus_bleu(list(preds), streams).score)


# ---------------------------------------------------------------------------------------------- registry

METRICS: dict[str, Callable[[Sequence, Sequence], float | dict[str, float]]] = {
    "accuracy": accuracy,
    "macro_f1": functools.partial(f1, average="macro"),
    "micro_f1": functools.partial(f1, average="micro"),
    "mcc": matthews,
    "pearson": pearson,
    "spearman": spearman,
    "mse": mse,
    "entity_f1": seqeval_scores,  # -> entity_f1, entity_precision, entity_recall
    "tag_accuracy": tag_accuracy,
    "squad": squad,  # -> exact_match, f1
    "exact_match": squad,
    "f1": squad,
    "exact_match_text": exact_match_text,
    "rouge_l": rouge_l,
    "bleu": bleu,
}

# every key that ``compute`` can return (plus the LM ones), for picking the best checkpoint
HIGHER_IS_BETTER: dict[str, bool] = {
    "accuracy": True,
    "macro_f1": True,
    "micro_f1": True,
    "mcc": True,
    "pearson": True,
    "spearman": True,
    "mse": False,
    "entity_f1": True,
    "entity_precision": True,
    "entity_recall": True,
    "tag_accuracy": True,
    "exact_match": True,
    "f1": True,
    "exact_match_text": True,
    "rouge_l": True,
    "bleu": True,
    "perplexity": False,
    "loss": False,
}


def _unknown_metric_error(unknown: list[str]) -> ValueError:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, METRICS, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"unknown metric name(s): {', '.join(parts)}; valid metrics: {', '.join(sorted(METRICS))}")


def compute(names: Sequence[str], preds: Sequence, refs: Sequence) -> dict[str, float]:
    """Compute the named metrics (keys of ``METRICS``) on ``preds`` vs ``refs``; ``{key: value}``.

    A metric returning a dict contributes all its keys (``"entity_f1"`` also gives ``entity_precision`` and
    ``entity_recall``); names that share a function (``"exact_match"`` and ``"f1"`` -> ``squad``) run it once.
    Raises ``ValueError`` naming unknown metrics, with a suggestion and the valid names."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ValueError(f"compute: no metric names given; valid metrics: {', '.join(sorted(METRICS))}")
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise _unknown_metric_error(unknown)
    out: dict[str, float] = {}
    done: set[int] = set()
    for name in names:
        fn = METRICS[name]
        if id(fn) in done:
            continue
        done.add(id(fn))
        value = fn(preds, refs)
        if isinstance(value, dict):
            out.update({k: float(v) for k, v in value.items()})
        else:
            out[name] = float(value)
    return out
