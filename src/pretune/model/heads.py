"""Heads that turn hidden states into outputs. They live beside the transformer, never inside it."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import ACTIVATIONS, make_norm


class LMHead(nn.Module):
    """Next-token logits: a linear map to the vocabulary, usually tied to the token embedding."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        self.scale = cfg.dim ** -0.5 if cfg.tie_embeddings and cfg.tied_logit_scale else None
        e = cfg.embedding_dim
        self.proj = nn.Linear(cfg.dim, e, bias=False) if e != cfg.dim else None  # factorised: dim -> E
        self.weight = embed.weight if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, e))
        if not cfg.tie_embeddings:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T, vocab)."""
        if self.scale is not None:
            h = h * self.scale  # T5 v1.0: rescale before the tied output layer (Mesh TF)
        if self.proj is not None:
            h = self.proj(h)
        return nn.functional.linear(h, self.weight)


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense + activation + norm, then a (tied) decoder with its own bias."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        e = cfg.embedding_dim
        self.dense = nn.Linear(cfg.dim, e)
        self.act = ACTIVATIONS[cfg.head_act]
        self.norm = make_norm(cfg, e)
        self.weight = embed.weight if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, e))
        if not cfg.tie_embeddings:
            nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T, vocab)."""
        return nn.functional.linear(self.norm(self.act(self.dense(h))), self.weight, self.bias)


class Pooler(nn.Module):
    """BERT pooler: tanh(W h_[CLS] + b), the sentence vector BERT's NSP head was trained on."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))  # (B, dim)


HEADS = {"lm": LMHead, "mlm": MLMHead}
