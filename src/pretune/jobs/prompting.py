"""Evaluating prompts without training: label-word classification and chain-of-thought (with self-consistency)
over a labelled file, scored against its gold labels or answers (``pretune prompt`` prints and writes these).

    metrics, rows = evaluate_labels(model, tok, prompt, verbalizer, records)   # accuracy, macro_f1, auc, ...
    metrics, rows = evaluate_cot(model, tok, prompt, records, k=5, seed=0)     # accuracy, mean_agreement, ...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..data.records import Record
from ..generation.prompt import FewShotPrompt, Verbalizer

__all__ = ["evaluate_labels", "evaluate_cot"]


def evaluate_labels(model, tok, prompt: FewShotPrompt, verbalizer: Verbalizer, records: Sequence[Record], *,
                    label_field: str = "label", progress=None, **kw) -> tuple[dict, list[dict]]:
    """Label-word classification of ``records``: (metrics, one output row per record). ``kw`` goes to
    :func:`~pretune.generation.scoring.classify`."""
    from ..generation.scoring import classify
    from ..tasks.metrics import compute

    gold = [verbalizer.label_of(r, label_field) for r in records]
    res = classify(model, tok, prompt, verbalizer, records, progress=progress, **kw)
    preds = res.predictions
    metrics = compute(["accuracy", "macro_f1"], preds, gold)
    metrics["predicted"] = dict(Counter(preds))
    metrics["gold"] = dict(Counter(gold))
    metrics["dropped_shots"] = sum(n < len(prompt.shots) for n in res.n_shots)
    if len(res.labels) == 2 and len(set(gold)) == 2:
        from sklearn.metrics import roc_auc_score

        # threshold-free: how well log p(word 2) - log p(word 1) ranks the second label above the first
        margin = (res.scores[:, 1] - res.scores[:, 0]).tolist()
        metrics["auc"] = float(roc_auc_score([g == res.labels[1] for g in gold], margin))
    if res.baseline is not None:
        raw = res.raw_predictions
        metrics["uncalibrated"] = {**compute(["accuracy", "macro_f1"], raw, gold), "predicted": dict(Counter(raw))}
    rows = []
    for i, (r, g, p, n) in enumerate(zip(records, gold, preds, res.n_shots)):
        row = {"row": r.row, "label": g, "prediction": p, "correct": p == g, "n_shots": n,
               "scores": dict(zip(res.labels, res.scores[i].tolist()))}
        if res.baseline is not None:
            row["calibrated"] = dict(zip(res.labels, res.calibrated[i].tolist()))
        rows.append(row)
    return metrics, rows


def evaluate_cot(model, tok, prompt: FewShotPrompt, records: Sequence[Record], *, answer_field: str = "answer",
                 progress=None, **kw) -> tuple[dict, list[dict]]:
    """Chain-of-thought (self-consistency when ``k > 1``) on ``records``: (metrics, one output row per record).
    ``kw`` goes to :func:`~pretune.generation.scoring.chain_of_thought`."""
    from ..data.records import get_field
    from ..generation.prompt import normalize_answer
    from ..generation.scoring import chain_of_thought

    gold = [normalize_answer(str(get_field(r, answer_field, (str, int, float), what="gold answer")))
            for r in records]
    outcomes = chain_of_thought(model, tok, prompt, records, progress=progress, **kw)
    rows = []
    for r, g, o in zip(records, gold, outcomes):
        v = o.result.vote
        rows.append({"row": r.row, "answer": g, "prediction": v.answer, "correct": v.answer == g,
                     "votes": v.counts, "agreement": v.agreement, "unanswered": v.n_unanswered, "n_shots": o.n_shots,
                     "answers": o.result.answers, "paths": o.result.paths})
    n = len(rows)
    metrics = {"accuracy": sum(r["correct"] for r in rows) / n,
               "mean_agreement": sum(r["agreement"] for r in rows) / n,
               "unanswered_paths": sum(r["unanswered"] for r in rows),
               "dropped_shots": sum(o.n_shots < len(prompt.shots) for o in outcomes)}
    return metrics, rows
