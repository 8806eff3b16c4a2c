"""Extractive question answering (SQuAD 1.1 / 2.0): predict the answer's start and end tokens.

Records hold ``context``, ``question`` and ``answers`` — SQuAD's ``{"text": [...], "answer_start": [...]}``,
a list of ``{"text", "answer_start"}``, a list of strings, or one string; an empty list means the
question has no answer in the context (SQuAD 2.0). Long contexts are cut into overlapping windows
(``task.stride``); the best legal span over all windows wins unless the no-answer score is higher.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from ..config import ConfigError
from ..data.readers import DataError
from ..model.layout import layout_of
from . import qa_spans
from .base import Record, Task, TaskConfig, get_field

_META = ("offsets", "window", "record")


@dataclass
class QASettings(TaskConfig):
    """qa: the passage, the question, the answers, and how long contexts are windowed."""

    context_field: str = "context"  # the passage
    question_field: str = "question"  # the question
    answers_field: str = "answers"  # {"text": [...], "answer_start": [...]} (SQuAD) or a list of strings
    stride: int = 32  # context tokens shared by consecutive windows of a long context
    max_answer_len: int = 30  # longest answer span in tokens
    null_threshold: float = 0.0  # answer "" when best span score < null score + threshold (SQuAD 2.0)

    def validate(self) -> None:
        super().validate()
        if self.stride < 0 or self.max_answer_len < 1:
            raise ConfigError(f"task.stride ({self.stride}) must be >= 0 and task.max_answer_len "
                              f"({self.max_answer_len}) >= 1")


class QA(Task):
    Settings = QASettings
    name = "qa"
    model_head = "qa"
    metrics = ("exact_match", "f1")
    default_metric = "f1"

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        roles = getattr(tokenizer, "roles", None) or {}
        encoder = layout_of(model_cfg).pair_style == "bert"  # a [CLS]-style encoder (not a decoder, not T5)
        # RoBERTa/BART vocabularies: <s> question </s></s> context </s> (Hugging Face's layout); else BERT's
        self.layout = ("roberta" if encoder and roles.get("cls") == "<s>" and roles.get("sep") == "</s>" else "bert")
        # segment ids (question 0, context 1) need a second token type: RoBERTa's one type reads 0 everywhere
        self.use_types = model_cfg.token_types >= 2 and encoder and self.layout == "bert"
        try:  # the window arithmetic and the special tokens, checked before any data is read
            qa_spans._special_ids(tokenizer)
            qa_spans._budget(self.max_len, cfg.stride, 4 if self.layout == "roberta" else 3, None)
        except ValueError as e:
            raise ConfigError(f"task qa: {e} (task.max_len={cfg.max_len}, task.stride={cfg.stride}; the model "
                              f"reads at most {model_cfg.max_positions} tokens)") from None

    def answers(self, rec: Record) -> list[tuple[str, int | None]]:
        """Gold answers as (text, answer_start or None)."""
        raw = get_field(rec, self.cfg.answers_field, (dict, list, str), what="the gold answers")
        if isinstance(raw, str):
            return [(raw, None)] if raw else []
        if isinstance(raw, dict):
            texts = raw.get("text", [])
            texts = [texts] if isinstance(texts, str) else list(texts)
            starts = raw.get("answer_start")
            starts = [None] * len(texts) if starts is None else [starts] if isinstance(starts, int) else list(starts)
            if len(starts) != len(texts):
                raise DataError(f"{rec.where}: answers has {len(texts)} text(s) but {len(starts)} answer_start(s)")
            return [(str(t), s) for t, s in zip(texts, starts)]
        out = []
        for a in raw:
            if isinstance(a, dict):
                if "text" not in a:
                    raise DataError(f"{rec.where}: an answer object needs a 'text' key, got {a!r:.80}")
                out.append((str(a["text"]), a.get("answer_start")))
            else:
                out.append((str(a), None))
        return out

    def spans(self, rec: Record, context: str) -> list[tuple[int, int]]:
        return [qa_spans.find_answer(context, text, start, where=rec.where) for text, start in self.answers(rec)
                if text != ""]

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        context = get_field(rec, self.cfg.context_field)
        question = get_field(rec, self.cfg.question_field)
        spans = self.spans(rec, context) if labelled else []
        feats = qa_spans.qa_features(self.tok, question, context, spans, max_len=self.max_len,
                                     stride=self.cfg.stride, where=rec.where, layout=self.layout)
        out = []
        for f in feats:
            g = {"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]}
            if self.use_types:
                g["token_type_ids"] = f["token_type_ids"]
            if labelled:
                g["start_positions"] = np.int64(f["start_positions"])
                g["end_positions"] = np.int64(f["end_positions"])
            g["_offsets"] = f["offsets"]
            g["_window"] = f.get("window", 0)
            out.append(g)
        return out

    def counts(self, batch):
        return {self.term: int(batch["input_ids"].shape[0])}

    def loss(self, model, batch, totals):
        logits = self.forward_logits(model, batch).float()  # (B, T, 2)
        start, end = logits[..., 0], logits[..., 1]
        ce = nn.functional.cross_entropy
        loss = (ce(start, batch["start_positions"], reduction="sum")
                + ce(end, batch["end_positions"], reduction="sum")) / 2  # BERT: mean of start and end losses
        correct = ((start.argmax(-1) == batch["start_positions"]) & (end.argmax(-1) == batch["end_positions"])).sum()
        return loss / totals[self.term], {"task_loss": float(loss.detach()), "task_correct": float(correct)}

    def predict(self, records, features, outputs):
        by_record: dict[int, list[int]] = {}
        for i, f in enumerate(features):
            by_record.setdefault(int(f["_record"]), []).append(i)
        preds = []
        for r, rec in enumerate(records):
            idx = by_record.get(r, [])
            feats = [{"offsets": features[i]["_offsets"], "input_ids": features[i]["input_ids"]} for i in idx]
            starts = [outputs[i][:, 0] for i in idx]
            ends = [outputs[i][:, 1] for i in idx]
            text, _ = qa_spans.decode_answer(feats, starts, ends, get_field(rec, self.cfg.context_field),
                                             max_answer_len=self.cfg.max_answer_len,
                                             null_threshold=self.cfg.null_threshold)
            preds.append(text)
        return preds

    def reference(self, rec: Record):
        return [t for t, _ in self.answers(rec) if t != ""]

    def baseline_predictions(self, train, records):
        """No answer, for every question (SQuAD 2.0's floor: it scores only the unanswerable ones)."""
        return [""] * len(records), "always no answer"

    def prediction_json(self, rec, pred):
        return {"question": get_field(rec, self.cfg.question_field), "prediction": pred}
