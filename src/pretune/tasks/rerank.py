"""A reranker (a cross-encoder): a (query, document) pair read together → one relevance score.

Records (field names are settings), one kind per file:

    {"query": "...", "positive": "...", "negative": "..." | [...]}   a query, its relevant document and irrelevant ones
    {"query": "...", "document": "...", "label": 1}                   one judged pair (a number: 0 irrelevant, 1
                                                                        relevant, or a graded relevance)

Each pair is one input, ``[CLS] query [SEP] document [SEP]`` on an encoder (the pair layout of the sentence tasks), and
the model's ``regression`` head (one output) scores it, as transformers' ``*ForSequenceClassification`` with
``num_labels=1`` does, so the exported folder is what ``sentence_transformers.CrossEncoder(folder)`` loads. Losses:

    bce       judged pairs: binary cross-entropy of sigmoid(score) against the label (ST's BinaryCrossEntropyLoss),
              the mean over pairs
    listwise  a query with its positive and negatives: -log softmax(scores)[positive] over its own candidates (ST's
              ListNetLoss with a one-hot target), the mean over queries

Evaluation reranks each query's candidates (a query's records are grouped by its text for judged pairs) by score:
ndcg@10 (gain = the label), mrr@10 (the first relevant one) and map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..data.readers import DataError
from .base import Layout, Record, Task, TaskConfig, get_field, get_number, same_kind


@dataclass
class RerankSettings(TaskConfig):
    """rerank: the record fields and the loss."""

    query_field: str = "query"  # the query
    positive_field: str = "positive"  # listwise records: the relevant document
    negative_field: str = "negative"  # listwise records: an irrelevant document, or a list of them
    document_field: str = "document"  # judged pairs: the document
    label_field: str = "label"  # judged pairs: its relevance (a number; > 0 counts as relevant)
    rerank_loss: Literal["auto", "bce", "listwise"] = "auto"  # auto: listwise for query/positive/negative records,
    # bce for judged pairs

    def validate(self) -> None:
        super().validate()


def rerank_metrics(groups: list[list[tuple[float, float]]]) -> dict:
    """ndcg@10, mrr@10 and map over queries, each a list of (score, relevance) of its candidates; queries with no
    relevant candidate are left out (no ranking can find what is not there). Ties keep the candidates' order."""
    ndcg, mrr, ap = [], [], []
    for group in groups:
        rel = np.array([r for _, r in group], dtype=np.float64)
        if not (rel > 0).any():
            continue
        order = np.argsort(-np.array([s for s, _ in group]), kind="stable")
        ranked = rel[order]
        discounts = 1.0 / np.log2(np.arange(2, len(ranked) + 2))
        ideal = np.sort(rel)[::-1]
        ndcg.append(float((ranked[:10] * discounts[:10]).sum() / (ideal[:10] * discounts[:10]).sum()))
        first = int(np.argmax(ranked > 0))
        mrr.append(1.0 / (first + 1) if first < 10 else 0.0)
        hits = np.cumsum(ranked > 0)
        ap.append(float(np.mean([hits[i] / (i + 1) for i in np.flatnonzero(ranked > 0)])))
    if not ndcg:
        return {}
    return {"ndcg@10": float(np.mean(ndcg)), "mrr@10": float(np.mean(mrr)), "map": float(np.mean(ap))}


class Rerank(Task):
    """Differs from pair: a one-output head scores (query, document) pairs, trained to rank, not to classify."""

    Settings = RerankSettings
    name = "rerank"
    model_head = "regression"
    why = "a cross-encoder scores a (query, document) pair with a one-output head;"
    term = "rerank"
    metrics = ("ndcg@10", "mrr@10", "map")
    default_metric = "ndcg@10"
    folder_kind = "CrossEncoder"  # what the run's model/ is (write_model_files)

    def __init__(self, cfg: RerankSettings, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.pair_layout = Layout(tokenizer, model_cfg)
        self.kind: str | None = None  # "listwise" or "judged", fixed by the first record read

    @classmethod
    def head_config(cls, cfg, labels):
        return {"head": "regression", "num_labels": 1, "labels": None}

    # -- records -> features ----------------------------------------------------------------------------------
    def _text(self, rec: Record, name: str) -> str:
        text = get_field(rec, name)
        if not text.strip():
            raise DataError(f"{rec.where}: field {name!r} is empty")
        return text

    def _pair(self, query: list[int], doc: str) -> dict:
        return self.pair_layout.build(query, self.tok.encode(doc), self.max_len)

    def _kind_of(self, rec: Record) -> str:
        c = self.cfg
        if c.positive_field in rec.data or c.negative_field in rec.data:
            kind = "listwise"
        elif c.document_field in rec.data:
            kind = "judged"
        else:
            have = ", ".join(sorted(map(str, rec.data))) or "none"
            raise DataError(f"{rec.where}: expected {c.query_field!r} with {c.positive_field!r} and "
                            f"{c.negative_field!r}, or with {c.document_field!r} and {c.label_field!r}; the record "
                            f"has: {have}")
        self.kind = same_kind(rec, kind, self.kind)
        return kind

    def _negatives(self, rec: Record) -> list[str]:
        name = self.cfg.negative_field
        value = get_field(rec, name, (str, list), what="a document or a list of documents")
        texts = [value] if isinstance(value, str) else value
        if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
            raise DataError(f"{rec.where}: field {name!r} should hold non-empty texts, got {value!r:.60}")
        return texts

    def _label(self, rec: Record) -> float:
        return get_number(rec, self.cfg.label_field, what="a number: the document's relevance")

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        c = self.cfg
        query = self.tok.encode(self._text(rec, c.query_field))
        if self._kind_of(rec) == "listwise":
            docs = [self._text(rec, c.positive_field)] + self._negatives(rec)
            labels = [1.0] + [0.0] * (len(docs) - 1)
        else:
            docs = [self._text(rec, c.document_field)]
            labels = [self._label(rec) if labelled or c.label_field in rec.data else float("nan")]
        pairs = [self._pair(query, d) for d in docs]
        return [{"input_ids": pairs[0]["input_ids"], "pairs": pairs, "labels": np.asarray(labels, np.float32)}]

    def example(self, block, rng, random_block):
        return {k: v for k, v in block.items() if not k.startswith("_")}

    def collate(self, examples):
        """B examples -> every candidate pair as a row, right-padded: input_ids, attention_mask (token_type_ids) (R,
        T); labels (R,); group (R,) the example each row belongs to."""
        rows = [p for e in examples for p in e["pairs"]]
        out = super(Task, self).collate(rows)  # the Objective's padding of input_ids / attention_mask / token types
        out["labels"] = torch.from_numpy(np.concatenate([e["labels"] for e in examples]))
        out["group"] = torch.tensor([k for k, e in enumerate(examples) for _ in e["pairs"]])
        return out

    # -- model side -------------------------------------------------------------------------------------------
    def scores(self, model, batch) -> torch.Tensor:
        """(R,) each pair's score in fp32."""
        return self.forward_logits(model, batch).float().squeeze(-1)

    def _loss_kind(self) -> str:
        if self.cfg.rerank_loss != "auto":
            return self.cfg.rerank_loss
        return "listwise" if self.kind == "listwise" else "bce"

    def counts(self, batch):
        # bce: a mean over pairs; listwise: a mean over queries
        return {self.term: int(batch["labels"].numel() if self._loss_kind() == "bce" else batch["group"].max() + 1)}

    def loss(self, model, batch, totals):
        s = self.scores(model, batch)
        labels, group = batch["labels"].float(), batch["group"]
        if self._loss_kind() == "bce":
            total = F.binary_cross_entropy_with_logits(s, labels, reduction="sum")
            correct = ((s > 0) == (labels > 0.5)).sum()
        else:
            if self.kind != "listwise":
                raise ConfigError("task.rerank_loss=listwise needs records with a positive and negatives")
            B = int(group.max()) + 1
            width = int(torch.bincount(group, minlength=B).max())
            start = torch.searchsorted(group, torch.arange(B, device=group.device))  # each group's first row
            col = torch.arange(group.numel(), device=group.device) - start[group]  # (R,) position in its group
            m = s.new_full((B, width), float("-inf"))
            m[group, col] = s
            per = torch.logsumexp(m, dim=1) - m[:, 0]  # the positive is each group's first candidate
            total = per.sum()
            correct = (m.argmax(1) == 0).sum()
        stats = {f"{self.term}_loss": float(total.detach()), f"{self.term}_correct": float(correct)}
        return total / totals[self.term], stats

    def write_model_files(self, model, tokenizer, model_dir, log=print) -> list[str]:
        """The run's ``model/`` as a Hugging Face ``*ForSequenceClassification`` folder with one label, which
        ``sentence_transformers.CrossEncoder(model_dir)`` loads; pretune reads it as a Hugging Face folder. A model
        whose head no Hugging Face class computes (e.g. BERT without its pooler) stays a pretune checkpoint, and
        ``log`` says why."""
        from ..interop import InteropError
        from ..interop.st_folder import write_hf_in_place

        try:
            return write_hf_in_place(model, tokenizer, model_dir, max_seq_length=self.max_len)
        except InteropError as e:
            log(f"model/ stays a pretune checkpoint (pretune evaluate reads it), not a CrossEncoder folder: {e}")
            return []

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        """Per example: its candidates' scores (float64)."""
        s = self.scores(model, batch).double().cpu().numpy()
        group = batch["group"].cpu().numpy()
        return [s[group == k] for k in range(int(group.max()) + 1)]

    def predict(self, records, features, outputs):
        return [[float(x) for x in o] for o in outputs]

    def reference(self, rec: Record):
        c = self.cfg
        if self.kind == "listwise":
            return {"query": rec.data.get(c.query_field), "labels": [1.0] + [0.0] * len(self._negatives(rec))}
        label = rec.data.get(c.label_field)
        return {"query": rec.data.get(c.query_field), "labels": [float(label) if label is not None else float("nan")]}

    def score(self, predictions, references):
        if self.kind == "listwise":
            groups = [list(zip(p, r["labels"])) for p, r in zip(predictions, references)]
        else:  # judged pairs: a query's candidates are its records
            by_query: dict = {}
            for p, r in zip(predictions, references):
                by_query.setdefault(r["query"], []).append((p[0], r["labels"][0]))
            groups = list(by_query.values())
        return rerank_metrics(groups)

    def prediction_json(self, rec: Record, pred) -> dict:
        return {"scores": pred}
