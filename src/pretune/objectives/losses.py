"""Language-modelling losses computed from a TransformerLM's body and head.

Both losses apply the head only where a target exists: the causal loss drops the last position
(it has no next token), the masked loss gathers the selected ~15% of positions before the MLM head
(as BERT's original implementation does), so no logits are computed for positions without a label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.heads import LMHead

IGNORE_INDEX = -100


def causal_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy: predict w_t from w_<t.

    Args:
        model: a decoder-only TransformerLM with an LM head.
        input_ids: (B, T) token ids; labels default to input_ids (positions equal to -100 are ignored).
        attention_mask: (B, T) 1 = real token; padded positions are ignored in the loss.
    """
    h = model.transformer.decode(input_ids, attention_mask)  # (B, T, dim)
    targets = (input_ids if labels is None else labels)[:, 1:]  # (B, T-1)
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
    h = h[:, :-1].reshape(-1, h.shape[-1])  # (B*(T-1), dim)
    head = model.head
    if isinstance(head, LMHead):  # the head's own loss (a fast model's is fused with the cross-entropy)
        return head.cross_entropy(h, targets.reshape(-1))
    logits = head(h)  # (B*(T-1), vocab)
    return F.cross_entropy(logits.float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def masked_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: torch.Tensor | None = None,
                   token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over the positions whose label is not -100 (BERT's masked LM).

    Args:
        model: an encoder TransformerLM with an MLM head.
        input_ids: (B, T) corrupted input ([MASK]/random/kept tokens at the selected positions).
        labels: (B, T) original token at selected positions, -100 elsewhere.
    """
    h = model.transformer.encode(input_ids, attention_mask, token_type_ids)  # (B, T, dim)
    selected = labels != IGNORE_INDEX  # (B, T)
    logits = model.head(h[selected])  # (N_selected, vocab)
    return F.cross_entropy(logits.float(), labels[selected])
