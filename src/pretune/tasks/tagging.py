"""Token tagging (POS, NER with BIO tags): one label per word, predicted on the word's first subword.

Words are tokenized as pre-split input (``is_pretokenized``), so every subword knows its word. The
first subword of a word carries the word's tag; the others, and special tokens, are ignored by the
loss (-100) and by prediction (Devlin et al. 2019 §5.3). Words cut off by ``max_len`` are predicted
as ``O`` (or the first label when there is no ``O``), so predictions always align with the input.
Byte-level BPE (GPT-2, RoBERTa) marks a word start by its leading space (``Ġ``): every word after the
first is encoded with one, as in running text (Hugging Face's ``add_prefix_space`` for pre-split input);
without it "said" would be spelled in the pieces of a word's middle (``s a id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import nn

from ..data.readers import DataError
from ..objectives.base import IGNORE
from .base import Layout, Record, Task, TaskConfig, get_field, label_text, most_common


@dataclass
class TaggingSettings(TaskConfig):
    """tagging: the words and their tags."""

    tokens_field: str = "tokens"  # list of words
    tags_field: str = "tags"  # list of tags, one per word (BIO for NER)
    labels: list[str] = field(default_factory=list)  # the tag set in id order; empty: read from the training data


class Tagging(Task):
    Settings = TaggingSettings
    name = "tagging"
    model_head = "tagging"
    metrics = ("entity_f1", "tag_accuracy")
    default_metric = "entity_f1"
    has_labels = True

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.layout = Layout(tokenizer, model_cfg, "auto")
        self.fallback = "O" if "O" in self.label_ids else (self.labels[0] if self.labels else "O")
        marker = tokenizer._word_marker() if hasattr(tokenizer, "_word_marker") else None
        self.space_words = marker == ("start", "Ġ")  # byte-level BPE: a word start is its leading space

    def words(self, rec: Record) -> list[str]:
        words = get_field(rec, self.cfg.tokens_field, (list, str), what="the words of the sentence")
        if isinstance(words, str):
            words = words.split()
        if not words or not all(isinstance(w, str) for w in words):
            raise DataError(f"{rec.where}: field {self.cfg.tokens_field!r} must be a non-empty list of strings")
        return words

    def tags(self, rec: Record, n_words: int) -> list[str]:
        tags = _tags(rec, self.cfg.tags_field)
        if len(tags) != n_words:
            raise DataError(f"{rec.where}: {len(tags)} tags for {n_words} words ({self.cfg.tags_field!r} and "
                            f"{self.cfg.tokens_field!r} must have the same length)")
        return tags

    @classmethod
    def label_set(cls, cfg, records):
        if cfg.labels:
            return list(cfg.labels)
        found: set[str] = set()
        for rec in records:
            found.update(_tags(rec, cfg.tags_field))
        if not found:
            raise DataError(f"no tags found in field {cfg.tags_field!r} of the training data")
        return sorted(found, key=lambda t: (t != "O", t[2:] if t[1:2] == "-" else t, t))  # O first, then B/I pairs

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        words = self.words(rec)
        pieces = [words[0], *(" " + w for w in words[1:])] if self.space_words else words
        enc = self.tok.tk.encode(pieces, is_pretokenized=True, add_special_tokens=False)
        budget = self.max_len - self.layout.n_special(False)
        ids, word_of = enc.ids[:budget], enc.word_ids[:budget]
        feat = self.layout.build(ids, None, self.max_len)
        offset = 1 if self.layout.start is not None else 0
        first = np.full(len(words), -1, dtype=np.int64)  # input position of each word's first subword
        for pos, w in enumerate(word_of):
            if w is not None and first[w] < 0:
                first[w] = pos + offset
        feat["_first"] = first
        if labelled:
            tags = self.tags(rec, len(words))
            labels = np.full(len(feat["input_ids"]), IGNORE, dtype=np.int64)
            for w, pos in enumerate(first):
                if pos >= 0:
                    if tags[w] not in self.label_ids:
                        raise DataError(f"{rec.where}: tag {tags[w]!r} (word {w + 1}, {words[w]!r}) is not in the "
                                        f"model's label map ({', '.join(self.labels)})")
                    labels[pos] = self.label_ids[tags[w]]
            feat["labels"] = labels
        return [feat]

    def loss(self, model, batch, totals):
        logits = self.forward_logits(model, batch).float()  # (B, T, num_labels)
        labels = batch["labels"]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                                           reduction="sum")
        correct = ((logits.argmax(-1) == labels) & (labels != IGNORE)).sum()
        return loss / totals[self.term], {"task_loss": float(loss.detach()), "task_correct": float(correct)}

    def predict(self, records, features, outputs):
        preds = []
        for feat, out in zip(features, outputs):
            best = out.argmax(-1)
            preds.append([self.labels[int(best[p])] if 0 <= p < len(best) else self.fallback for p in feat["_first"]])
        return preds

    def reference(self, rec: Record):
        return self.tags(rec, len(self.words(rec)))

    def baseline_predictions(self, train, records):
        """The most frequent training tag, for every word."""
        tag, share = most_common(t for r in train for t in self.reference(r))
        return ([[tag] * len(self.words(r)) for r in records],
                f"every word {tag!r} (the most frequent training tag, {share:.0%} of words)")

    def prediction_json(self, rec, pred):
        return {"tokens": self.words(rec), "prediction": pred}


def _tags(rec: Record, field: str) -> list[str]:
    """A record's tags as strings (a string: split at whitespace); an empty tag is refused, naming the word."""
    tags = get_field(rec, field, (list, str), what="one tag per word")
    tags = [str(t) for t in (tags.split() if isinstance(tags, str) else tags)]
    for i, tag in enumerate(tags):
        label_text(rec, field, tag, what=f"tag of word {i + 1}", expected="a tag such as O or B-PER")
    return tags
