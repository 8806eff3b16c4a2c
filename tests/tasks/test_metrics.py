"""Finetuning metrics against their reference libraries (computed directly here) and hand-worked cases."""

import math
import warnings

import pytest

from pretune.tasks import DEFAULT_METRIC, TASK_METRICS
from pretune.tasks.metrics import (
    HIGHER_IS_BETTER,
    METRICS,
    accuracy,
    bleu,
    compute,
    exact_match_text,
    f1,
    matthews,
    mse,
    normalize_answer,
    pearson,
    perplexity,
    rouge_l,
    seqeval_scores,
    spearman,
    squad,
    tag_accuracy,
)

# multi-class with string labels, chosen so that macro and micro F1 differ
CLS_PREDS = ["cat", "dog", "dog", "bird", "cat", "cat", "dog", "bird", "cat", "dog"]
CLS_REFS = ["cat", "dog", "cat", "bird", "cat", "dog", "dog", "cat", "bird", "dog"]
REG_PREDS = [0.1, 0.4, 0.35, 0.8, 0.7, 0.2, 0.95]
REG_REFS = [0.0, 0.5, 0.3, 1.0, 0.6, 0.1, 0.7]


# ---------------------------------------------------------------------------------------- classification


def test_classification_matches_sklearn():
    import sklearn.metrics as skm

    assert accuracy(CLS_PREDS, CLS_REFS) == pytest.approx(skm.accuracy_score(CLS_REFS, CLS_PREDS))
    assert accuracy(CLS_PREDS, CLS_REFS) == pytest.approx(0.6)
    macro = f1(CLS_PREDS, CLS_REFS, average="macro")
    micro = f1(CLS_PREDS, CLS_REFS, average="micro")
    assert macro == pytest.approx(skm.f1_score(CLS_REFS, CLS_PREDS, average="macro"))
    assert micro == pytest.approx(skm.f1_score(CLS_REFS, CLS_PREDS, average="micro"))
    assert abs(macro - micro) > 1e-3
    assert matthews(CLS_PREDS, CLS_REFS) == pytest.approx(skm.matthews_corrcoef(CLS_REFS, CLS_PREDS))
    for fn in (accuracy, f1, matthews):
        assert type(fn(CLS_PREDS, CLS_REFS)) is float


def test_binary_f1_and_pos_label():
    import sklearn.metrics as skm

    p, r = [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0]
    assert f1(p, r, average="binary") == pytest.approx(skm.f1_score(r, p))
    ps = ["pos" if x else "neg" for x in p]
    rs = ["pos" if x else "neg" for x in r]
    assert f1(ps, rs, average="binary", pos_label="neg") == pytest.approx(skm.f1_score(r, p, pos_label=0))
    with pytest.raises(ValueError, match="average"):
        f1(p, r, average="weighted")


def test_degenerate_classification_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert matthews(["a", "a", "a"], ["a", "a", "a"]) == 0.0
        assert f1([0, 0], [0, 0], average="binary") == 0.0  # no positives at all


# -------------------------------------------------------------------------------------------- regression


def test_regression_matches_scipy_sklearn():
    import scipy.stats
    import sklearn.metrics as skm

    assert pearson(REG_PREDS, REG_REFS) == pytest.approx(scipy.stats.pearsonr(REG_PREDS, REG_REFS)[0])
    assert spearman(REG_PREDS, REG_REFS) == pytest.approx(scipy.stats.spearmanr(REG_PREDS, REG_REFS)[0])
    assert mse(REG_PREDS, REG_REFS) == pytest.approx(skm.mean_squared_error(REG_REFS, REG_PREDS))
    for fn in (pearson, spearman, mse):
        assert type(fn(REG_PREDS, REG_REFS)) is float


def test_constant_input_correlation_is_zero_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fn in (pearson, spearman):
            assert fn([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) == 0.0
            assert fn([0.1, 0.2, 0.3], [1.0, 1.0, 1.0]) == 0.0
            assert fn([0.3], [0.7]) == 0.0


# ---------------------------------------------------------------------------------------------------- SQuAD


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("  An apple, a day ") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


@pytest.mark.parametrize(
    "pred, golds, em, f1_",
    [
        ("the Eiffel Tower", ["Eiffel Tower"], 100.0, 100.0),
        ("Eiffel", ["Eiffel Tower"], 0.0, 2 * (1 * 0.5) / 1.5 * 100),  # P=1, R=1/2
        ("Eiffel Tower in Paris", ["Eiffel Tower"], 0.0, 2 * (0.5 * 1) / 1.5 * 100),  # P=2/4, R=1
        ("EIFFEL tower.", ["eiffel, tower"], 100.0, 100.0),  # case and punctuation
        ("Paris", ["Eiffel Tower"], 0.0, 0.0),
        ("Tower", ["Eiffel Tower", "the tower", "Paris"], 100.0, 100.0),  # max over golds
        ("big tower", ["Eiffel Tower", "tower"], 0.0, 2 * (0.5 * 1) / 1.5 * 100),  # best F1 from "tower"
        ("", [], 100.0, 100.0),  # unanswerable, no answer predicted
        ("", [""], 100.0, 100.0),
        ("Paris", [], 0.0, 0.0),  # unanswerable, but answered
        ("Paris", [""], 0.0, 0.0),
        ("", ["Paris"], 0.0, 0.0),  # answerable, but no answer predicted
    ],
)
def test_squad_cases(pred, golds, em, f1_):
    out = squad([pred], [golds])
    assert set(out) == {"exact_match", "f1"}
    assert out["exact_match"] == pytest.approx(em)
    assert out["f1"] == pytest.approx(f1_)


def test_squad_averages_over_questions():
    preds = ["the Eiffel Tower", "Eiffel", "", "Paris"]
    refs = [["Eiffel Tower"], ["Eiffel Tower"], [], [""]]
    out = squad(preds, refs)
    assert out["exact_match"] == pytest.approx(100 * (1 + 0 + 1 + 0) / 4)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)
    assert out["f1"] == pytest.approx(66.6667, abs=1e-3)
    assert squad(["Eiffel"], ["Eiffel Tower"]) == squad(["Eiffel"], [["Eiffel Tower"]])  # bare string gold


# ---------------------------------------------------------------------------------------------------- tagging

GOLD_TAGS = [
    ["B-PER", "I-PER", "O", "B-LOC", "O"],
    ["O", "B-ORG", "I-ORG", "O"],
    ["B-LOC", "O", "B-PER"],
]
PRED_TAGS = [
    ["B-PER", "I-PER", "O", "B-ORG", "O"],  # PER right, LOC typed as ORG
    ["O", "B-ORG", "I-ORG", "O"],  # ORG right
    ["B-LOC", "O", "O"],  # LOC right, PER missed
]


def test_seqeval_hand_computed():
    # gold entities: PER, LOC, ORG, LOC, PER = 5; predicted: PER, ORG, ORG, LOC = 4; correct: PER, ORG, LOC = 3
    out = seqeval_scores(PRED_TAGS, GOLD_TAGS)
    p, r = 3 / 4, 3 / 5
    assert out["entity_precision"] == pytest.approx(p)
    assert out["entity_recall"] == pytest.approx(r)
    assert out["entity_f1"] == pytest.approx(2 * p * r / (p + r))
    assert tag_accuracy(PRED_TAGS, GOLD_TAGS) == pytest.approx(10 / 12)


def test_seqeval_matches_library():
    import seqeval.metrics as sm

    out = seqeval_scores(PRED_TAGS, GOLD_TAGS)
    assert out == {
        "entity_f1": pytest.approx(sm.f1_score(GOLD_TAGS, PRED_TAGS)),
        "entity_precision": pytest.approx(sm.precision_score(GOLD_TAGS, PRED_TAGS)),
        "entity_recall": pytest.approx(sm.recall_score(GOLD_TAGS, PRED_TAGS)),
    }
    assert tag_accuracy(PRED_TAGS, GOLD_TAGS) == pytest.approx(sm.accuracy_score(GOLD_TAGS, PRED_TAGS))


def test_seqeval_length_checks():
    with pytest.raises(ValueError, match="sentence 1"):
        seqeval_scores([["O"], ["O", "O"]], [["O"], ["O"]])
    with pytest.raises(ValueError, match="list of tag lists"):
        tag_accuracy(["O", "O"], ["O", "O"])


# ----------------------------------------------------------------------------------------------- seq2seq

HYPS = ["the cat sat on the mat", "a quick brown fox jumps", "hello there world"]
REFS = ["the cat is sitting on the mat", "the quick brown fox jumped over", "hello world"]


def test_rouge_l_matches_library():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    expected = 100 * sum(scorer.score(r, h)["rougeL"].fmeasure for h, r in zip(HYPS, REFS)) / len(HYPS)
    assert rouge_l(HYPS, REFS) == pytest.approx(expected)
    assert rouge_l(HYPS, HYPS) == pytest.approx(100.0)
    # multiple references: the best one counts
    assert rouge_l(["hello world"], [["goodbye", "hello world"]]) == pytest.approx(100.0)


def test_bleu_matches_library():
    import sacrebleu

    assert bleu(HYPS, REFS) == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)
    assert bleu(HYPS, HYPS) == pytest.approx(100.0)
    refs2 = ["a cat sat on a mat", "quick brown foxes jump", "hello there, world"]
    multi = [[a, b] for a, b in zip(REFS, refs2)]
    assert bleu(HYPS, multi) == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS, refs2]).score)
    # a variable number of references per prediction is padded for sacrebleu
    ragged = [[REFS[0], refs2[0]], [REFS[1]], [REFS[2]]]
    assert bleu(HYPS, ragged) == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS, [refs2[0], None, None]]).score)


def test_exact_match_text():
    assert exact_match_text(["Paris ", "london", "Rome"], ["Paris", "London", ["Milan", "Rome"]]) == pytest.approx(
        2 / 3
    )


def test_perplexity():
    assert perplexity(20.0, 10) == pytest.approx(math.exp(2.0))
    assert perplexity(0.0, 5) == pytest.approx(1.0)
    assert math.isfinite(perplexity(1e6, 1))  # capped, no OverflowError
    with pytest.raises(ValueError, match="n_tokens"):
        perplexity(1.0, 0)


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("fn", [accuracy, f1, matthews, pearson, spearman, mse, squad, exact_match_text, rouge_l, bleu])
def test_length_mismatch_and_empty(fn):
    with pytest.raises(ValueError, match="2 predictions but 3 references"):
        fn(["1", "0"], ["1", "0", "1"])
    with pytest.raises(ValueError, match="empty"):
        fn([], [])


def test_tagging_length_mismatch():
    with pytest.raises(ValueError, match="1 predictions but 2 references"):
        seqeval_scores([["O"]], [["O"], ["O"]])


# ---------------------------------------------------------------------------------------------- registry


def test_compute_classification_and_regression():
    out = compute(TASK_METRICS["classification"], CLS_PREDS, CLS_REFS)
    assert out == {
        "accuracy": pytest.approx(accuracy(CLS_PREDS, CLS_REFS)),
        "macro_f1": pytest.approx(f1(CLS_PREDS, CLS_REFS, average="macro")),
        "micro_f1": pytest.approx(f1(CLS_PREDS, CLS_REFS, average="micro")),
        "mcc": pytest.approx(matthews(CLS_PREDS, CLS_REFS)),
    }
    out = compute(TASK_METRICS["regression"], REG_PREDS, REG_REFS)
    assert set(out) == {"pearson", "spearman", "mse"}


def test_compute_flattens_dict_metrics(monkeypatch):
    import pretune.tasks.metrics as m

    calls = []
    real = m.squad

    def counting(preds, refs):
        calls.append(1)
        return real(preds, refs)

    monkeypatch.setitem(m.METRICS, "exact_match", counting)
    monkeypatch.setitem(m.METRICS, "f1", counting)
    out = compute(["exact_match", "f1"], ["Eiffel"], [["Eiffel Tower"]])
    assert out == {"exact_match": 0.0, "f1": pytest.approx(200 / 3)}
    assert len(calls) == 1  # both names share one computation

    out = compute(["entity_f1", "tag_accuracy"], PRED_TAGS, GOLD_TAGS)
    assert set(out) == {"entity_f1", "entity_precision", "entity_recall", "tag_accuracy"}
    out = compute(TASK_METRICS["seq2seq"], HYPS, REFS)
    assert set(out) == {"exact_match_text", "rouge_l", "bleu"}


def test_unknown_metric_error_suggests():
    with pytest.raises(ValueError, match="did you mean 'accuracy'") as e:
        compute(["acuracy"], [1], [1])
    assert "valid metrics" in str(e.value) and "macro_f1" in str(e.value)
    with pytest.raises(ValueError, match="no metric names"):
        compute([], [1], [1])


def test_tables_consistent():
    assert set(TASK_METRICS) == set(DEFAULT_METRIC)
    from pretune.tasks import TASKS, Task

    for task, names in TASK_METRICS.items():
        if TASKS[task].score is Task.score:  # computed by `compute` (multilabel scores label sets itself)
            assert all(n in METRICS for n in names), task
        assert DEFAULT_METRIC[task] in names
    for name in METRICS:
        if name != "squad":
            assert name in HIGHER_IS_BETTER
    assert HIGHER_IS_BETTER["mse"] is False and HIGHER_IS_BETTER["accuracy"] is True


def test_import_is_lazy():
    """The module itself (loaded alone, not through the ``pretune`` package) pulls in none of the libraries."""
    import subprocess
    import sys

    import pretune.tasks.metrics as m

    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('_metrics', {m.__file__!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "print([n for n in ('sklearn', 'scipy', 'seqeval', 'sacrebleu', 'rouge_score', 'numpy') if n in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
