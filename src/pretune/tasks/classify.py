"""Sentence tasks: single-sentence classification, sentence-pair classification, regression (STS-B)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from torch import nn

from ..config import ConfigError
from ..data.readers import DataError
from .base import Layout, Record, Task, TaskConfig, get_field, label_text, most_common

POOLINGS = ("pooler", "cls", "mean", "last")


@dataclass
class SentenceSettings(TaskConfig):
    """What the sentence tasks share: the label's field and how the head reads the sequence."""

    label_field: str = "label"  # class name (or number) / real value
    pooling: str = ""  # the sentence vector the head reads: pooler, cls, mean, last; empty: by family

    def validate(self) -> None:
        super().validate()
        if self.pooling and self.pooling not in POOLINGS:
            raise ConfigError(f"task.pooling={self.pooling!r} is not one of {', '.join(POOLINGS)}")


@dataclass
class ClassificationSettings(SentenceSettings):
    """classification (and multilabel): one text."""

    text_field: str = "text"  # the input text
    labels: list[str] = field(default_factory=list)  # the label set in id order; empty: read from the training data


@dataclass
class PairSettings(SentenceSettings):
    """pair: two texts, in BERT's or GPT's input format."""

    text_a_field: str = "text_a"  # first sentence
    text_b_field: str = "text_b"  # second sentence
    labels: list[str] = field(default_factory=list)  # the label set in id order; empty: read from the training data
    pair_style: Literal["auto", "bert", "gpt"] = "auto"  # auto: bert for encoders, gpt for decoders


@dataclass
class RegressionSettings(SentenceSettings):
    """regression: one text, or a pair when the record has text_a_field (and not text_field)."""

    text_field: str = "text"  # the input text
    text_a_field: str = "text_a"  # first sentence of a pair
    text_b_field: str = "text_b"  # second sentence of a pair


def _label_str(value) -> str:
    return value if isinstance(value, str) else (str(int(value)) if float(value).is_integer() else str(value))


def _label(rec: Record, field: str) -> str:
    """A record's label as a string (a JSON number as its digits); an empty one is refused, naming the row."""
    return label_text(rec, field, _label_str(get_field(rec, field, (str, int, float))))


def _label_order(label: str) -> tuple:
    """Sort key of a label map: numeric labels in numeric order ("2" before "10", "-1" before "0.5"), then
    the other labels as sorted strings."""
    try:
        value = float(label)
    except ValueError:
        value = None
    if value is not None and np.isfinite(value):
        return (0, value, label)
    return (1, 0.0, label)


def _number(rec: Record, field: str) -> float:
    value = get_field(rec, field, (int, float, str))
    try:
        v = float(value)
    except ValueError:
        raise DataError(f"{rec.where}: regression label {value!r} is not a number") from None
    if not np.isfinite(v):
        raise DataError(f"{rec.where}: regression label {value!r} is not finite")
    return v


class Classification(Task):
    """One text → one of N labels; the head reads the pooled sequence (see ModelConfig.pooling)."""

    Settings = ClassificationSettings
    name = "classification"
    model_head = "classification"
    metrics = ("accuracy", "macro_f1", "micro_f1", "mcc")
    default_metric = "accuracy"
    has_labels = True
    pair = False

    def __init__(self, cfg: SentenceSettings, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.layout = Layout(tokenizer, model_cfg, cfg.pair_style if self.pair else "auto")

    def texts(self, rec: Record) -> tuple[str, str | None]:
        if self.pair:
            return get_field(rec, self.cfg.text_a_field), get_field(rec, self.cfg.text_b_field)
        return get_field(rec, self.cfg.text_field), None

    @classmethod
    def head_config(cls, cfg: SentenceSettings, labels: list[str]) -> dict:
        out = super().head_config(cfg, labels)
        if cfg.pooling:
            out["pooling"] = cfg.pooling
        return out

    @classmethod
    def label_set(cls, cfg: TaskConfig, records: list[Record]) -> list[str]:
        if cfg.labels:
            return list(cfg.labels)
        found = set()
        numbers, words = [], []  # (position, record, label) whose label is a JSON number / a string that is not one
        for i, rec in enumerate(records):
            value = get_field(rec, cfg.label_field, (str, int, float))
            found.add(label_text(rec, cfg.label_field, _label_str(value)))
            if isinstance(value, str):
                if _label_order(value)[0]:
                    words.append((i, rec, value))
            else:
                numbers.append((i, rec, value))
        if numbers and words:  # 1 among "ham"/"spam" would silently become a third class
            # the rarer kind is the mistake (a tie: the kind the first record does not have); name its first record
            odd_is_number = (len(numbers), -numbers[0][0]) < (len(words), -words[0][0])
            odd, usual = (numbers, words) if odd_is_number else (words, numbers)
            kind, other = ("a number", "text") if odd_is_number else ("text", "number")
            _, rec, value = odd[0]
            shown = ", ".join(repr(v) for v in sorted({v for _, _, v in usual})[:5])
            raise DataError(f"{rec.where}: label {value!r} is {kind}, while {len(usual)} other records have {other} "
                            f"labels ({shown}); {len(odd)} record(s) have {kind.removeprefix('a ')} labels. Use one "
                            f"kind of label in field {cfg.label_field!r} (or list the classes with task.labels=[...])")
        if len(found) < 2:
            raise DataError(f"the training data has {len(found)} distinct label(s) in field {cfg.label_field!r} "
                            f"({sorted(found)}): classification needs at least 2")
        return sorted(found, key=_label_order)

    def label_id(self, rec: Record) -> int:
        label = _label(rec, self.cfg.label_field)
        if label not in self.label_ids:
            known = ", ".join(self.labels[:20]) + (" ..." if len(self.labels) > 20 else "")
            raise DataError(f"{rec.where}: label {label!r} is not in the model's label map ({known})")
        return self.label_ids[label]

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        a, b = self.texts(rec)
        enc = self.tok.tk.encode_batch([a] + ([b] if b is not None else []), add_special_tokens=False)
        feat = self.layout.build(enc[0].ids, enc[1].ids if b is not None else None, self.max_len)
        if labelled:
            feat["labels"] = self.target(rec)
        return [feat]

    def target(self, rec: Record):
        return np.int64(self.label_id(rec))

    def loss(self, model, batch, totals):
        logits = self.forward_logits(model, batch).float()  # (B, num_labels)
        loss = nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
        correct = (logits.argmax(-1) == batch["labels"]).sum()
        return loss / totals[self.term], {"task_loss": float(loss.detach()), "task_correct": float(correct)}

    def predict(self, records, features, outputs):
        return [self.labels[int(np.argmax(o))] for o in outputs]

    def reference(self, rec: Record):
        return _label(rec, self.cfg.label_field)

    def baseline_predictions(self, train, records):
        """The majority class of the training records, for every record."""
        label, share = most_common(self.reference(r) for r in train)
        return [label] * len(records), f"always {label!r} (the most frequent training label, {share:.0%})"

    def prediction_json(self, rec, pred):
        return {"prediction": pred}

    def scores_json(self, output):
        """Each label's probability (softmax of the logits)."""
        z = np.asarray(output, dtype=np.float64)
        p = np.exp(z - z.max())
        return {label: round(float(v), 6) for label, v in zip(self.labels, p / p.sum())}


class Pair(Classification):
    """Two texts → a label (NLI, paraphrase, "does gloss B define word A?"): BERT or GPT input format."""

    Settings = PairSettings
    name = "pair"
    pair = True


class Regression(Classification):
    """One text (or a pair) → one real value (STS-B); mean squared error."""

    Settings = RegressionSettings
    name = "regression"
    model_head = "regression"
    metrics = ("pearson", "spearman", "mse")
    default_metric = "pearson"
    has_labels = False

    def texts(self, rec: Record):
        if self.cfg.text_a_field in rec.data and self.cfg.text_field not in rec.data:
            return get_field(rec, self.cfg.text_a_field), get_field(rec, self.cfg.text_b_field)
        return get_field(rec, self.cfg.text_field), None

    @classmethod
    def label_set(cls, cfg, records):
        return []

    def target(self, rec: Record):
        return np.float32(_number(rec, self.cfg.label_field))

    def loss(self, model, batch, totals):
        pred = self.forward_logits(model, batch).float().squeeze(-1)  # (B,)
        loss = nn.functional.mse_loss(pred, batch["labels"].float(), reduction="sum")
        return loss / totals[self.term], {"task_loss": float(loss.detach())}

    def predict(self, records, features, outputs):
        return [float(o[0]) for o in outputs]

    def scores_json(self, output):
        return None  # the prediction is the value

    def reference(self, rec: Record):
        return _number(rec, self.cfg.label_field)

    def baseline_predictions(self, train, records):
        """The mean of the training values, for every record (its correlations are 0)."""
        mean = float(np.mean([self.reference(r) for r in train]))
        return [mean] * len(records), f"always {mean:.4g} (the mean training value)"

    def counts(self, batch):
        return {self.term: int(batch["labels"].shape[0])}
