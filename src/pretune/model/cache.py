"""Key/value caches for incremental decoding: the growing ``KVCache`` (eager generation, scoring) and the
fixed-shape ``StaticKVCache`` (compiled decoding). One entry per decoder layer application; attention writes
the new keys/values of each step into it in place."""

from __future__ import annotations

import torch


class LayerCache:
    """Cached keys/values of one decoder layer: self-attention keys and values in buffers (B, Hkv, capacity, Dh) that
    each step writes its new columns into in place (no copy of the past per token). The capacity is reserved up front
    (``KVCache(capacity=...)``) or doubles when it runs out. Cross-attention keys/values are computed from the encoder
    output once and reused."""

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
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have one shape")
        end = self.length + k.shape[2]
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # autograd: never overwrite what it saved
            self._k = k if self._k is None else torch.cat([self.self_k, k], dim=2)
            self._v = v if self._v is None else torch.cat([self.self_v, v], dim=2)
        else:
            if self._k is None or end > self._k.shape[2]:
                self._grow(k, end)
            self._k[:, :, self.length: end] = k
            self._v[:, :, self.length: end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def _grow(self, k: torch.Tensor, need: int) -> None:
        old = 0 if self._k is None else self._k.shape[2]
        B, H, _, D = k.shape
        cap = max(need, self.reserve, 2 * old)
        new_k, new_v = k.new_empty(B, H, cap, D), k.new_empty(B, H, cap, D)
        if self._k is not None:
            new_k[:, :, : self.length], new_v[:, :, : self.length] = self.self_k, self.self_v
        self._k, self._v = new_k, new_v

    def reorder(self, index: torch.Tensor, *, cross: bool = True) -> None:
        """Keep batch rows ``index`` (B_new,) in that order: every cached tensor becomes tensor[index]
        (cross-attention ones only if ``cross``: beams of one prompt share them)."""
        if self._k is not None:
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        if cross and self.cross_k is not None:
            self.cross_k, self.cross_v = self.cross_k.index_select(0, index), self.cross_v.index_select(0, index)


class KVCache:
    """Key/value cache for incremental decoding: one LayerCache per decoder layer application.

    ``capacity`` reserves that many positions per layer at the first step (generation passes prompt
    length + max_new_tokens), so no step ever reallocates; without it the buffers double as needed.
    """

    layer_type = LayerCache  # what each layer's cache is (the fast wing's caches write token-major)

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.layers: list[LayerCache] = []

    def layer(self, i: int) -> LayerCache:
        while len(self.layers) <= i:
            self.layers.append(self.layer_type(self.capacity))
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
