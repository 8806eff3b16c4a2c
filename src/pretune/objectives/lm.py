"""Language-modelling objectives: causal LM (GPT) and the shared LM-head loss used by the seq2seq ones."""

from __future__ import annotations

import numpy as np
import torch

from ..model.heads import LMHead
from .base import IGNORE, Objective, summed_ce


def lm_loss_sum(model, h: torch.Tensor, targets: torch.Tensor,
                n_valid: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of next-token cross-entropies, correct predictions or None) for hidden states h (N, dim)
    against targets (N,) with -100 ignored. A plain (tied) linear head computes the loss itself
    (``LMHead.cross_entropy``: a fast model's never builds the (N, vocab) logits); then accuracy is not computed
    (None)."""
    head = model.head
    if n_valid < 0.9 * targets.numel():  # completion-only labels (SFT): the head sees only the rows that have one
        keep = targets != IGNORE
        h, targets = h[keep], targets[keep]
    if isinstance(head, LMHead) and head.fusable and head.proj is None:  # (a fast model fuses it with the head)
        return head.cross_entropy(h, targets) * n_valid, None
    return summed_ce(head(h), targets)


class CausalLM(Objective):
    """GPT: predict w_t from w_<t over packed blocks (documents separated by EOS)."""

    name = "clm"
    head = "lm"
    archs = ("decoder",)
    why = "causal LM predicts each token from the ones before it with a single causal stack;"
    corrupts = False

    def records(self):
        return {"decoder_layout": "causal"}

    def doc_separator(self):
        return self.tok.eos_id if self.tok.eos_id is not None else self.tok.sep_id

    def example(self, block, rng, random_block):
        ids = block.tokens.astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    def counts(self, batch):
        return {"lm": int(batch["attention_mask"][:, 1:].sum())}

    def loss(self, model, batch, totals):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        h = model.transformer.decode(ids, mask)  # (B, T, dim)
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE).reshape(-1)  # (B*(T-1),)
        n = int((targets != IGNORE).sum())
        s, correct = lm_loss_sum(model, h[:, :-1].reshape(-1, h.shape[-1]), targets, n)
        stats = {"lm_loss": float(s.detach())}
        if correct is not None:
            stats["lm_correct"] = float(correct)
        return s / totals["lm"], stats
