"""The transformer: Block -> Stack (encoder or decoder) -> Transformer (one, or two stacks).

Read this file first. Every family is this code with a different ModelConfig:
  BERT   = encoder stack, post-norm, learned positions, token types
  GPT-2  = decoder stack, pre-norm, learned positions
  T5     = encoder + decoder stacks (decoder with cross-attention), RMSNorm, relative bias
  Llama  = decoder stack, RMSNorm, RoPE, SwiGLU, grouped-query attention
  Gemma 2 = Llama-like, with sandwich norms, scaled embeddings, soft-capped attention, every other layer local
  DeBERTa = BERT-like without absolute positions, disentangled attention (relative position terms per layer)
The Transformer returns hidden states; heads (heads.py) turn them into logits.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import ModelConfig
from .attention import Attention, build_mask
from .cache import KVCache
from .layers import Dropout, FeedForward, make_norm
from .position import POSITIONS


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Block(nn.Module):
    """Self-attention [+ cross-attention] + FFN, each a residual branch with a norm placed
    before the branch (pre-norm: x + f(norm(x))) or after the sum (post-norm: norm(x + f(x))); sandwich: before
    the branch and on its output too (x + norm'(f(norm(x))), Gemma 2)."""

    def __init__(self, cfg: ModelConfig, *, cross: bool = False, shared: "Block | None" = None,
                 attn_norm: bool = True):
        super().__init__()
        self.pre_norm = cfg.norm_placement in ("pre", "sandwich")
        sandwich = cfg.norm_placement == "sandwich"
        if shared is None:  # T5 "enc-dec, shared": the decoder reuses the encoder block's weights
            # attn_norm=False (ModernBERT's layer 0): the attention reads x as it is (pre-norm only)
            self.attn, self.attn_norm = Attention(cfg), make_norm(cfg) if attn_norm else nn.Identity()
            self.ffn, self.ffn_norm = FeedForward(cfg), make_norm(cfg)
            self.attn_post_norm = make_norm(cfg) if sandwich else None
            self.ffn_post_norm = make_norm(cfg) if sandwich else None
        else:
            self.attn, self.attn_norm, self.attn_post_norm = shared.attn, shared.attn_norm, shared.attn_post_norm
            self.ffn, self.ffn_norm, self.ffn_post_norm = shared.ffn, shared.ffn_norm, shared.ffn_post_norm
        self.cross_attn = Attention(cfg, cross=True) if cross else None
        self.cross_norm = make_norm(cfg) if cross else None
        self.cross_post_norm = make_norm(cfg) if cross and sandwich else None
        # each branch's output passes its own dropout before the residual sum (parameter-free; a module that
        # changes a branch's output, such as a Houlsby adapter, wraps it)
        self.attn_drop, self.ffn_drop = Dropout(cfg.dropout), Dropout(cfg.dropout)
        self.cross_drop = Dropout(cfg.dropout) if cross else None

    def _residual(self, x, norm, fn, drop, post=None):
        if type(drop) is Dropout and (drop.p == 0.0 or not drop.training):  # a no-op: skip the module call
            drop = _identity
        if self.pre_norm:
            if post is not None:  # sandwich
                return x + drop(post(fn(norm(x))))
            return x + drop(fn(norm(x)))
        return norm(x + drop(fn(x)))

    def forward(self, x, *, mask, is_causal, rotate, positions, memory=None, memory_mask=None, cache=None,
                pos_scores=None):
        x = self._residual(x, self.attn_norm, lambda h: self.attn(
            h, mask=mask, is_causal=is_causal, rotate=rotate, positions=positions, cache=cache,
            pos_scores=pos_scores), self.attn_drop,
            self.attn_post_norm)
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(
                h, memory=memory, mask=memory_mask, cache=cache), self.cross_drop, self.cross_post_norm)
        return self._residual(x, self.ffn_norm, self.ffn, self.ffn_drop, self.ffn_post_norm)


class Stack(nn.Module):
    """Embedding extras (scale, token types, absolute positions, norm, ALBERT projection), a stack of
    blocks (or one block applied n times under cross-layer sharing) and a final norm. Layers in
    ``cfg.sliding_layers`` (every layer when it is None) attend within ``cfg.sliding_window`` (and rotate with
    ``cfg.rope_local_base`` when it is set)."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False, n_layers: int,
                 token_types: bool = True, shared: "Stack | None" = None):
        super().__init__()
        self.causal = causal
        self.n_layers = n_layers
        e = cfg.embedding_dim
        self.embed_scale = e ** 0.5 if cfg.scale_embeddings else None  # Gemma: token embeddings times sqrt(dim)
        self.window = cfg.sliding_window  # None: every layer attends to every key
        local = range(n_layers) if cfg.sliding_layers is None else cfg.sliding_layers
        self.local = frozenset(i for i in local if i < n_layers) if self.window is not None else frozenset()
        self.position = POSITIONS[cfg.position](cfg, causal=causal)
        # the sliding-window layers' own RoPE base (ModernBERT: 10000 locally, 160000 globally); None: self.position
        self.local_position = (POSITIONS[cfg.position](cfg.replace(rope_base=cfg.rope_local_base), causal=causal)
                               if cfg.rope_local_base is not None else None)
        self.token_type = nn.Embedding(cfg.token_types, e) if cfg.token_types and token_types else None
        self.embed_norm = make_norm(cfg, e) if cfg.embed_norm else None
        self.embed_proj = nn.Linear(e, cfg.dim) if e != cfg.dim else None  # ALBERT: E -> dim
        self.drop = Dropout(cfg.dropout)
        n_distinct = 1 if cfg.share_layers else n_layers
        if shared is not None:
            self.layers = nn.ModuleList(Block(cfg, cross=cross, shared=b) for b in shared.layers)
        else:
            self.layers = nn.ModuleList(Block(cfg, cross=cross, attn_norm=cfg.first_attn_norm or i > 0)
                                        for i in range(n_distinct))
        self.norm = make_norm(cfg) if cfg.final_norm else None
        # extra input embeddings: a callable (x, attention_mask, token_type_ids, position_ids, past) -> (x,
        # attention_mask, token_type_ids, position_ids, n_extra) that puts n_extra vectors before the input (and
        # extends the mask, types and positions); their positions are removed from the output. None: no extras.
        self.extra_inputs = None
        # activation checkpointing (a training setting, not architecture): in training with gradients on, each
        # block's activations are dropped after its forward and recomputed in the backward (non-reentrant, with the
        # dropout RNG replayed), trading about one more forward for the memory of every block's intermediates
        self.checkpoint_blocks = False

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        prefix_lengths: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x: (B, T, E) token embeddings; attention_mask: (B, T_past + T) 1 = real token;
        memory: (B, S, dim) encoder output with memory_mask (B, S). Returns (B, T, dim).
        document_ids: (B, T) examples packed in one row attend only within their document (give position_ids
        restarting at each document too); not with a cache or extra input embeddings.
        With a StaticKVCache the cache's ``key_mask`` takes the place of ``attention_mask`` (which must be None)."""
        static = getattr(cache, "static", False)
        if static and (attention_mask is not None or self.extra_inputs is not None):
            raise ValueError("a StaticKVCache carries the padding itself (key_mask): pass attention_mask=None; "
                             "extra input embeddings (prompt tuning) are not supported with it")
        past = cache.index if static else cache.length if cache is not None else 0  # (1,) tensor | int
        n_virtual = 0
        if document_ids is not None and (cache is not None or self.extra_inputs is not None):
            raise ValueError("packed rows (document_ids) cannot use a KV cache or extra input embeddings "
                             "(prefix or prompt tuning)")
        if self.embed_scale is not None:  # in the embeddings' dtype, as Gemma does (bf16: sqrt(3072) -> 55.5)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.extra_inputs is not None:
            x, attention_mask, token_type_ids, position_ids, n_virtual = self.extra_inputs(
                x, attention_mask, token_type_ids, position_ids, past)
        B, T, _ = x.shape
        new_cols = past + torch.arange(T, device=x.device) if static else torch.arange(past, past + T, device=x.device)
        if position_ids is None:
            position_ids = new_cols  # (T,)
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
            x = x + self.token_type(token_type_ids)
        x = self.position.add(x, position_ids)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.drop(x)
        if self.embed_proj is not None:
            x = self.embed_proj(x)

        k_len = cache.capacity if static else past + T  # a static cache: attend over every column
        pos_bias = None
        if self.position.has_bias:
            pos_bias = self.position.bias(new_cols, torch.arange(k_len, device=x.device))
        pos_scores = None  # DeBERTa: a term of each layer's own q, k and projections (position.scores)
        if self.position.has_scores:
            pos_scores = self.position.scores(new_cols, torch.arange(k_len, device=x.device))
        if static:
            attention_mask = cache.key_mask
        elif attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # nothing padded: keep SDPA's fast path
        masks = dict(q_len=T, k_len=k_len, q_offset=past, causal=self.causal, key_padding=attention_mask,
                     prefix_lengths=prefix_lengths, document_ids=document_ids, bias=pos_bias, device=x.device)
        full = build_mask(**masks) if len(self.local) < self.n_layers else None  # (mask, is_causal)
        local = build_mask(**masks, window=self.window) if self.local else None  # the sliding-window layers'
        cross_mask = None
        # (a compiled step cannot branch on tensor values: it always applies a given memory mask)
        if memory is not None and memory_mask is not None and (
                torch.compiler.is_compiling() or not bool(memory_mask.all())):
            cross_mask, _ = build_mask(q_len=T, k_len=memory.shape[1], causal=False,
                                       key_padding=memory_mask, device=x.device)
        rotations = (None, None)  # (global layers', sliding-window layers')
        if self.position.has_rotation:  # cos/sin tables looked up once for every layer
            rotate = self.position.rotation(position_ids, length=k_len if static else None)
            rotations = (rotate, rotate if self.local_position is None else
                         self.local_position.rotation(position_ids, length=k_len if static else None))
        for i in range(self.n_layers):
            block = self.layers[i % len(self.layers)]
            mask, is_causal = local if i in self.local else full
            rotate = rotations[i in self.local]
            layer_cache = cache.layer(i) if cache is not None else None
            if self.checkpoint_blocks and self.training and layer_cache is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    block, x, use_reentrant=False, mask=mask, is_causal=is_causal, rotate=rotate,
                    positions=position_ids, memory=memory, memory_mask=cross_mask, cache=None, pos_scores=pos_scores)
            else:
                x = block(x, mask=mask, is_causal=is_causal, rotate=rotate, positions=position_ids,
                          memory=memory, memory_mask=cross_mask, cache=layer_cache, pos_scores=pos_scores)
        if static:
            cache.advance(T)
        if self.norm is not None:
            x = self.norm(x)
        return x[:, n_virtual:] if n_virtual else x


class Transformer(nn.Module):
    """Token embedding + encoder stack, decoder stack, or both (encoder-decoder)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embedding_dim)
        self.encoder = None
        self.decoder = None
        if cfg.arch in ("encoder", "encoder-decoder"):
            self.encoder = Stack(cfg, causal=False, n_layers=cfg.n_layers)
        if cfg.arch in ("decoder", "encoder-decoder"):
            cross = cfg.arch == "encoder-decoder"
            shared = self.encoder if cfg.share_encoder_decoder else None
            n = cfg.decoder_layers if cross else cfg.n_layers
            # decoder_config: the decoder's own heads (self and cross) and FFN width, which BART may set apart
            self.decoder = Stack(cfg.decoder_config, causal=True, cross=cross, n_layers=n, shared=shared,
                                 token_types=not cross)  # segments belong to the input stack

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, document_ids=None):
        """(B, S) token ids -> (B, S, dim) encoder hidden states (document_ids: texts packed in a row, see Stack)."""
        return self.encoder(self.embed(input_ids), attention_mask=attention_mask,
                            token_type_ids=token_type_ids, position_ids=position_ids, document_ids=document_ids)

    @property
    def input_stack(self) -> Stack:
        """The stack that reads the input text (the encoder, or the decoder of a decoder-only model)."""
        return self.encoder if self.encoder is not None else self.decoder

    def decode(self, input_ids, attention_mask=None, *, memory=None, memory_mask=None,
               position_ids=None, token_type_ids=None, prefix_lengths=None, document_ids=None, cache=None):
        """(B, T) token ids -> (B, T, dim) decoder hidden states (causal; cross-attends to memory)."""
        return self.decoder(self.embed(input_ids), attention_mask=attention_mask,
                            position_ids=position_ids, token_type_ids=token_type_ids, prefix_lengths=prefix_lengths,
                            document_ids=document_ids,
                            memory=memory, memory_mask=memory_mask, cache=cache)
