"""Multi-label classification: one text → any number of labels (a set), one sigmoid per label.

Records hold the text and, in the label field, a list of label names (``{"text": "run", "label": ["noun",
"verb"]}``; an empty list means no label applies, a single string one label). The model is the sentence-
classification head with ``multi_label`` set: its logits go through one sigmoid each and are trained with binary
cross-entropy averaged over every (example, label) entry, as transformers'
``*ForSequenceClassification(problem_type="multi_label_classification")`` does, so such checkpoints move to and
from Hugging Face. A label is predicted when its probability exceeds ``task.threshold`` (0.5: transformers'
``sigmoid > 0.5``). Metrics: micro and macro F1 over the labels, and subset accuracy (the exact set).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from ..config import ConfigError
from ..data.readers import DataError
from .base import Record, get_field, label_text
from .classify import Classification, ClassificationSettings, _label_order, _label_str


@dataclass
class MultilabelSettings(ClassificationSettings):
    """multilabel: classification's settings and the probability a label must exceed."""

    threshold: float = 0.5  # a label is predicted when its probability exceeds this

    def validate(self) -> None:
        super().validate()
        if not 0 < self.threshold < 1:
            raise ConfigError(f"task.threshold={self.threshold}: expected a probability strictly between 0 and 1 "
                              "(multilabel predicts each label whose probability exceeds it)")


class Multilabel(Classification):
    """Differs from classification: a set of labels per text, a sigmoid per label, binary cross-entropy."""

    Settings = MultilabelSettings
    name = "multilabel"
    model_head = "classification"
    metrics = ("micro_f1", "macro_f1", "subset_accuracy")
    default_metric = "micro_f1"

    def label_names(self, rec: Record) -> list[str]:
        return _names(rec, self.cfg.label_field)

    @classmethod
    def label_set(cls, cfg, records: list[Record]) -> list[str]:
        if cfg.labels:
            return list(cfg.labels)
        found = {name for rec in records for name in _names(rec, cfg.label_field)}
        if len(found) < 2:
            raise DataError(f"the training data has {len(found)} distinct label(s) in field {cfg.label_field!r} "
                            f"({sorted(found)}): multi-label classification needs at least 2")
        return sorted(found, key=_label_order)

    @classmethod
    def head_config(cls, cfg, labels: list[str]) -> dict:
        return {**super().head_config(cfg, labels), "multi_label": True}

    def target(self, rec: Record):
        hot = np.zeros(len(self.labels), dtype=np.int64)  # multi-hot
        for name in self.label_names(rec):
            if name not in self.label_ids:
                known = ", ".join(self.labels[:20]) + (" ..." if len(self.labels) > 20 else "")
                raise DataError(f"{rec.where}: label {name!r} is not in the model's label map ({known})")
            hot[self.label_ids[name]] = 1
        return hot

    def counts(self, batch):
        return {self.term: int(batch["labels"].numel())}  # every (example, label) entry

    def loss(self, model, batch, totals):
        logits = self.forward_logits(model, batch).float()  # (B, num_labels)
        target = batch["labels"].float()
        loss = nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum")
        correct = ((logits > 0).float() == target).sum()  # entries right: task_acc is the Hamming accuracy
        return loss / totals[self.term], {"task_loss": float(loss.detach()), "task_correct": float(correct)}

    def predict(self, records, features, outputs):
        cut = float(np.log(self.cfg.threshold / (1 - self.cfg.threshold)))  # sigmoid(x) > t  <=>  x > logit(t)
        return [[self.labels[i] for i in np.flatnonzero(np.asarray(o) > cut)] for o in outputs]

    def scores_json(self, output):
        """Each label's probability (its own sigmoid)."""
        return {label: round(float(1 / (1 + np.exp(-v))), 6) for label, v in zip(self.labels, np.asarray(output))}

    def reference(self, rec: Record):
        names = set(self.label_names(rec))
        return [label for label in self.labels if label in names]

    def baseline_predictions(self, train, records):
        """Each label more than half of the training records carry (per label, the majority), for every record."""
        refs = [set(self.reference(r)) for r in train]
        chosen = [label for label in self.labels if 2 * sum(label in s for s in refs) > len(refs)]
        what = f"always {chosen}" if chosen else "always no label"
        return [chosen] * len(records), what + " (each label's majority in training)"

    def score(self, predictions: list, references: list) -> dict:
        from sklearn.metrics import f1_score
        from sklearn.preprocessing import MultiLabelBinarizer

        if len(predictions) != len(references) or not predictions:
            raise ValueError(f"multilabel: {len(predictions)} predictions for {len(references)} references")
        binarizer = MultiLabelBinarizer(classes=self.labels)
        pred, gold = binarizer.fit_transform(predictions), binarizer.transform(references)
        return {"micro_f1": float(f1_score(gold, pred, average="micro", zero_division=0.0)),
                "macro_f1": float(f1_score(gold, pred, average="macro", zero_division=0.0)),
                "subset_accuracy": float((pred == gold).all(axis=1).mean())}


def _names(rec: Record, field: str) -> list[str]:
    """A record's label names: a list in its label field (a single value: one label), each once."""
    value = get_field(rec, field, (list, str, int, float), what="a list of labels")
    values = value if isinstance(value, list) else [value]
    bad = [v for v in values if not isinstance(v, (str, int, float)) or isinstance(v, bool)]
    if bad:
        raise DataError(f"{rec.where}: field {field!r} should list label names, got {bad[0]!r}")
    expected = "a label name ([] for a text no label applies to)"
    return list(dict.fromkeys(label_text(rec, field, _label_str(v), expected=expected) for v in values))
