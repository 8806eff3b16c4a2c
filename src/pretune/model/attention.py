"""Multi-head attention (self and cross), attention masks and the key/value cache.

softmax(Q K^T * scale + bias + mask) V with heads as a batch axis, computed by
``torch.nn.functional.scaled_dot_product_attention`` so PyTorch picks its fastest kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import _keep_mask


class LayerCache:
    """Cached keys/values of one decoder layer. Self-attention keys/values live in buffers of shape
    (B, Hkv, capacity, Dh) that each step writes into in place (no copy of the past per token); the
    capacity is reserved up front (``KVCache(capacity=...)``) or doubles when it runs out.
    Cross-attention keys/values are computed from the encoder output once and reused."""

    def __init__(self, capacity: int = 0):
        self.reserve = capacity  # positions to allocate at the first append (0: just what it needs)
        self.length = 0  # positions cached so far
        self._k: torch.Tensor | None = None  # (B, Hkv, capacity, Dh); [:, :, :length] is in use
        self._v: torch.Tensor | None = None
        self.cross_k: torch.Tensor | None = None  # (B, Hkv, T_enc, Dh)
        self.cross_v: torch.Tensor | None = None

    @property
    def self_k(self) -> torch.Tensor | None:
        """Cached keys (B, Hkv, length, Dh), a view of the buffer (None before the first append)."""
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def self_v(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new keys/values (B, Hkv, T, Dh); return every cached one, (B, Hkv, length + T, Dh)."""
        end = self.length + k.shape[2]
        if k.requires_grad and torch.is_grad_enabled():  # autograd: never overwrite a tensor it saved
            self._k = k if self._k is None else torch.cat([self.self_k, k], dim=2)
            self._v = v if self._v is None else torch.cat([self.self_v, v], dim=2)
        else:
            if self._k is None or end > self._k.shape[2]:
                self._grow(k, v, end)
            self._k[:, :, self.length: end] = k
            self._v[:, :, self.length: end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def _grow(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        old = 0 if self._k is None else self._k.shape[2]
        cap = max(need, self.reserve, 2 * old)
        B, H, _, D = k.shape  # (B, Hkv, T, Dh)
        new_k, new_v = k.new_empty(B, H, cap, D), v.new_empty(B, H, cap, v.shape[3])
        if self._k is not None:
            new_k[:, :, : self.length] = self.self_k
            new_v[:, :, : self.length] = self.self_v
        self._k, self._v = new_k, new_v

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        """Keep batch rows ``index`` (B_new,) in that order: every cached tensor becomes tensor[index]
        (cross-attention ones only if ``cross``: beams of one prompt share them)."""
        if self._k is not None:
            if index.numel() == self._k.shape[0] and not self._k.requires_grad:  # beam search: rows in place
                self._k[:, :, : self.length] = self.self_k.index_select(0, index)
                self._v[:, :, : self.length] = self.self_v.index_select(0, index)
            else:
                self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        if cross and self.cross_k is not None:
            self.cross_k, self.cross_v = self.cross_k.index_select(0, index), self.cross_v.index_select(0, index)


class KVCache:
    """Key/value cache for incremental decoding: one LayerCache per decoder layer application.

    ``capacity`` reserves that many positions per layer at the first step (generation passes prompt
    length + max_new_tokens), so no step ever reallocates; without it the buffers double as needed.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.layers: list[LayerCache] = []

    def layer(self, i: int) -> LayerCache:
        while len(self.layers) <= i:
            self.layers.append(LayerCache(self.capacity))
        return self.layers[i]

    @property
    def length(self) -> int:
        """Number of positions already cached (0 for an empty cache)."""
        return self.layers[0].length if self.layers else 0

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        """Select batch rows (beam search): every cached tensor becomes tensor[index]; ``cross=False``
        leaves cross-attention keys/values alone (rows that only move among copies of one prompt)."""
        for lc in self.layers:
            lc.reorder(index, cross=cross)


def build_mask(
    *,
    q_len: int,
    k_len: int,
    q_offset: int = 0,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """Combine causal/prefix/padding masks and an additive position bias into one SDPA mask.

    Args:
        q_len, k_len: query and key lengths; queries sit at positions q_offset .. q_offset+q_len-1.
        causal: query i may only see keys j <= i.
        key_padding: (B, k_len) bool/int, 1 for real tokens, 0 for padding.
        prefix_lengths: (B,) prefix-LM: keys j < prefix_len are visible to every query.
        bias: (1 or B, H, q_len, k_len) additive logits bias (T5 relative, ALiBi).
    Returns:
        (mask, is_causal): an additive float mask (B|1, H|1, q_len, k_len) or None, and whether
        SDPA should apply its own causal mask (the fast path: causal, nothing else, no cache).
    """
    needs_causal = causal and q_len > 1
    if key_padding is None and prefix_lengths is None and bias is None:
        if not needs_causal:
            return None, False
        if q_offset == 0 and q_len == k_len:
            return None, True
    allowed = None  # (B|1, 1, q_len, k_len) bool
    if needs_causal:
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)
        k_pos = torch.arange(k_len, device=device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if prefix_lengths is not None:
            in_prefix = k_pos[None, :] < prefix_lengths.to(device)[:, None]  # (B, k_len)
            allowed = allowed | in_prefix[:, None, None, :]
    if key_padding is not None:
        keep = key_padding.to(device=device, dtype=torch.bool)[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    if allowed is None and bias is None:
        return None, False  # e.g. one causal query with a prefix mask: nothing is hidden
    if bias is None:
        mask = torch.zeros(allowed.shape, device=device)
    else:
        mask = bias.float()
        if allowed is not None:
            mask = mask.expand(torch.broadcast_shapes(mask.shape, allowed.shape))
    if allowed is not None:
        # finfo.min rather than -inf: a fully masked row (a padding query) stays finite, never NaN
        mask = mask.masked_fill(~allowed, torch.finfo(mask.dtype).min)
    return mask, False


_CAUSAL: dict[tuple, torch.Tensor] = {}


def _causal_bias(T: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(T, S) additive causal mask for queries at the last T of S key positions: 0 where key j <= query i
    (offset S - T), -inf after it. Cached per shape, dtype and device (a few small tensors)."""
    key = (T, S, dtype, str(device), torch.is_inference_mode_enabled())
    bias = _CAUSAL.get(key)
    if bias is None:
        hidden = torch.ones(T, S, dtype=torch.bool, device=device).triu_(S - T + 1)
        bias = torch.zeros(T, S, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        if len(_CAUSAL) > 64:
            _CAUSAL.clear()
        _CAUSAL[key] = bias
    return bias


class Attention(nn.Module):
    """Multi-head attention; grouped-query when n_kv_heads < n_heads; cross-attention when
    keys/values come from another sequence (the encoder output)."""

    def __init__(self, cfg: ModelConfig, *, cross: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.dh = cfg.n_heads, cfg.kv_heads, cfg.dh
        self.cross = cross
        self.scale = cfg.attn_scale  # None: SDPA's default 1/sqrt(Dh)
        self.dropout = cfg.attn_dropout
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.dh, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.dh, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.dh, bias=cfg.bias)
        self.o_proj = nn.Linear(self.n_heads * self.dh, cfg.dim, bias=cfg.bias)
        # prefix tuning (pretune.peft): callable (k, v, mask, is_causal, q_len) -> (k, v, mask, is_causal)
        # with trainable key/value prefixes prepended; set by pretune.peft.inject, None otherwise
        self.prefix = None
        self._qkv_cache: tuple | None = None  # (key, fused weight, fused bias) while the weights are unchanged

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.dh)).transpose(1, 2)  # (B, T, n*Dh) -> (B, n, T, Dh)

    def _project_qkv(self, x: torch.Tensor):
        projs = (self.q_proj, self.k_proj, self.v_proj)
        # a PEFT wrapper (pretune.peft.PeftLinear) keeps its frozen layer as .base_layer and adds its
        # change to the base output with .adjust(x, y); one that rescales its input needs its own call
        bases = [getattr(p, "base_layer", p) for p in projs]
        if any(type(b) is not nn.Linear or getattr(p, "scales_input", False) for p, b in zip(projs, bases)):
            return (self._heads(self.q_proj(x), self.n_heads), self._heads(self.k_proj(x), self.n_kv_heads),
                    self._heads(self.v_proj(x), self.n_kv_heads))
        # one matmul for q, k and v (one read of x, one autocast cast of it) instead of three
        w, b = self._fused_qkv(bases)
        qkv = F.linear(x, w, b).split([self.n_heads * self.dh, self.n_kv_heads * self.dh,
                                       self.n_kv_heads * self.dh], dim=-1)
        q, k, v = (y if p is base else p.adjust(x, y) for p, base, y in zip(projs, bases, qkv))
        return self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def _fused_qkv(self, bases) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The q, k, v weights (and biases) stacked. Weights that train are concatenated on every call (the
        graph must reach them); frozen ones (inference, generation, LoRA) are stacked once and reused until a
        weight changes (in-place updates bump the tensor's version, a move gives a new storage; a write through
        ``param.data`` bypasses the version counter and is not seen)."""
        tensors = [b.weight for b in bases] + ([b.bias for b in bases] if bases[0].bias is not None else [])
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            w = torch.cat(tensors[:3])
            return w, (torch.cat(tensors[3:]) if len(tensors) > 3 else None)
        key = (torch.is_inference_mode_enabled(), *((t.data_ptr(), t._version, t.dtype) for t in tensors))
        if self._qkv_cache is None or self._qkv_cache[0] != key:
            with torch.no_grad():
                w = torch.cat(tensors[:3])
                b = torch.cat(tensors[3:]) if len(tensors) > 3 else None
            self._qkv_cache = (key, w, b)
        return self._qkv_cache[1], self._qkv_cache[2]

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        rotate=None,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x: (B, T, dim); memory: (B, S, dim) for cross-attention; mask: additive
        (B|1, H|1, T, T_keys); rotate(q, k, positions) applies RoPE. Returns (B, T, dim)."""
        B, T, _ = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, T, Dh)
            if cache is not None and cache.cross_k is not None:
                k, v = cache.cross_k, cache.cross_v
            else:
                k = self._heads(self.k_proj(memory), self.n_kv_heads)  # (B, Hkv, S, Dh)
                v = self._heads(self.v_proj(memory), self.n_kv_heads)
                if cache is not None:
                    cache.cross_k, cache.cross_v = k, v
        else:
            q, k, v = self._project_qkv(x)  # (B, H, T, Dh), (B, Hkv, T, Dh) x2
            if rotate is not None:
                q, k = rotate(q, k, positions)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, Hkv, T_past + T, Dh), written into the cache in place
        if self.prefix is not None:
            k, v, mask, is_causal = self.prefix(k, v, mask, is_causal, q.shape[2])
        if mask is not None and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        if self.training and self.dropout > 0:
            out = self._attend_with_dropout(q, k, v, mask, is_causal)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.dh)  # (B, T, H*Dh)
        return self.o_proj(out)

    def _attend_with_dropout(self, q, k, v, mask, is_causal):
        """softmax(QK^T * scale + mask) with dropout on the probabilities, then V. SDPA's fused kernels
        have no dropout on CPU and its math path uses bernoulli_; this path is the same maths with the
        cheaper keep mask and as few passes over the (B, H, T, S) scores as autograd allows: the scale
        goes on q, the masks are added in place, and dropout's 1/(1-p) multiplies the (B, H, T, Dh)
        output, so the probabilities are only masked (one pass forward, one backward)."""
        if self.n_kv_heads != self.n_heads:  # GQA: each kv head serves n_heads / n_kv_heads query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        B, H, T, Dh = q.shape
        S = k.shape[2]
        q = q * (self.scale if self.scale is not None else Dh ** -0.5)
        scores = q @ k.transpose(-1, -2)  # (B, H, T, S); the matmul keeps q and k, so in-place adds are safe
        if is_causal:
            scores.add_(_causal_bias(T, S, q.dtype, q.device))  # (T, S): 0 or -inf (cheaper than baddbmm's copy)
        if mask is not None:
            scores.add_(mask)  # (B|1, H|1, T, S) broadcasts onto the scores
        probs = scores.softmax(dim=-1)
        keep = _keep_mask(probs.shape, self.dropout, probs.device)
        return (torch.where(keep, probs, 0.0) @ v) * (1.0 / (1.0 - self.dropout))  # (B, H, T, Dh)
