"""TransformerLM: the Transformer body plus its head, the object ``pretune.build_model`` returns."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import TASK_HEADS, ModelConfig
from ..hooks import HOOKS
from . import fast as _fast
from .cache import KVCache
from .fast.quantized import QuantizedLinear, dequantize, quantize, quantized_bytes
from .heads import HEADS, LMHead, Pooler
from .transformer import Transformer

IGNORE = -100  # label of a position that has no target (transformers' ignore_index)

__all__ = ["TransformerLM", "ModelOutput", "KVCache", "build_model", "count_parameters", "quantize", "dequantize",
           "QuantizedLinear", "quantized_bytes"]


@dataclass
class ModelOutput:
    """What a model call returns. Shapes: B batch, T (decoder) length, S encoder length."""

    last_hidden_state: torch.Tensor  # (B, T, dim): decoder output for enc-dec, else the stack's output
    logits: torch.Tensor | None = None  # (B, T, vocab) LM/MLM head; (B, T) rtd; (B, labels) classification/regression;
    # (B, T, labels) tagging; (B, T, 2) qa (start, end)
    encoder_last_hidden_state: torch.Tensor | None = None  # (B, S, dim) encoder-decoder only
    pooler_output: torch.Tensor | None = None  # (B, dim) when the config has a BERT pooler
    pair_logits: torch.Tensor | None = None  # (B, 2) NSP/SOP logits on the pooler output (pair_head)
    past_key_values: KVCache | None = None  # the updated cache when use_cache=True
    loss: torch.Tensor | None = None  # () mean loss over the labelled targets when ``labels`` were given


class TransformerLM(nn.Module):
    """A transformer body (``self.transformer``) and the head named by ``config.head``.

    ``fast`` (default): the fast wing's modules (``model/fast/``) are swapped in after construction: the same
    parameters, names and maths in fewer passes. ``fast=False``: the reference model, one readable path per module."""

    def __init__(self, config: ModelConfig, *, fast: bool = True):
        super().__init__()
        self.config = config
        self.fast = fast
        self.transformer = Transformer(config)
        self.head = HEADS[config.head](config, self.transformer.embed) if config.head != "none" else None
        self.pooler = Pooler(config) if config.pooler else None
        # BERT NSP / ALBERT SOP: 2-way classifier on the pooled [CLS] (AlbertSOPHead.classifier)
        self.pair_head = nn.Linear(config.dim, 2) if config.pair_head else None
        self.task_head = config.head in TASK_HEADS
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layers) (Radford et al. 2019 §2.3)
        std = 0.02 / math.sqrt(2 * config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std)
        if fast:
            _fast.accelerate(self)

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty KV cache for incremental decoding with this model (``capacity``: positions to reserve per layer;
        0: grow as needed). A fast model's cache writes keys and values token-major (``model/fast/cache.py``)."""
        return _fast.FastKVCache(capacity) if self.fast else KVCache(capacity)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
    ) -> ModelOutput:
        """Run the model.

        Args:
            input_ids: (B, T) token ids (the encoder input for encoder-decoders).
            attention_mask: (B, T) 1 for real tokens, 0 for padding. With a cache, (B, T_past + T).
            token_type_ids: (B, T) segment ids (BERT sentence A = 0, B = 1).
            decoder_input_ids, decoder_attention_mask: (B, T_dec) for encoder-decoders (task heads that read the
                decoder, ``task_stack='decoder'``: by default the input shifted right, with no decoder mask, as BART).
            position_ids: (B, T) or (T,) explicit positions (e.g. left-padded generation).
            prefix_lengths: (B,) decoder-only prefix LM: the first n tokens attend bidirectionally.
            encoder_hidden_states: (B, S, dim) reuse an encoder output instead of recomputing it.
            past_key_values / use_cache: incremental decoding (see ``KVCache``).
            logits_to_keep: n > 0: language-model logits for the last n positions only, (B, n, vocab) (generation
                needs the last one: a long prompt then never materialises (T, vocab) logits); 0: every position.
                Task heads ignore it.
            labels: the targets of the head, as transformers takes them, for ``output.loss`` (a mean over the
                labelled targets, -100 ignored): a decoder's token ids aligned with ``input_ids`` (shifted inside:
                position t predicts label t + 1); masked-LM labels (-100 on the rows that were not masked; the
                head runs on the labelled rows only); an encoder-decoder's target ids (``decoder_input_ids``, if
                not given, are the labels shifted right after the decoder start token); a class id per row
                (classification; regression: a value, mean squared error; multi-label: 0/1 per label, binary
                cross-entropy); a tag id per token (tagging); 1 (replaced) or 0 per token (rtd: binary
                cross-entropy over the real tokens, as ElectraForPreTraining). A language-model head is fused with the
                cross-entropy, so the (N, vocab) logits are never built.
            return_logits: also return the logits; default (None): only when no ``labels`` are given.
        """
        cfg = self.config
        if prefix_lengths is not None and cfg.arch != "decoder":
            raise ValueError(f"prefix_lengths applies to decoder-only models (prefix LM), not arch={cfg.arch!r}")
        if token_type_ids is not None and self.transformer.input_stack.token_type is None:
            raise ValueError("token_type_ids given but the model has no token-type embeddings (token_types=0)")
        cache = past_key_values if past_key_values is not None else (self.new_cache() if use_cache else None)
        body = self.transformer
        encoder_out = None
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep ({logits_to_keep}) must be >= 0 (0: every position)")
        if cfg.arch == "encoder" or (self.task_head and cfg.arch == "encoder-decoder" and cfg.task_stack == "encoder"):
            # task heads on an encoder-decoder read the encoder (classification of the input text)
            h = body.encode(input_ids, attention_mask, token_type_ids, position_ids)
        elif cfg.arch == "decoder":
            h = body.decode(input_ids, attention_mask, position_ids=position_ids, token_type_ids=token_type_ids,
                            prefix_lengths=prefix_lengths, cache=cache)
        else:
            if decoder_input_ids is None and self.task_head:  # task_stack='decoder' (BART): the input shifted right
                decoder_input_ids = self._shift_right(input_ids)
            elif decoder_input_ids is None and labels is not None:
                decoder_input_ids = self._shift_right(labels)
            if decoder_input_ids is None:
                raise ValueError("an encoder-decoder model needs decoder_input_ids (B, T_dec)")
            encoder_out = encoder_hidden_states
            if encoder_out is None:
                encoder_out = body.encode(input_ids, attention_mask, token_type_ids)
            h = body.decode(decoder_input_ids, decoder_attention_mask, memory=encoder_out,
                            memory_mask=attention_mask, position_ids=position_ids, cache=cache)
        pooled = self.pooler(h) if self.pooler is not None else None
        pair_logits = self.pair_head(pooled) if self.pair_head is not None else None  # (B, 2)
        want_logits = labels is None if return_logits is None else return_logits
        loss = logits = None
        if self.task_head:
            logits = self.head(h, attention_mask, pooled, input_ids=input_ids)
            if labels is not None:
                loss = self._task_loss(logits, labels)
        elif cfg.head == "rtd":  # ELECTRA's discriminator: labels 1 = replaced, per token
            logits = self.head(h)
            if labels is not None:
                loss = self.head.loss(logits, labels, attention_mask)
        elif self.head is not None:
            if labels is not None:
                loss = self._lm_loss(h, labels, shift=cfg.arch == "decoder" and cfg.head == "lm")
            if want_logits:
                logits = self.head(h[:, -logits_to_keep:] if logits_to_keep else h)
        elif labels is not None:
            raise ValueError("labels given but the model has no head (head='none'): nothing to compute a loss with")
        return ModelOutput(
            last_hidden_state=h,
            logits=logits if want_logits else None,
            encoder_last_hidden_state=encoder_out,
            pooler_output=pooled,
            pair_logits=pair_logits,
            past_key_values=cache,
            loss=loss,
        )

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs of an encoder-decoder from its labels: the start token, then the labels but the last, -100
        read as padding (transformers' ``_shift_right``)."""
        start = torch.full_like(labels[:, :1], self.config.decoder_start_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == IGNORE, self.config.pad_token_id)

    def _lm_loss(self, h: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> torch.Tensor:
        """Mean cross-entropy of the LM / MLM head over the labelled positions; the head runs on those rows only."""
        if shift:  # state t predicts token t + 1
            h, labels = h[:, :-1], labels[:, 1:]
        h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1).to(h.device)
        keep = labels != IGNORE
        if not bool(keep.all()):
            h, labels = h[keep], labels[keep]
        if isinstance(self.head, LMHead):
            return self.head.cross_entropy(h, labels)
        if labels.numel() == 0:
            return h.sum() * 0.0  # nothing labelled: 0 with zero gradients (cross_entropy would give NaN)
        return nn.functional.cross_entropy(self.head(h).float(), labels)

    def _task_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' loss of a task head: MSE (regression), BCE (multi-label), else cross-entropy (-100 ignored)."""
        cfg = self.config
        if cfg.head == "qa":
            raise ValueError("a QA head's loss needs start and end positions, not labels: use pretune's qa task "
                             "(tasks/qa.py) or cross-entropy on logits[..., 0] and logits[..., 1]")
        if cfg.head == "regression":
            return nn.functional.mse_loss(logits.float().squeeze(-1), labels.float().view(-1))
        if cfg.multi_label:
            return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=IGNORE)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``pretune.generate(model, input_ids, attention_mask, **kwargs)`` as a method, for code written against
        transformers (``model.generate(ids, max_new_tokens=20)``): the same arguments, the same output.

        The generation package lies above the model (docs/architecture.md), so the method imports nothing: it
        calls ``pretune.hooks.HOOKS["generate"]``, which ``pretune/__init__.py`` registers."""
        hook = HOOKS.get("generate")
        if hook is None:
            raise RuntimeError("TransformerLM.generate delegates to pretune.generate, which is not registered "
                               "(pretune.hooks.HOOKS has no 'generate'); call pretune.generate(model, input_ids, "
                               "max_new_tokens=...) instead")
        return hook(self, input_ids, attention_mask, **kwargs)

    def num_parameters(self) -> int:
        return count_parameters(self)["total"]

    def checkpoint_blocks(self, enabled: bool = True) -> TransformerLM:
        """Activation checkpointing of every transformer block (encoder and decoder) in training: each block's
        intermediates are recomputed in the backward instead of kept. Gradients are unchanged."""
        for stack in (self.transformer.encoder, self.transformer.decoder):
            if stack is not None:
                stack.checkpoint_blocks = enabled
        return self

    def with_head(self, **fields) -> TransformerLM:
        """This body with the head that ``fields`` describe (``head`` and, for task heads, ``num_labels``,
        ``labels``, ``pooling``, ...): ``self`` when it already has that head (continued finetuning, or
        continued pretraining with the same head), else a new model with a copy of the body (and pooler) and a
        freshly initialised head; the old head is dropped, as transformers does when a task class is loaded
        from a pretrained body (e.g. MiniLM ships without its MLM head)."""
        cfg = self.config
        head = fields["head"]
        same_labels = cfg.num_labels == fields.get("num_labels") and cfg.multi_label == fields.get("multi_label", False)
        same = cfg.head == head and (head not in TASK_HEADS or same_labels)
        if same and (fields.get("pooling") is None or cfg.sentence_pooling == fields.get("pooling")):
            return self
        # the body's recorded sentence pooling (e.g. a sentence-transformers model's "mean") stays unless given
        # a pretraining pair head (NSP/SOP) goes with the MLM head it sits beside, as transformers drops it
        new = TransformerLM(cfg.replace(**{"num_labels": 0, "labels": None,
                                           "pair_head": cfg.pair_head and head == "mlm", **fields}), fast=self.fast)
        new.transformer.load_state_dict(self.transformer.state_dict())
        if self.pooler is not None and new.pooler is not None:
            new.pooler.load_state_dict(self.pooler.state_dict())
        return new


def build_model(config: ModelConfig | str, *, fast: bool = True, **overrides) -> TransformerLM:
    """A freshly initialised model from a preset name (``"bert-base"``, ``"tiny-llama"``, ...) or a
    ModelConfig, with optional field overrides (``dropout=0.0``). Unknown keys raise ConfigError. ``fast=False``:
    the reference model (no fast-wing modules; see ``TransformerLM``)."""
    from ..presets import get_preset

    if isinstance(config, str):
        cfg = get_preset(config, **overrides)
    elif isinstance(config, ModelConfig):
        cfg = config.replace(**overrides) if overrides else config
    else:
        raise TypeError(f"build_model expects a preset name or ModelConfig, got {type(config).__name__}")
    return TransformerLM(cfg, fast=fast)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts, each shared tensor counted once: total and per top-level part."""
    seen: set[int] = set()
    parts: dict[str, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        bits = name.split(".")
        part = bits[1] if bits[0] == "transformer" else bits[0]
        parts[part] = parts.get(part, 0) + p.numel()
    parts["total"] = sum(parts.values())
    return parts
