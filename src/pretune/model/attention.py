"""Multi-head attention (self and cross), attention masks and the key/value cache.

softmax(Q K^T * scale + bias + mask) V with heads as a batch axis, computed by
``torch.nn.functional.scaled_dot_product_attention`` so PyTorch picks its fastest kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import FusedLinears, _keep_mask


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


class StaticLayerCache:
    """Keys/values of one decoder layer in buffers of a fixed shape (B, Hkv, capacity, Dh), zero until written.
    ``append`` writes the new keys/values at the columns the owning :class:`StaticKVCache` points to and returns
    the whole buffers: attention reads every column and the mask (``StaticKVCache.index``) hides the ones not
    written yet. Nothing here depends on a Python int that changes per step, so a compiled decoding step sees
    the same shapes every time."""

    def __init__(self, owner: "StaticKVCache"):
        self.owner = owner
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.cross_k: torch.Tensor | None = None  # (B, Hkv, T_enc, Dh), as LayerCache
        self.cross_v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values (B, Hkv, T, Dh) at columns index .. index + T - 1; return both buffers."""
        if self._k is None:  # zeros, not empty: a masked column still enters q.k and p.v (0 * NaN would be NaN)
            B, H, _, D = k.shape
            self._k = k.new_zeros(B, H, self.owner.capacity, D)
            self._v = v.new_zeros(B, H, self.owner.capacity, v.shape[3])
        cols = self.owner.columns(k.shape[2])
        self._k.index_copy_(2, cols, k)
        self._v.index_copy_(2, cols, v)
        return self._k, self._v

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        if self._k is not None:
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        if cross and self.cross_k is not None:
            self.cross_k, self.cross_v = self.cross_k.index_select(0, index), self.cross_v.index_select(0, index)


class StaticKVCache:
    """A key/value cache of fixed capacity for compiled decoding (``generate(..., compile=True)``).

    Unlike :class:`KVCache`, whose length is a Python int and whose attention reads only the columns in use,
    this cache keeps the write position in a tensor (``index``, (1,)) and every forward attends over all
    ``capacity`` columns with a mask built from ``index`` (columns after the newest token are hidden) and
    ``key_mask`` (B, capacity) (0 for left-padding columns; None: no padding). A forward with T new tokens writes
    columns index .. index + T - 1 and then advances ``index`` by T. Queries are at columns, so relative position
    biases (T5, ALiBi) see the same distances as with :class:`KVCache`; position ids for RoPE/learned tables are
    passed explicitly for left-padded rows, as with the dynamic cache.
    """

    static = True

    def __init__(self, capacity: int, *, device: torch.device | str = "cpu", key_mask: torch.Tensor | None = None):
        if capacity < 1:
            raise ValueError(f"StaticKVCache capacity must be >= 1, got {capacity}")
        if key_mask is not None and (key_mask.dim() != 2 or key_mask.shape[1] != capacity):
            raise ValueError(f"key_mask must be (B, capacity={capacity}), got {tuple(key_mask.shape)}")
        self.capacity = capacity
        self.index = torch.zeros(1, dtype=torch.long, device=device)
        self.key_mask = None if key_mask is None else key_mask.to(device=device, dtype=torch.bool)
        self.layers: list[StaticLayerCache] = []

    def layer(self, i: int) -> StaticLayerCache:
        while len(self.layers) <= i:
            self.layers.append(StaticLayerCache(self))
        return self.layers[i]

    @property
    def length(self) -> int:
        """Columns written so far (reads the index tensor: not for use inside a compiled step)."""
        return int(self.index)

    def columns(self, n: int) -> torch.Tensor:
        """The columns the next n tokens go to, (n,)."""
        return self.index + torch.arange(n, device=self.index.device)

    def advance(self, n: int) -> None:
        self.index += n

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        """Keep batch rows ``index`` (B_new,) in that order (beam search), as KVCache.reorder."""
        for lc in self.layers:
            lc.reorder(index, cross=cross)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, index)


def build_mask(
    *,
    q_len: int,
    k_len: int,
    q_offset: int | torch.Tensor = 0,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """Combine causal/prefix/padding masks and an additive position bias into one SDPA mask.

    Args:
        q_len, k_len: query and key lengths; queries sit at positions q_offset .. q_offset+q_len-1. A tensor
            q_offset ((1,), a StaticKVCache index) always gives a full mask, causal even for one query: keys
            after the queries exist (columns not written yet) and must be hidden.
        causal: query i may only see keys j <= i.
        key_padding: (B, k_len) bool/int, 1 for real tokens, 0 for padding.
        prefix_lengths: (B,) prefix-LM: keys j < prefix_len are visible to every query.
        bias: (1 or B, H, q_len, k_len) additive logits bias (T5 relative, ALiBi).
    Returns:
        (mask, is_causal): an additive float mask (B|1, H|1, q_len, k_len) or None, and whether
        SDPA should apply its own causal mask (the fast path: causal, nothing else, no cache).
    """
    static = isinstance(q_offset, torch.Tensor)
    needs_causal = causal and (q_len > 1 or static)
    if key_padding is None and prefix_lengths is None and bias is None and not static:
        if not needs_causal:
            return None, False
        if q_offset == 0 and q_len == k_len:
            return None, True
    allowed = None  # (B|1, 1, q_len, k_len) bool
    if needs_causal:
        q_pos = q_offset + torch.arange(q_len, device=device)
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
        self._qkv = FusedLinears()

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.dh)).transpose(1, 2)  # (B, T, n*Dh) -> (B, n, T, Dh)

    def _project_qkv(self, x: torch.Tensor):
        q, k, v = self._qkv(x, (self.q_proj, self.k_proj, self.v_proj))  # one matmul for the three
        return self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

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
