"""Multi-head attention (self and cross), attention masks and the key/value cache.

softmax(Q K^T * scale + bias + mask) V with heads as a batch axis, computed by
``torch.nn.functional.scaled_dot_product_attention`` so PyTorch picks its fastest kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import dropout


@dataclass
class LayerCache:
    """Cached keys/values of one decoder layer: self-attention grows by one step per token;
    cross-attention keys/values are computed from the encoder output once and reused."""

    self_k: torch.Tensor | None = None  # (B, Hkv, T_past, Dh)
    self_v: torch.Tensor | None = None
    cross_k: torch.Tensor | None = None  # (B, Hkv, T_enc, Dh)
    cross_v: torch.Tensor | None = None


@dataclass
class KVCache:
    """Key/value cache for incremental decoding: one LayerCache per decoder layer application."""

    layers: list[LayerCache] = field(default_factory=list)

    def layer(self, i: int) -> LayerCache:
        while len(self.layers) <= i:
            self.layers.append(LayerCache())
        return self.layers[i]

    @property
    def length(self) -> int:
        """Number of positions already cached (0 for an empty cache)."""
        if not self.layers or self.layers[0].self_k is None:
            return 0
        return self.layers[0].self_k.shape[2]

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search): every cached tensor becomes tensor[index]."""
        for lc in self.layers:
            for name in ("self_k", "self_v", "cross_k", "cross_v"):
                t = getattr(lc, name)
                if t is not None:
                    setattr(lc, name, t.index_select(0, index))


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

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.dh)).transpose(1, 2)  # (B, T, n*Dh) -> (B, n, T, Dh)

    def _project_qkv(self, x: torch.Tensor):
        plain = type(self.q_proj) is nn.Linear and type(self.k_proj) is nn.Linear and type(self.v_proj) is nn.Linear
        if not plain:  # a PEFT wrapper changes a projection: call each one
            return (self._heads(self.q_proj(x), self.n_heads), self._heads(self.k_proj(x), self.n_kv_heads),
                    self._heads(self.v_proj(x), self.n_kv_heads))
        # one matmul for q, k and v (one read of x, one autocast cast of it) instead of three
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        q, k, v = F.linear(x, w, b).split([self.n_heads * self.dh, self.n_kv_heads * self.dh,
                                           self.n_kv_heads * self.dh], dim=-1)
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
                if cache.self_k is not None:
                    k = torch.cat([cache.self_k, k], dim=2)  # (B, Hkv, T_past + T, Dh)
                    v = torch.cat([cache.self_v, v], dim=2)
                cache.self_k, cache.self_v = k, v
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
        """softmax(QK^T * scale + mask) with dropout on the probabilities, then V. SDPA's fused
        kernels have no dropout on CPU and its math path uses bernoulli_; this path is the same
        maths with the cheaper dropout mask."""
        if self.n_kv_heads != self.n_heads:  # GQA: each kv head serves n_heads / n_kv_heads query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        scale = self.scale if self.scale is not None else self.dh ** -0.5
        scores = (q * scale) @ k.transpose(-1, -2)  # (B, H, T, S)
        if is_causal:
            T, S = scores.shape[-2:]
            hidden = torch.ones(T, S, dtype=torch.bool, device=q.device).triu_(S - T + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        if mask is not None:
            scores = scores + mask
        probs = dropout(scores.softmax(dim=-1), self.dropout, True)
        return probs @ v  # (B, H, T, Dh)
