"""Sentence embeddings (a bi-encoder): each text → one pooled, normalised vector; trained contrastively.

Records (field names are settings) come in one of two kinds per file:

    {"anchor": "...", "positive": "..."}                          a pair: the positive answers the anchor
    {"anchor": "...", "positive": "...", "negative": "..." | [...]} a triplet: one or several hard negatives
    {"text_a": "...", "text_b": "...", "score": 0.8}                a scored pair (STS): a number, higher = closer

Each text is read alone (``[CLS] text [SEP]`` on an encoder) and pooled over the last hidden states: ``mean`` over
the real tokens (what sentence-transformers' models such as all-MiniLM-L6-v2 were trained with), ``cls`` (the first
token) or ``last`` (the last real token: a decoder's only token that has seen the whole text); an empty ``task.pooling``
takes the model's own (its recorded pooling, else its family's first). The vector is L2-normalised.

Losses (sentence-transformers' definitions; ``s`` is cosine similarity times ``task.scale``):

    mnrl    pairs/triplets: for anchor i, cross-entropy of its positive among every positive and negative of the
            batch, -log softmax_j(s(a_i, d_j))[i] (van den Oord et al. 2018; Henderson et al. 2017), mean over anchors;
            task.symmetric: the mean of that and the positive's own softmax over the anchors (ST's
            directions=(query_to_doc, doc_to_query), partition_mode=per_direction)
    cosent  scored pairs: log(1 + Σ_{score_i > score_j} exp(s_j - s_i)) over the batch (Su 2022, CoSENT)
    task.matryoshka_dims=[384, 128, 64]: the loss summed over the vectors cut to each size (Kusupati et al. 2022)
    task.mini_batch=N: mnrl / cosent computed GradCache-style (Gao et al. 2021): every row embedded without a graph in
            chunks of N, the loss's gradient w.r.t. the embeddings taken once, then each chunk run again with its graph
            and back-propagated with its share; the gradients equal the uncached loss's, the memory is N rows'
    task.gather_across_ranks (torchrun, on by default): while training, every process's anchors, positives and
            negatives are gathered (the gradient flowing back to each process's own rows), so anchor i of rank r ranks
            its positive (its global index) among the positives and negatives of every process; cosent ranks every
            process's pairs against each other. The loss and the gradient then equal one process's over the whole
            train.batch_size, as DDP's every other task does; evaluation stays per process (its chunks differ)

Evaluation: pairs and triplets rank the dev set's corpus (every distinct positive and negative text) for each anchor
by cosine: recall@1/@5/@10, mrr@10, ndcg@10 and map with the record's positive as the one relevant text; scored pairs
report the Spearman correlation of cosine and score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..data.readers import DataError
from ..model.layout import layout_of
from .base import Layout, Record, Task, TaskConfig, get_field, get_number, same_kind

POOLINGS = ("mean", "cls", "last")
RETRIEVAL_METRICS = ("ndcg@10", "mrr@10", "map", "recall@1", "recall@5", "recall@10")


@dataclass
class EmbeddingSettings(TaskConfig):
    """embedding: the record fields, the pooling, and the contrastive loss's knobs."""

    anchor_field: str = "anchor"  # pairs/triplets: the query text
    positive_field: str = "positive"  # pairs/triplets: the text that answers the anchor
    negative_field: str = "negative"  # triplets (optional): a hard negative, or a list of them
    text_a_field: str = "text_a"  # scored pairs: the first text
    text_b_field: str = "text_b"  # scored pairs: the second text
    score_field: str = "score"  # scored pairs: a number, higher = more similar (any scale: cosent reads its order)
    pooling: str = ""  # mean, cls or last; empty: the model's own (MiniLM: mean), else its family's first
    normalize: bool = True  # unit-length vectors (then dot product = cosine); the losses use cosine either way
    embed_loss: Literal["auto", "mnrl", "cosent"] = "auto"  # auto: mnrl for pairs/triplets, cosent for scored pairs
    scale: float = 20.0  # cosine x scale before the softmax (1 / temperature; ST's default 20, i.e. 0.05)
    symmetric: bool = False  # mnrl: also each positive's softmax over the anchors (helps when both sides are queries)
    matryoshka_dims: list[int] = field(default_factory=list)  # sizes the vector is also trained to be cut to
    # (the loss summed over them; list the full size too); empty: off
    mini_batch: int = 0  # > 0: the cached (GradCache) loss, this many texts per forward; the batch of negatives is
    # then bounded by time, not memory; 0: one forward over the whole batch
    gather_across_ranks: bool = True  # torchrun: the in-batch negatives (and cosent's pairs) are every process's,
    # so the run equals one process with the whole batch (sentence-transformers' gather_across_devices, off there by
    # default); false: each process's batch alone (fewer negatives, no all-gather). One process: no effect

    def validate(self) -> None:
        super().validate()
        if self.pooling and self.pooling not in POOLINGS:
            raise ConfigError(f"task.pooling={self.pooling!r}: expected one of {', '.join(POOLINGS)} (empty: the "
                              "model's own)")
        if not self.scale > 0:
            raise ConfigError(f"task.scale={self.scale} must be > 0")
        if self.mini_batch < 0:
            raise ConfigError(f"task.mini_batch={self.mini_batch} must be >= 0 (0: not cached)")
        bad = [d for d in self.matryoshka_dims if not isinstance(d, int) or d < 1]
        if bad:
            raise ConfigError(f"task.matryoshka_dims={list(self.matryoshka_dims)}: sizes must be positive integers")


def retrieval_metrics(ranks: list[int]) -> dict:
    """Retrieval metrics from each query's 1-based rank of its one relevant text: recall@k (found in the top k),
    mrr@10 (1/rank within 10), ndcg@10 (1/log2(rank+1) within 10: one relevant text, so the ideal DCG is 1) and map
    (with one relevant text, average precision is 1/rank)."""
    r = np.asarray(ranks, dtype=np.float64)
    top10 = r <= 10
    return {"ndcg@10": float(np.mean(np.where(top10, 1.0 / np.log2(r + 1), 0.0))),
            "mrr@10": float(np.mean(np.where(top10, 1.0 / r, 0.0))), "map": float(np.mean(1.0 / r)),
            "recall@1": float(np.mean(r <= 1)), "recall@5": float(np.mean(r <= 5)), "recall@10": float(np.mean(top10))}


def pool(h: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, dim) hidden states, (B, T) mask -> (B, dim): mean over real tokens, the first or the last real token."""
    if pooling == "cls":
        return h[:, 0]
    if pooling == "last":
        return h[torch.arange(h.shape[0], device=h.device), mask.sum(1) - 1]
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # sentence-transformers' mean pooling


def mnrl_loss(anchors: torch.Tensor, docs: torch.Tensor, *, scale: float, symmetric: bool = False, offset: int = 0,
              all_anchors: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) per-anchor in-batch-negatives loss. anchors (B, d); docs (M, d), of which ``docs[offset + i]`` is anchor
    i's positive (one process: the B positives, then the negatives, offset 0); symmetric: each positive's softmax runs
    over ``all_anchors`` (default ``anchors``; gathered from every process, the anchors of each one)."""
    B = anchors.shape[0]
    d = F.normalize(docs, dim=-1)
    s = F.normalize(anchors, dim=-1) @ d.T * scale  # (B, M)
    idx = torch.arange(B, device=s.device) + offset
    pos = s[torch.arange(B, device=s.device), idx]  # anchor i with its positive
    log_z = torch.logsumexp(s, dim=1)
    if symmetric:  # ST per_direction: the positive's softmax over the anchors, averaged in the normaliser
        others = F.normalize(anchors if all_anchors is None else all_anchors, dim=-1)
        log_z = (log_z + torch.logsumexp(d[idx] @ others.T * scale, dim=1)) / 2
    return log_z - pos


def cosent_loss(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor, *, scale: float) -> torch.Tensor:
    """CoSENT over a batch of scored pairs: log(1 + Σ_{scores_i > scores_j} exp(s_j - s_i)), s = scale cos(a, b)."""
    s = F.cosine_similarity(a, b, dim=-1) * scale  # (B,)
    higher = scores[:, None] > scores[None, :]  # (B, B): pair i should be closer than pair j
    diff = (s[None, :] - s[:, None])[higher]  # s_j - s_i for each such (i, j)
    return torch.logsumexp(torch.cat([s.new_zeros(1), diff]), dim=0)


class Embedding(Task):
    """Differs from the sentence tasks: no head; each text is embedded alone and the loss compares the vectors."""

    Settings = EmbeddingSettings
    name = "embedding"
    model_head = "none"
    why = "a bi-encoder pools a model's hidden states into one vector per text;"
    term = "embed"
    metrics = RETRIEVAL_METRICS + ("spearman",)
    default_metric = "ndcg@10"
    folder_kind = "sentence-transformers"  # what the run's model/ is (write_model_files)

    def __init__(self, cfg: EmbeddingSettings, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.backward_in_passes = bool(cfg.mini_batch)  # the cached loss back-propagates chunk by chunk: the trainer
        # averages the gradients over the processes itself, after the last chunk (DDP would after the first)
        self.model_layout = layout_of(model_cfg)
        allowed = self.model_layout.poolings
        if not cfg.pooling:
            own = model_cfg.pooling
            self.pooling = own if own in POOLINGS and own in allowed else allowed[0]
        elif cfg.pooling not in allowed:
            raise ConfigError(f"task.pooling={cfg.pooling} does not apply to {self.model_layout.name} models; use one "
                              f"of {', '.join(allowed)}")
        else:
            self.pooling = cfg.pooling
        too_big = [d for d in cfg.matryoshka_dims if d > model_cfg.dim]
        if too_big:
            raise ConfigError(f"task.matryoshka_dims={list(cfg.matryoshka_dims)}: {too_big} exceed the model's "
                              f"embedding size {model_cfg.dim}")
        self.text_layout = Layout(tokenizer, model_cfg)
        self.kind: str | None = None  # "pairs" or "scored", fixed by the first record read

    # -- records -> token ids ---------------------------------------------------------------------------------
    def _text(self, rec: Record, name: str) -> np.ndarray:
        text = get_field(rec, name)
        if not text.strip():
            raise DataError(f"{rec.where}: field {name!r} is empty")
        return self.text_layout.build(self.tok.encode(text), None, self.max_len)["input_ids"]

    def _kind_of(self, rec: Record) -> str:
        c = self.cfg
        if c.anchor_field in rec.data:
            kind = "pairs"
        elif c.text_a_field in rec.data:
            kind = "scored"
        else:
            have = ", ".join(sorted(map(str, rec.data))) or "none"
            raise DataError(f"{rec.where}: expected {c.anchor_field!r} and {c.positive_field!r} (pairs, triplets with "
                            f"{c.negative_field!r}) or {c.text_a_field!r}, {c.text_b_field!r} and {c.score_field!r} "
                            f"(scored pairs); the record has: {have}")
        if self.kind is None and kind == "scored":
            self.default_metric = "spearman"  # model selection reads the metric this data reports
        self.kind = same_kind(rec, kind, self.kind)
        return kind

    def _negatives(self, rec: Record) -> list[np.ndarray]:
        name = self.cfg.negative_field
        if name not in rec.data:
            return []
        value = get_field(rec, name, (str, list), what="a text or a list of texts")
        texts = [value] if isinstance(value, str) else value
        bad = next((t for t in texts if not isinstance(t, str) or not t.strip()), None)
        if bad is not None or not texts:
            got = bad if texts else []
            raise DataError(f"{rec.where}: field {name!r} should hold non-empty texts, got {got!r:.60}")
        ids = self.tok.encode_batch(texts)
        return [self.text_layout.build(x, None, self.max_len)["input_ids"] for x in ids]

    def _score(self, rec: Record) -> float:
        return get_number(rec, self.cfg.score_field, what="a number: how similar the two texts are")

    def encode(self, rec: Record, *, labelled: bool = True) -> list[dict]:
        c = self.cfg
        if self._kind_of(rec) == "pairs":
            anchor = self._text(rec, c.anchor_field)
            positive = self._text(rec, c.positive_field) if labelled or c.positive_field in rec.data else None
            return [{"input_ids": anchor, "positive_ids": positive, "negatives": self._negatives(rec),
                     "score": np.float32(0)}]
        a, b = self._text(rec, c.text_a_field), self._text(rec, c.text_b_field)
        score = self._score(rec) if labelled or c.score_field in rec.data else float("nan")
        return [{"input_ids": a, "positive_ids": b, "negatives": [], "score": np.float32(score)}]

    def example(self, block, rng, random_block):
        return {k: v for k, v in block.items() if not k.startswith("_")}

    def collate(self, examples):
        """B examples -> rows: the B anchors (text_a), then their positives (text_b) where present, then every
        negative in example order, right-padded: input_ids, attention_mask (R, T); score (B,); n_docs (B,) how many
        rows each example has after its anchor (its positive and negatives); has_positive (B,)."""
        docs = [e["positive_ids"] for e in examples if e["positive_ids"] is not None]
        rows = [e["input_ids"] for e in examples] + docs + [n for e in examples for n in e["negatives"]]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        n_docs = [(e["positive_ids"] is not None) + len(e["negatives"]) for e in examples]
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                "score": torch.tensor([float(e["score"]) for e in examples], dtype=torch.float32),
                "n_docs": torch.tensor(n_docs, dtype=torch.long),
                "has_positive": torch.tensor([e["positive_ids"] is not None for e in examples])}

    def write_model_files(self, model, tokenizer, model_dir, log=print) -> list[str]:
        """Make the run's ``model/`` a sentence-transformers folder with this task's pooling, normalisation and max
        length (``SentenceTransformer(model_dir)`` loads it; pretune reads it as a Hugging Face folder). A model
        no Hugging Face class holds stays a pretune checkpoint, and ``log`` says why."""
        from ..interop import InteropError
        from ..interop.st_folder import write_st_folder

        try:
            return write_st_folder(model, tokenizer, model_dir, pooling=self.pooling, normalize=self.cfg.normalize,
                                   max_seq_length=self.max_len)
        except InteropError as e:
            log(f"model/ stays a pretune checkpoint (pretune embed reads it), not a sentence-transformers folder: {e}")
            return []

    # -- model side -------------------------------------------------------------------------------------------
    def embed(self, model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(R, T) token rows -> (R, dim) fp32 sentence vectors (pooled; normalised when task.normalize)."""
        h = self.model_layout.packed_hidden_states(model, ids, mask).float()  # (R, T, dim); texts end to end
        v = pool(h, mask, self.pooling)
        return F.normalize(v, dim=-1) if self.cfg.normalize else v

    def _loss_kind(self, batch) -> str:
        if self.cfg.embed_loss != "auto":
            return self.cfg.embed_loss
        return "cosent" if self.kind == "scored" else "mnrl"

    def counts(self, batch):
        # cosent is one number per batch (its pairs compare with each other); mnrl a mean over anchors
        return {self.term: 1 if self._loss_kind(batch) == "cosent" else int(batch["n_docs"].shape[0])}

    def loss_from_embeddings(self, emb: torch.Tensor, batch, *, gather: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the loss summed over the batch's anchors (cosent: the batch's one value), the number of anchors whose
        positive scored highest (None for cosent)) from the (R, dim) embeddings of the collated rows, summed over
        task.matryoshka_dims when set. ``gather`` (training under torchrun with task.gather_across_ranks): the
        candidates are every process's rows (the sum still over this process's anchors; cosent's value is the whole
        batch's, the same on every process, and counts once per process)."""
        B = batch["n_docs"].shape[0]
        kind = self._loss_kind(batch)
        if not bool(batch["has_positive"].all()):
            raise DataError(f"the {kind} loss needs a positive (text_b) for every anchor (text_a)")
        if kind == "cosent" and self.kind != "scored":
            raise ConfigError("task.embed_loss=cosent trains on scored pairs (text_a, text_b, score); the data holds "
                              "pairs")
        dist = self.dist if gather and self.cfg.gather_across_ranks and self.dist is not None else None
        if dist is not None and not dist.enabled:
            dist = None
        if kind == "cosent":
            a, b, scores = emb[:B], emb[B:2 * B], batch["score"].float()
            if dist is not None:
                a, b = (torch.cat(x) for x in dist.gather_with_grad(a, b))
                scores = torch.cat(dist.gather_with_grad(scores[:, None].to(emb))[0])[:, 0].float()
            total = emb.new_zeros(())
            for dim in self.cfg.matryoshka_dims or [emb.shape[1]]:
                total = total + cosent_loss(a[:, :dim], b[:, :dim], scores, scale=self.cfg.scale)
            return total, None
        anchors, all_anchors, docs, offset = emb[:B], None, emb[B:], 0
        if dist is not None:  # every process's positives, then every process's negatives
            parts = (emb[B:2 * B], emb[2 * B:]) + ((anchors,) if self.cfg.symmetric else ())
            got = dist.gather_with_grad(*parts)
            docs = torch.cat(got[0] + got[1])
            offset = sum(p.shape[0] for p in got[0][:dist.rank])  # anchor i's positive is docs[offset + i]
            all_anchors = torch.cat(got[2]) if self.cfg.symmetric else None
        total, correct = emb.new_zeros(()), None
        for dim in self.cfg.matryoshka_dims or [emb.shape[1]]:
            cut = None if all_anchors is None else all_anchors[:, :dim]
            per = mnrl_loss(anchors[:, :dim], docs[:, :dim], scale=self.cfg.scale, symmetric=self.cfg.symmetric,
                            offset=offset, all_anchors=cut)
            total = total + per.sum()
            if correct is None:
                s = F.normalize(anchors[:, :dim], dim=-1) @ F.normalize(docs[:, :dim], dim=-1).T
                correct = (s.argmax(1) == torch.arange(B, device=s.device) + offset).sum()
        return total, correct

    def loss(self, model, batch, totals):
        gather = model.training  # every process runs as many training micro-batches (not so in evaluation)
        if self.cfg.mini_batch and torch.is_grad_enabled():
            total, correct = self._cached_loss(model, batch, gather=gather)
        else:
            emb = self.embed(model, batch["input_ids"], batch["attention_mask"])
            total, correct = self.loss_from_embeddings(emb, batch, gather=gather)
        stats = {f"{self.term}_loss": float(total.detach())}
        if correct is not None:
            stats[f"{self.term}_correct"] = float(correct)
        return total / totals[self.term], stats

    # -- GradCache: the gradient w.r.t. the embeddings once, then each chunk back-propagated alone -------------
    def _chunks(self, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids, mask, n = batch["input_ids"], batch["attention_mask"], self.cfg.mini_batch
        out = []
        for i in range(0, ids.shape[0], n):
            m = mask[i:i + n]
            width = max(int(m.sum(1).max()), 1)  # a chunk's rows need only its longest row's width
            out.append((ids[i:i + n, :width], m[:, :width]))
        return out

    def _cached_loss(self, model, batch, *, gather: bool = False):
        chunks = self._chunks(batch)
        states, reps = [], []
        with torch.no_grad():
            for ids, mask in chunks:
                states.append(_RandomState.save(ids.device))  # the second pass draws the same dropout
                reps.append(self.embed(model, ids, mask))
        emb = torch.cat(reps).requires_grad_()  # (R, dim) a leaf: the loss's gradient lands here
        with torch.enable_grad():
            total, correct = self.loss_from_embeddings(emb, batch, gather=gather)
            grad, = torch.autograd.grad(total, emb)  # gathered: every process's loss's share of this one's rows
        out = total.detach().requires_grad_()

        def backward_through_model(upstream: torch.Tensor) -> None:
            # called when the trainer back-propagates `out / totals`: each chunk again, with its graph
            start = 0
            for (ids, mask), state in zip(chunks, states):
                with state.restored(), torch.enable_grad():
                    e = self.embed(model, ids, mask)
                torch.autograd.backward(e, grad[start:start + e.shape[0]] * upstream)
                start += e.shape[0]

        out.register_hook(backward_through_model)
        return out, correct

    # -- evaluation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, model, batch):
        """Per example: (its anchor's vector, the vectors of its positive and negatives (n_docs, dim), its score)."""
        emb = self.embed(model, batch["input_ids"], batch["attention_mask"]).double().cpu().numpy()
        B = batch["n_docs"].shape[0]
        n_docs = batch["n_docs"].tolist()
        has_pos = [k for k in range(B) if bool(batch["has_positive"][k])]
        pos = {k: emb[B + i] for i, k in enumerate(has_pos)}
        negs, start = {}, B + len(has_pos)
        for k in range(B):
            n = n_docs[k] - (k in pos)
            negs[k], start = emb[start:start + n], start + n
        out = []
        for k in range(B):
            docs = ([pos[k]] if k in pos else []) + list(negs[k])
            out.append((emb[k], np.array(docs).reshape(len(docs), emb.shape[1]), float(batch["score"][k])))
        return out

    def predict(self, records, features, outputs):
        if self.kind == "scored":
            return [float(np.dot(a, d[0]) / max(np.linalg.norm(a) * np.linalg.norm(d[0]), 1e-12))
                    for a, d, _ in outputs]
        return self._rank(records, outputs)

    def _rank(self, records, outputs) -> list[dict]:
        """Each anchor against the corpus of every distinct positive and negative text: the top 10 texts and, when the
        record has a positive, its rank."""
        c = self.cfg
        texts, vecs, index = [], [], {}
        for rec, (_, docs, _) in zip(records, outputs):
            names = ([rec.data[c.positive_field]] if c.positive_field in rec.data else []) + self._negative_texts(rec)
            for t, v in zip(names, docs):
                if t not in index:
                    index[t] = len(texts)
                    texts.append(t)
                    vecs.append(v)
        if not texts:
            raise DataError("task embedding ranks a corpus made of the records' positives and negatives; these "
                            "records have none")
        corpus = _unit(np.array(vecs))  # (C, dim)
        queries = _unit(np.array([a for a, _, _ in outputs]))  # (Q, dim)
        sims = queries @ corpus.T  # (Q, C)
        preds = []
        for rec, row in zip(records, sims):
            order = np.argsort(-row, kind="stable")
            pred = {"top": [texts[j] for j in order[:10]]}
            if c.positive_field in rec.data:
                # rank of the positive: 1 + the texts scored strictly higher (a tie counts for the positive)
                pred["rank"] = int(1 + (row > row[index[rec.data[c.positive_field]]]).sum())
            preds.append(pred)
        return preds

    def _negative_texts(self, rec: Record) -> list[str]:
        value = rec.data.get(self.cfg.negative_field)
        return [] if value is None else [value] if isinstance(value, str) else list(value)

    def reference(self, rec: Record):
        c = self.cfg
        if self.kind == "scored":
            return float(rec.data[c.score_field]) if c.score_field in rec.data else None
        return rec.data.get(c.positive_field)

    def score(self, predictions, references):
        if self.kind == "scored":
            from .metrics import compute

            return compute(["spearman"], predictions, references)
        return retrieval_metrics([p["rank"] for p in predictions if "rank" in p])

    def prediction_json(self, rec: Record, pred) -> dict:
        return {"similarity": pred} if self.kind == "scored" else pred


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class _RandomState:
    """The random-number state before a chunk's first forward, put back for its second (GradCache's RandContext):
    dropout then masks the same units, so the recomputed graph is the one whose embeddings the loss saw."""

    def __init__(self, cpu: torch.Tensor, cuda: list | None):
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def save(cls, device: torch.device) -> _RandomState:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state_all() if device.type == "cuda" else None)

    def restored(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            cpu = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state_all() if self.cuda is not None else None
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state_all(self.cuda)
            try:
                yield
            finally:
                torch.set_rng_state(cpu)
                if cuda is not None:
                    torch.cuda.set_rng_state_all(cuda)

        return ctx()
