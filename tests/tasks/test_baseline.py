"""Each task's baseline (``Task.baseline``: what a model that ignores its input scores, learned from the training
records) on small record lists, worked out by hand; and the train-loss trend (``TrainLosses``) and the check that
turns both into a run's warnings (``jobs/finetune/diagnose.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pretune.io.tokenization import Tokenizer
from pretune.jobs.finetune.diagnose import check_training, format_warnings
from pretune.presets import get_preset
from pretune.tasks import TASKS, TaskConfig, build_task
from pretune.tasks.base import Record
from pretune.train.callbacks import TrainLosses


@pytest.fixture(scope="module")
def tok(tokenizers_by_kind) -> Tokenizer:
    return Tokenizer.load(tokenizers_by_kind["wordpiece"])


def recs(*data: dict) -> list[Record]:
    return [Record(f"r:{i + 1}", d) for i, d in enumerate(data)]


def task_for(name: str, tok: Tokenizer, train: list[Record], preset: str = "tiny-bert-base", **cfg):
    settings = TaskConfig(name=name, **cfg)
    head = TASKS[name].head_config(settings, TASKS[name].label_set(settings, train))
    model_cfg = get_preset(preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id or 0, **head)
    return build_task(settings, model_cfg, tok)


def labelled(*labels) -> list[Record]:
    return recs(*({"text": "some words", "label": x} for x in labels))


def test_classification_baseline_is_the_majority_class(tok):
    train = labelled("pos", "neg", "pos")
    base = task_for("classification", tok, train).baseline(train, labelled("pos", "neg", "neg", "neg"))
    assert base.what == "always 'pos' (the most frequent training label, 67%)"
    # always 'pos' on pos/neg/neg/neg: 1 of 4 right; F1 of pos = 2 * (1/4 * 1) / (1/4 + 1) = 0.4, of neg 0
    assert base.metrics == pytest.approx({"accuracy": 0.25, "macro_f1": 0.2, "micro_f1": 0.25, "mcc": 0.0})


def test_pair_baseline_is_the_majority_class(tok):
    train = recs(*({"text_a": "a", "text_b": "b", "label": x} for x in (1, 0, 0)))
    base = task_for("pair", tok, train).baseline(train, train)
    assert base.what.startswith("always '0'") and base.metrics["accuracy"] == pytest.approx(2 / 3)


def test_regression_baseline_is_the_mean(tok):
    train = labelled(1, 2, 6)
    base = task_for("regression", tok, train).baseline(train, labelled(0, 3, 6))
    assert base.what == "always 3 (the mean training value)"
    assert base.metrics == {"pearson": 0.0, "spearman": 0.0, "mse": pytest.approx((9 + 0 + 9) / 3)}


def test_tagging_baseline_is_the_most_frequent_tag(tok):
    train = recs({"tokens": ["Emma", "said", "so"], "tags": ["B-PER", "O", "O"]},
                 {"tokens": ["Mr", "Knightley", "came"], "tags": ["B-PER", "I-PER", "O"]})
    dev = recs({"tokens": ["Harriet", "smiled"], "tags": ["B-PER", "O"]}, {"tokens": ["yes"], "tags": ["O"]})
    task = task_for("tagging", tok, train)
    base = task.baseline(train, dev)
    assert base.what == "every word 'O' (the most frequent training tag, 50% of words)"
    assert base.metrics["entity_f1"] == 0.0 and base.metrics["tag_accuracy"] == pytest.approx(2 / 3)


def test_multilabel_baseline_is_each_labels_majority(tok):
    train = recs(*({"text": "w", "label": x} for x in (["a", "b"], ["a"], ["a", "c"], ["b"])))
    dev = recs(*({"text": "w", "label": x} for x in (["a"], ["b"], ["a", "b"])))
    base = task_for("multilabel", tok, train).baseline(train, dev)
    assert base.what == "always ['a'] (each label's majority in training)"  # a: 3 of 4; b: 2 of 4 is no majority
    # always {a}: 2 true positives, 1 false positive, 2 false negatives (b) -> micro F1 4/7; per label a 0.8, b, c 0
    assert base.metrics == pytest.approx({"micro_f1": 4 / 7, "macro_f1": 0.8 / 3, "subset_accuracy": 1 / 3})
    none = recs(*({"text": "w", "label": x} for x in (["a"], ["b"], [])))
    assert task_for("multilabel", tok, none).baseline(none, none).what.startswith("always no label")


def test_qa_baseline_is_no_answer(tok):
    dev = recs({"context": "Emma lived at Hartfield.", "question": "Where?", "answers": ["Hartfield"]},
               {"context": "Emma lived at Hartfield.", "question": "Who came?", "answers": []})
    base = task_for("qa", tok, dev).baseline(dev, dev)
    assert base.what == "always no answer" and base.metrics == {"exact_match": 50.0, "f1": 50.0}


def test_choice_baseline_is_the_majority_class(tokenizers_by_kind):
    tok = Tokenizer.load(tokenizers_by_kind["bpe"])
    train = labelled("neg", "pos", "pos", "pos")
    task = task_for("choice", tok, train, preset="tiny-gpt2", labels=["neg", "pos"])
    base = task.baseline(train, labelled("pos", "neg"))
    assert base.what == "always 'pos' (the most frequent training label, 75%)" and base.metrics["accuracy"] == 0.5


def test_seq2seq_has_no_baseline(tokenizers_by_kind):
    tok = Tokenizer.load(tokenizers_by_kind["unigram"])
    train = recs({"source": "a", "target": "b"})
    assert task_for("seq2seq", tok, train, preset="tiny-t5-small").baseline(train, train) is None


def test_train_losses_trend_compares_the_first_and_last_tenth():
    cb = TrainLosses()
    cb.on_step(None, 1, {"loss": 5.0})
    assert cb.trend() is None  # one step: nothing to compare
    for step, loss in enumerate([5.0] * 19 + [1.0] * 20, start=2):
        cb.on_step(None, step, {"loss": loss})
    assert cb.trend() == (5.0, 1.0, 4)  # 40 steps: the first 4 and the last 4
    again = TrainLosses()
    again.load_state_dict(cb.state_dict(40))  # a resumed run keeps the losses before it
    assert again.losses == cb.losses
    two = TrainLosses()
    two.losses = [3.0, 2.0]
    assert two.trend() == (3.0, 2.0, 1)


def fake_run(task, train, dev, losses, *, lr=1e-3, metric="accuracy"):
    cb = TrainLosses()
    cb.losses = list(losses)
    job = SimpleNamespace(task=task, metric=metric, records={"train": train, "dev": dev, "test": []},
                          features={"train": [{}] * 32},
                          cfg=SimpleNamespace(train=SimpleNamespace(batch_size=8, lr=lr),
                                              tune=SimpleNamespace(patience=0), data=SimpleNamespace(train="t.jsonl")),
                          method=SimpleNamespace(default_lr=5e-5))
    return job, SimpleNamespace(callbacks=[cb], stopped_early=False)


def test_check_training_warns_only_when_no_better_or_the_loss_did_not_fall(tok):
    train, dev = labelled("a", "a", "b"), labelled("a", "a", "b", "b")  # always 'a' scores 0.5 on dev
    task = task_for("classification", tok, train)
    job, trainer = fake_run(task, train, dev, [1.0] * 5 + [0.5] * 5)
    baseline, warnings = check_training(job, trainer, 8, dev={"accuracy": 0.75}, test={})
    assert baseline["what"].startswith("always 'a'") and baseline["accuracy"] == 0.5 and warnings == []
    _, warnings = check_training(job, trainer, 8, dev={"accuracy": 0.505}, test={})  # within the margin
    assert [w["kind"] for w in warnings] == ["no_better_than_baseline"]
    assert warnings[0]["next"] == ("this run took 8 optimizer steps (2 epochs of 4 steps of 8 examples) at lr 0.001; "
                                   "try --epochs 4, a higher --lr (e.g. --lr 0.003), and check the labels in t.jsonl")
    job, trainer = fake_run(task, train, dev, [1.0] * 10, lr=1e-9)
    _, warnings = check_training(job, trainer, 8, dev={"accuracy": 0.9}, test={})
    assert [w["kind"] for w in warnings] == ["loss_did_not_fall"] and "--lr 5e-05" in warnings[0]["next"]
    assert format_warnings(warnings).startswith("warning: training did not take: the train loss did not fall: "
                                                "1.0000 over the first 1 of 10 steps, 1.0000 over the last 1.")
    # a lower-is-better metric: no better means no lower
    job, trainer = fake_run(task, train, dev, [1.0, 0.1], metric="mse")
    task.baseline = lambda tr, rs: SimpleNamespace(what="always 3", metrics={"mse": 2.0})
    assert check_training(job, trainer, 8, dev={"mse": 1.0}, test={})[1] == []
    assert check_training(job, trainer, 8, dev={"mse": 1.99}, test={})[1][0]["kind"] == "no_better_than_baseline"
