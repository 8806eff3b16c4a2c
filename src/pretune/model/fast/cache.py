"""Fast key/value caches: keys and values of a layer in one token-major buffer, so the fused q/k/v projection's
keys and values (a slice of its output) go in with one copy, and a decoding step's one token with one more.

``FastKVCache`` is a ``KVCache`` whose layers are :class:`FastLayerCache`; ``TransformerLM.new_cache`` gives one for a
fast model (the reference model's caches are ``model/cache.py``'s)."""

from __future__ import annotations

import torch

from ..cache import KVCache, LayerCache


class FastLayerCache(LayerCache):
    """A ``LayerCache`` (same interface) whose self-attention keys and values live together in one token-major
    buffer (B, capacity, Hkv + Hkv, Dh) — keys in the first Hkv heads, values in the rest — that each step writes
    into in place (no copy of the past per token; one write per step when the attention hands over its new keys and
    values as one token-major slice, :meth:`append_tokens`). The capacity is reserved up front
    (``KVCache(capacity=...)``) or doubles when it runs out. Cross-attention keys/values are computed from the
    encoder output once and reused."""

    def __init__(self, capacity: int = 0):
        self.reserve = capacity  # positions to allocate at the first append (0: just what it needs)
        self.length = 0  # positions cached so far
        self._kv: torch.Tensor | None = None  # (B, capacity, 2 * Hkv, Dh); [:, :length] is in use
        self._k_all = self._v_all = None  # views of every column of _kv as (B, Hkv, capacity, Dh)
        self.cross_k: torch.Tensor | None = None  # (B, Hkv, T_enc, Dh)
        self.cross_v: torch.Tensor | None = None

    def _set(self, kv: torch.Tensor) -> None:
        self._kv = kv
        h = kv.shape[2] // 2
        self._k_all, self._v_all = kv.narrow(2, 0, h).transpose(1, 2), kv.narrow(2, h, h).transpose(1, 2)
        self._slots = kv.unsqueeze(3)  # (B, capacity, 2 * Hkv, 1, Dh): one position is write_heads' layout

    def _views(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k_all.narrow(2, 0, end), self._v_all.narrow(2, 0, end)  # (B, Hkv, end, Dh) each

    @property
    def self_k(self) -> torch.Tensor | None:
        """Cached keys (B, Hkv, length, Dh), a view of the buffer (None before the first append)."""
        return None if self._kv is None else self._views(self.length)[0]

    @property
    def self_v(self) -> torch.Tensor | None:
        return None if self._kv is None else self._views(self.length)[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new keys/values (B, Hkv, T, Dh); return every cached one, (B, Hkv, length + T, Dh)."""
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have one shape")
        return self.append_tokens(torch.cat([k, v], dim=1).transpose(1, 2))

    def append_tokens(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add new keys and values given token-major, (B, T, 2 * Hkv, Dh) (keys first: a slice of the fused q/k/v
        projection's heads); return every cached key and value, (B, Hkv, length + T, Dh) each."""
        end = self.length + kv.shape[1]
        if kv.requires_grad and torch.is_grad_enabled():  # autograd: never overwrite a tensor it saved
            self._set(kv if self._kv is None else torch.cat([self._kv[:, : self.length], kv], dim=1))
        else:
            if self._kv is None or end > self._kv.shape[1]:
                self._grow(kv, end)
            self._kv.narrow(1, self.length, end - self.length).copy_(kv)
        self.length = end
        return self._views(end)

    def write_heads(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`append_tokens` for one token's keys and values, head-major (B, 2 * Hkv, 1, Dh) (keys first),
        outside autograd, into a buffer that has room (a decoding step after the prompt, with
        ``KVCache(capacity=...)``): one copy into the buffer and two views; else the general path."""
        end = self.length + 1
        if self._kv is None or end > self._kv.shape[1] or kv.requires_grad:
            return self.append_tokens(kv.transpose(1, 2))
        self._slots.select(1, self.length).copy_(kv)
        self.length = end
        return self._views(end)

    def _grow(self, kv: torch.Tensor, need: int) -> None:
        old = 0 if self._kv is None else self._kv.shape[1]
        cap = max(need, self.reserve, 2 * old)
        B, _, H, D = kv.shape  # (B, T, 2 * Hkv, Dh)
        new = kv.new_empty(B, cap, H, D)
        if self._kv is not None:
            new[:, : self.length] = self._kv[:, : self.length]
        self._set(new)

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        """Keep batch rows ``index`` (B_new,) in that order: every cached tensor becomes tensor[index]
        (cross-attention ones only if ``cross``: beams of one prompt share them)."""
        if self._kv is not None:
            if index.numel() == self._kv.shape[0] and not self._kv.requires_grad:  # beam search: rows in place
                self._kv[:, : self.length] = self._kv[:, : self.length].index_select(0, index)
            else:
                self._set(self._kv.index_select(0, index))
        if cross and self.cross_k is not None:
            self.cross_k, self.cross_v = self.cross_k.index_select(0, index), self.cross_v.index_select(0, index)


class FastKVCache(KVCache):
    """A KVCache of :class:`FastLayerCache` layers (what :class:`FastAttention` writes into with one copy)."""

    layer_type = FastLayerCache
