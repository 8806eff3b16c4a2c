"""Fast self-attention: q, k and v as one matmul, rotated and written into the cache as one token-major tensor.

:class:`FastAttention` overrides the reference attention's two seams, ``project`` and ``self_qkv``
(``model/attention.py``); everything after them (masks, SDPA or the eager path, the output projection) is the
reference's.
"""

from __future__ import annotations

import torch

from ..attention import Attention
from .cache import FastLayerCache
from .linears import FusedLinears


class FastAttention(Attention):
    """Attention (same projections, same values up to rounding) with the q/k/v projections stacked
    (:class:`FusedLinears`) and, where q, k and v are plain linears with no per-head norm, the lean path of
    :meth:`self_qkv`."""

    def __init__(self, *args, **kwargs):  # built directly (accelerate() swaps the class of a built one instead)
        super().__init__(*args, **kwargs)
        self._init_fast()

    def _init_fast(self) -> None:
        self._qkv = FusedLinears()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qkv(x, (self.q_proj, self.k_proj, self.v_proj))  # one matmul for the three
        q, k = self._norm_qk(self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads))
        return q, k, self._heads(v, self.n_kv_heads)

    def self_qkv(self, x: torch.Tensor, rotate, positions: torch.Tensor | None, cache):
        joined = self._fused_qkv(x, rotate, cache)  # projected, rotated (and cached) in fewer calls
        return joined if joined is not None else super().self_qkv(x, rotate, positions, cache)

    def _fused_qkv(self, x: torch.Tensor, rotate, cache):
        """The lean path when q, k and v are plain linears with no per-head norm (and any cache is a
        :class:`FastLayerCache`): the fused projection's output viewed as token-major heads (B, T, H + 2 Hkv, Dh),
        RoPE on its q and k heads (in place, or for a few tokens one matmul over all heads), its k and v heads written
        into the cache in one copy. Decoding makes about half the PyTorch calls per layer of the reference path;
        training keeps one (B, T, H + 2 Hkv, Dh) tensor for the attention's backward instead of the projection's
        output plus rotated copies of q and k. The same values up to rounding. None: take the reference path."""
        if ((cache is not None and type(cache) is not FastLayerCache) or self.q_norm is not None
                or (rotate is not None and not hasattr(rotate, "heads"))):
            return None
        y = self._qkv.joined(x, (self.q_proj, self.k_proj, self.v_proj))
        if y is None:  # a wrapped projection (LoRA, (IA)3) adjusts its own slice
            return None
        y = y.unflatten(-1, (-1, self.dh))  # (B, T, H + 2 Hkv, Dh)
        if rotate is not None:
            y = rotate.heads(y, self.n_heads + self.n_kv_heads)
        kv = y.narrow(2, self.n_heads, 2 * self.n_kv_heads)
        if cache is not None:
            k, v = cache.append_tokens(kv)  # (B, Hkv, T_past + T, Dh) each
        else:
            k = kv.narrow(2, 0, self.n_kv_heads).transpose(1, 2)
            v = kv.narrow(2, self.n_kv_heads, self.n_kv_heads).transpose(1, 2)
        return y.narrow(2, 0, self.n_heads).transpose(1, 2), k, v
