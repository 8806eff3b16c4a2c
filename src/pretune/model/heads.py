"""Heads that turn hidden states into outputs. They live beside the transformer, never inside it."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import ACTIVATIONS, make_norm

IGNORE_INDEX = -100  # a target that is not scored (transformers' ignore_index)


class LMHead(nn.Module):
    """Next-token logits: a linear map to the vocabulary, usually tied to the token embedding, plus a fixed bias
    when ``logit_bias`` (BART's final_logits_bias: a buffer, not a parameter, so training leaves it as it is)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        self.scale = cfg.dim ** -0.5 if cfg.tie_embeddings and cfg.tied_logit_scale else None
        e = cfg.embedding_dim
        self.proj = nn.Linear(cfg.dim, e, bias=False) if e != cfg.dim else None  # factorised: dim -> E
        self.weight = embed.weight if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, e))
        if not cfg.tie_embeddings:
            nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("bias", torch.zeros(cfg.vocab_size) if cfg.logit_bias else None)  # (vocab,) or None

    fusable = True  # logits = linear((h * scale) proj, weight, bias): a loss may fuse the last matmul with softmax

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T, vocab)."""
        if self.scale is not None:
            h = h * self.scale  # T5 v1.0: rescale before the tied output layer (Mesh TF)
        if self.proj is not None:
            h = self.proj(h)
        return nn.functional.linear(h, self.weight, self.bias)

    def cross_entropy(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of h (N, dim) against targets (N,) (-100 ignored); 0 with zero gradients
        when no target is left (where ``F.cross_entropy`` would give NaN)."""
        if not bool((targets != IGNORE_INDEX).any()):
            return h.sum() * 0.0
        return nn.functional.cross_entropy(self(h).float(), targets, ignore_index=IGNORE_INDEX)

    def token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(target) of each row of h (N, dim) under softmax(logits / temperature), in fp32 (N,): the logit less
        the row's logsumexp (TRL's ``selective_log_softmax``; on a CPU, fp32 ``cross_entropy`` over a 49k vocabulary
        runs ~1e-5 nats a token high against fp64, which summed over a completion shows; this way is within ~1e-7).
        What preference tuning and GRPO train on."""
        logits = self(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=1)


class SoftCappedLMHead(LMHead):
    """Differs from LMHead: the logits are squashed into (-c, c) as c * tanh(z / c) (Gemma 2's
    final_logit_softcapping), so a loss cannot fuse the linear map with its softmax (``fusable`` is False)."""

    fusable = False

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__(cfg, embed)
        self.softcap = cfg.logit_softcap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T, vocab), each in (-softcap, softcap)."""
        return torch.tanh(super().forward(h) * (1.0 / self.softcap)) * self.softcap


def lm_head(cfg: ModelConfig, embed: nn.Embedding) -> LMHead:
    """The LM head ``cfg`` asks for: soft-capped logits when ``logit_softcap`` is set, else the plain linear map."""
    return SoftCappedLMHead(cfg, embed) if cfg.logit_softcap is not None else LMHead(cfg, embed)


class MLMHead(nn.Module):
    """BERT's masked-LM head: dense + activation + norm, then a (tied) decoder with its own bias."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        e = cfg.embedding_dim
        self.dense = nn.Linear(cfg.dim, e, bias=cfg.head_dense_bias)
        self.act = ACTIVATIONS[cfg.head_act]
        self.norm = make_norm(cfg, e)
        self.weight = embed.weight if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, e))
        if not cfg.tie_embeddings:
            nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T, vocab)."""
        return nn.functional.linear(self.norm(self.act(self.dense(h))), self.weight, self.bias)


class HeadTransform(nn.Module):
    """norm(act(dense(x))) before a task head's output layer (``head_transform``; ModernBERT's prediction head).
    Its tensors: ``head.transform.dense`` and ``head.transform.norm``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim, bias=cfg.head_dense_bias)
        self.act = ACTIVATIONS[cfg.head_act]
        self.norm = make_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., dim) -> (..., dim)."""
        return self.norm(self.act(self.dense(x)))


class Pooler(nn.Module):
    """BERT pooler: tanh(W h_[CLS] + b), the sentence vector BERT's NSP head was trained on."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))  # (B, dim)


def pool(h: torch.Tensor, attention_mask: torch.Tensor | None, how: str) -> torch.Tensor:
    """One vector per sequence from hidden states h (B, T, dim): ``cls`` the first token, ``mean`` the
    mean over real tokens, ``last`` the last real token (works with left or right padding)."""
    if how == "cls" or how == "pooler":
        return h[:, 0]
    if attention_mask is None:
        return h.mean(1) if how == "mean" else h[:, -1]
    m = attention_mask.to(h.dtype)
    if how == "mean":
        return (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)
    idx = (attention_mask.long() * torch.arange(h.shape[1], device=h.device)).argmax(1)  # last 1 in each row
    return h[torch.arange(h.shape[0], device=h.device), idx]


def last_eos(input_ids: torch.Tensor | None, eos: int) -> torch.Tensor:
    """(B,) position of the last ``eos`` in each row of input_ids (B, T), the token BART classifies; a row
    without one raises ValueError naming it."""
    if input_ids is None:
        raise ValueError("pooling='eos' needs the input_ids (it classifies the state at each row's last EOS)")
    is_eos = input_ids == eos  # (B, T)
    found = is_eos.any(1)
    if not bool(found.all()):
        row = int((~found).nonzero()[0, 0])
        raise ValueError(f"pooling='eos': row {row} of input_ids has no EOS token (id {eos}); end every input "
                         "with it, as BART's tokenizer does")
    return (is_eos.long() * torch.arange(input_ids.shape[1], device=input_ids.device)).argmax(1)


class SequenceHead(nn.Module):
    """Classification (num_labels logits) or regression (one value) from one vector per sequence.

    The layout follows the family's reference head so checkpoints move to and from HF:
      pooler -> dropout -> out           (BertForSequenceClassification: on the BERT pooler output)
      cls    -> dropout -> dense -> tanh -> dropout -> out   (RobertaForSequenceClassification; cls_act='gelu':
                                                         ElectraForSequenceClassification)
      mean   -> dropout -> out
      last   -> out (no bias)            (GPT2/LlamaForSequenceClassification: last real token)
      eos    -> dropout -> dense -> tanh -> dropout -> out   (BartForSequenceClassification: each row's last EOS)
    With ``head_transform`` the pooled vector (cls or mean) passes dense -> head_act -> norm, then dropout -> out
    (ModernBertForSequenceClassification), in place of cls's dense + tanh.
    """

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding | None = None):
        super().__init__()
        self.pooling = cfg.sentence_pooling
        p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        self.drop = nn.Dropout(p)
        self.transform = HeadTransform(cfg) if cfg.head_transform else None
        dense = self.pooling in ("cls", "eos") and self.transform is None
        self.dense = nn.Linear(cfg.dim, cfg.dim) if dense else None
        self.act = ACTIVATIONS[cfg.cls_act]
        self.out = nn.Linear(cfg.dim, cfg.num_labels, bias=self.pooling != "last")
        self.eos = cfg.eos_token_id

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pooled: torch.Tensor | None = None, *, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """h: (B, T, dim) -> (B, num_labels); ``pooled`` is the BERT pooler output when pooling='pooler';
        ``input_ids`` (B, T) the tokens whose last EOS is read when pooling='eos'."""
        if self.pooling == "eos":
            x = h[torch.arange(h.shape[0], device=h.device), last_eos(input_ids, self.eos)]  # (B, dim)
        else:
            x = pooled if self.pooling == "pooler" else pool(h, attention_mask, self.pooling)
        if self.transform is not None:
            x = self.transform(x)
        if self.dense is not None:
            x = self.act(self.dense(self.drop(x)))
        if self.pooling != "last":
            x = self.drop(x)
        return self.out(x)


class TokenHead(nn.Module):
    """One set of logits per token: tagging (num_labels) or extractive QA (2: start, end).
    dropout -> out, as BertForTokenClassification (QA heads have no dropout, as BertForQuestionAnswering); with
    ``head_transform``: dense -> head_act -> norm -> dropout -> out (ModernBertForTokenClassification and
    ModernBertForQuestionAnswering, whose QA head has the dropout too)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding | None = None):
        super().__init__()
        p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        self.transform = HeadTransform(cfg) if cfg.head_transform else None
        self.drop = nn.Dropout(0.0 if cfg.head == "qa" and self.transform is None else p)
        self.out = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pooled: torch.Tensor | None = None, *, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """h: (B, T, dim) -> (B, T, num_labels)."""
        if self.transform is not None:
            h = self.transform(h)
        return self.out(self.drop(h))


class RTDHead(nn.Module):
    """ELECTRA's discriminator head (replaced-token detection): dense + head_act, then one logit per token,
    > 0 meaning "replaced" (ElectraDiscriminatorPredictions)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding | None = None):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.act = ACTIVATIONS[cfg.head_act]
        self.out = nn.Linear(cfg.dim, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: (B, T, dim) -> logits (B, T)."""
        return self.out(self.act(self.dense(h))).squeeze(-1)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Mean binary cross-entropy over the real tokens (labels 1 = replaced), as ElectraForPreTraining."""
        logits, labels = logits.float(), labels.to(logits.device).float()
        if attention_mask is not None:
            real = attention_mask.bool()
            logits, labels = logits[real], labels[real]
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


HEADS = {"lm": lm_head, "mlm": MLMHead, "rtd": RTDHead, "classification": SequenceHead, "regression": SequenceHead,
         "tagging": TokenHead, "qa": TokenHead}
