"""Encoder objectives: masked LM (BERT/RoBERTa, whole-word, SpanBERT), NSP (BERT), SOP (ALBERT), ELECTRA."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import ConfigError
from .base import IGNORE, Objective, Settings, _in_unit, require, summed_ce, with_specials
from .masking import mlm_example, sentence_pair

_HINT = "train a WordPiece (BERT specials) or BPE (RoBERTa specials) tokenizer with `pretune tokenizer train`"


@dataclass
class MaskingSettings(Settings):
    """Masked LM (mlm, nsp, sop): which tokens are masked and how."""

    rate: float = 0.15  # share of tokens selected for prediction (BERT: 15%)
    mask_prob: float = 0.8  # of the selected tokens: replaced by [MASK] (BERT: 80%)
    random_prob: float = 0.1  # ... replaced by a random token (10%); the rest stay unchanged
    dynamic: bool = True  # new masks every time a block is seen (RoBERTa) vs the same ones every epoch (static)
    whole_word: bool = False  # mask all subwords of a chosen word together
    span_masking: bool = False  # SpanBERT: mask spans of whole words, lengths ~ Geometric(0.2) clipped at 10

    def validate(self):
        _in_unit(self, "rate", low_open=True)
        if self.mask_prob + self.random_prob > 1.0 + 1e-9 or min(self.mask_prob, self.random_prob) < 0:
            raise ConfigError(f"objective.mask_prob ({self.mask_prob}) + random_prob ({self.random_prob}) must be "
                              "within [0, 1]")


@dataclass
class ElectraSettings(MaskingSettings):
    """ELECTRA: the generator's masked LM plus replaced-token detection."""

    electra_lambda: float = 50.0  # weight of the replaced-token-detection loss (Clark et al. 2020: 50)
    generator_scale: float = 0.25  # generator width (dim, ffn, heads) as a fraction of the discriminator's

    def validate(self):
        super().validate()
        if self.electra_lambda < 0:
            raise ConfigError(f"objective.electra_lambda={self.electra_lambda} must be >= 0")
        if not 0 < self.generator_scale <= 1:
            raise ConfigError(f"objective.generator_scale={self.generator_scale} must be in (0, 1]")


class MaskedLM(Objective):
    """BERT: select 15% of tokens; 80% → [MASK], 10% → random, 10% kept; predict the originals."""

    name = "mlm"
    Settings = MaskingSettings
    head = "mlm"
    archs = ("encoder",)
    why = "masked LM predicts tokens from both sides, so it needs a bidirectional encoder (a decoder-only model " \
          "only sees the left context; use clm or prefix_lm there);"

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        self.cls = require(tokenizer, "cls", self.name, _HINT)
        self.sep = require(tokenizer, "sep", self.name, _HINT)
        self.mask = require(tokenizer, "mask", self.name, _HINT)
        needs_words = cfg.whole_word or cfg.span_masking
        self.word_start_vocab = tokenizer.word_start_mask() if needs_words else None
        self.vocab_size = min(tokenizer.vocab_size, model_cfg.vocab_size)

    def n_special_tokens(self) -> int:
        return 2  # [CLS] block [SEP]

    def mask_tokens(self, ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        c = self.cfg
        return mlm_example(ids, rng, rate=c.rate, mask_id=self.mask, vocab_size=self.vocab_size,
                           special_ids=self.special_ids, word_start_vocab=self.word_start_vocab,
                           whole_word=c.whole_word, span=c.span_masking, mask_prob=c.mask_prob,
                           random_prob=c.random_prob)

    def example(self, block, rng, random_block):
        ids = with_specials(block.tokens, self.cls, self.sep)
        corrupted, labels = self.mask_tokens(ids, rng)
        return {"input_ids": corrupted, "attention_mask": np.ones_like(ids), "labels": labels}

    def counts(self, batch):
        return {"mlm": int((batch["labels"] != IGNORE).sum())}

    def _mlm(self, model, batch, input_ids=None):
        h = model.transformer.encode(batch["input_ids"] if input_ids is None else input_ids, batch["attention_mask"],
                                     batch.get("token_type_ids"))  # (B, T, dim)
        selected = batch["labels"] != IGNORE  # (B, T)
        s, correct = summed_ce(model.head(h[selected]), batch["labels"][selected])  # head on ~15% of positions only
        return h, s, correct

    def loss(self, model, batch, totals):
        _, s, correct = self._mlm(model, batch)
        return s / totals["mlm"], {"mlm_loss": float(s.detach()), "mlm_correct": float(correct)}


class SentencePairMLM(MaskedLM):
    """BERT NSP / ALBERT SOP: [CLS] A [SEP] B [SEP] with segment ids; MLM + a 2-way head on the pooled [CLS]."""

    name = "nsp"
    task = "nsp"

    def __init__(self, cfg, model_cfg, tokenizer):
        super().__init__(cfg, model_cfg, tokenizer)
        dim = model_cfg.dim
        self.pooler = None if model_cfg.pooler else nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        # the model's own pair head (pair_head: ALBERT presets) is trained and exported with it (AlbertForPreTraining);
        # else a pretraining-only classifier, saved with the training state
        self.classifier = None if model_cfg.pair_head else nn.Linear(dim, 2)

    def n_special_tokens(self) -> int:
        return 3

    def example(self, block, rng, random_block):
        sents = _sentences(block)
        budget = self.block_size(self.model_cfg.max_seq_len)
        a, b, label = sentence_pair(sents, rng, task=self.task, max_tokens=budget,
                                    random_sentences=lambda r: _sentences(random_block(r)))
        ids = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]]).astype(np.int64)
        types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)])
        corrupted, labels = self.mask_tokens(ids, rng)
        return {"input_ids": corrupted, "attention_mask": np.ones_like(ids), "token_type_ids": types,
                "labels": labels, "pair_labels": np.int64(label)}

    def counts(self, batch):
        return {"mlm": int((batch["labels"] != IGNORE).sum()), self.task: int(batch["pair_labels"].shape[0])}

    def loss(self, model, batch, totals):
        h, s, correct = self._mlm(model, batch)
        pooled = model.pooler(h) if model.pooler is not None else self.pooler(h[:, 0])  # (B, dim)
        logits = (model.pair_head if model.pair_head is not None else self.classifier)(pooled)  # (B, 2)
        s2, c2 = summed_ce(logits, batch["pair_labels"])
        loss = s / totals["mlm"] + s2 / totals[self.task]
        return loss, {"mlm_loss": float(s.detach()), "mlm_correct": float(correct),
                      f"{self.task}_loss": float(s2.detach()), f"{self.task}_correct": float(c2)}


class SentenceOrderMLM(SentencePairMLM):
    """ALBERT SOP: B is always A's continuation; half the pairs are swapped. MLM + order classification."""

    name = "sop"
    task = "sop"


def _sentences(block) -> list[np.ndarray]:
    starts = list(np.asarray(block.sent_starts, dtype=np.int64)) + [len(block.tokens)]
    return [block.tokens[s:e].astype(np.int64) for s, e in zip(starts[:-1], starts[1:]) if e > s]


class Electra(MaskedLM):
    """ELECTRA: a small MLM generator fills the masked positions with samples; the discriminator (the model
    being pretrained) labels every token original/replaced. Loss = MLM + λ·RTD (λ = 50, Clark et al. 2020).

    The discriminator's replaced-token-detection head is the model's own (head "rtd"), so the saved model is
    ElectraForPreTraining; the generator is a model of its own, saved beside it (``companions``) and exported as
    ElectraForMaskedLM."""

    name = "electra"
    Settings = ElectraSettings
    head = "rtd"  # the discriminator's head; the generator has its own MLM head
    why = "replaced-token detection classifies every token with both-side context, so it needs an encoder;"

    def __init__(self, cfg, model_cfg, tokenizer, *, model=None):
        super().__init__(cfg, model_cfg, tokenizer)
        from ..model import TransformerLM

        s = cfg.generator_scale
        heads = max(1, round(model_cfg.n_heads * s))
        dim = max(heads, int(model_cfg.dim * s) // heads * heads)
        # ElectraForMaskedLM's head: dense to the embedding width + GELU + LayerNorm, the tied decoder
        gen_cfg = model_cfg.replace(dim=dim, n_heads=heads, n_kv_heads=None, head_dim=None,
                                    ffn_dim=max(1, int(model_cfg.ffn_dim * s)), head="mlm", head_act="gelu",
                                    pooler=False, embed_dim=model_cfg.embedding_dim if model_cfg.embedding_dim != dim
                                    else None, **self.records())
        self.generator = TransformerLM(gen_cfg)  # ELECTRA: generator ~1/4 of the discriminator's width
        self.term_weights = {"rtd": cfg.electra_lambda}
        if model is not None:
            self.share_embeddings(model)

    def share_embeddings(self, model) -> None:
        """Tie the generator's token (and position/segment) embeddings to the discriminator's."""
        g, m = self.generator.transformer, model.transformer
        g.embed = m.embed
        if getattr(self.generator.head, "weight", None) is not None and self.model_cfg.tie_embeddings:
            self.generator.head.weight = m.embed.weight
        gs, ms = g.input_stack, m.input_stack
        for part in ("position", "token_type"):  # both are sized by embedding_dim, which the two share
            mod = getattr(ms, part)
            if mod is not None and any(True for _ in mod.parameters()):
                setattr(gs, part, mod)

    def records(self) -> dict:
        """ELECTRA's classification head (dense + GELU on the first token): a classifier finetuned later is
        ElectraForSequenceClassification's."""
        return {"cls_act": "gelu"}

    def companions(self) -> dict:
        return {"generator": self.generator}

    def counts(self, batch):
        return {"mlm": int((batch["labels"] != IGNORE).sum()), "rtd": int(batch["attention_mask"].sum())}

    def loss(self, model, batch, totals):
        # generator: masked LM on the corrupted input
        h, s_mlm, correct = self._mlm(self.generator, batch)
        selected = batch["labels"] != IGNORE
        with torch.no_grad():
            logits = self.generator.head(h.detach()[selected]).float()  # (N, vocab)
        original, corrupted, is_replaced = self.replace(batch, logits)
        hd = model.transformer.encode(corrupted, batch["attention_mask"])  # (B, T, dim)
        rtd_logits = model.head(hd).float()  # (B, T)
        real = batch["attention_mask"].bool()
        s_rtd = nn.functional.binary_cross_entropy_with_logits(rtd_logits[real], is_replaced[real], reduction="sum")
        rtd_correct = ((rtd_logits[real] > 0).float() == is_replaced[real]).sum()
        lam = self.cfg.electra_lambda
        loss = s_mlm / totals["mlm"] + lam * s_rtd / totals["rtd"]
        return loss, {"mlm_loss": float(s_mlm.detach()), "mlm_correct": float(correct),
                      "rtd_loss": float(s_rtd.detach()), "rtd_correct": float(rtd_correct),
                      "replaced": float(is_replaced[real].sum())}

    @staticmethod
    @torch.no_grad()
    def replace(batch, gen_logits: torch.Tensor):
        """Fill the masked positions with samples from the generator's distribution (no gradient flows
        through sampling, as in the paper). Returns (original, corrupted, is_replaced) with
        is_replaced = (corrupted != original) as float — a sample equal to the original counts as original.
        gen_logits: (N_selected, vocab) at the positions where labels != -100."""
        selected = batch["labels"] != IGNORE
        original = torch.where(selected, batch["labels"], batch["input_ids"])  # (B, T)
        sampled = torch.multinomial(torch.softmax(gen_logits.float(), -1), 1).squeeze(-1)  # (N,)
        corrupted = original.clone()
        corrupted[selected] = sampled
        return original, corrupted, (corrupted != original).float()
