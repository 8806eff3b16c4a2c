"""Multi-head attention (self and cross) and the attention masks (the key/value caches are in cache.py).

softmax(Q K^T * scale + bias + mask) V with heads as a batch axis, computed by
``torch.nn.functional.scaled_dot_product_attention`` so PyTorch picks its fastest kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .cache import LayerCache
from .layers import _keep_mask, make_norm
from .position import POSITIONS


class Attention(nn.Module):
    """Multi-head attention; grouped-query when n_kv_heads < n_heads; cross-attention when
    keys/values come from another sequence (the encoder output). ``qkv_bias``: q/k/v have biases when the
    other linears have none (Qwen2); ``qk_norm``: each head's queries and keys are normalised before RoPE (Qwen3);
    ``attn_softcap``: the scores are soft-capped before the mask (Gemma 2), on the eager path instead of SDPA."""

    def __init__(self, cfg: ModelConfig, *, cross: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.dh = cfg.n_heads, cfg.kv_heads, cfg.dh
        self.cross = cross
        # None: SDPA's default 1/sqrt(Dh); with position terms added to q.k (DeBERTa), 1/sqrt(Dh * (1 + terms))
        terms = POSITIONS[cfg.position].score_terms
        self.scale = cfg.attn_scale if cfg.attn_scale is not None or not terms else (self.dh * (1 + terms)) ** -0.5
        self.dropout = cfg.attn_dropout
        self.softcap = cfg.attn_softcap  # None: off (SDPA); c: scores -> c * tanh(scores / c) (eager path)
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.dh, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.dh, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv_heads * self.dh, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.dh, cfg.dim, bias=cfg.bias)
        # Qwen3: a norm (cfg.norm) over each head's Dh coordinates of q and k, one weight shared by the heads
        self.q_norm = make_norm(cfg, self.dh) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, self.dh) if cfg.qk_norm else None
        # extra key/value columns every query sees: a callable (k, v, mask, is_causal, q_len) -> (k, v, mask,
        # is_causal) that prepends them (and their mask columns) to the keys and values. None: no extras.
        self.extra_kv = None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.dh)).transpose(1, 2)  # (B, T, n*Dh) -> (B, n, T, Dh)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's queries, keys and values of x (B, T, dim): (B, H, T, Dh), (B, Hkv, T, Dh) x2, with the
        per-head q/k norms applied (Qwen3)."""
        q = self._heads(self.q_proj(x), self.n_heads)
        k = self._heads(self.k_proj(x), self.n_kv_heads)
        q, k = self._norm_qk(q, k)
        return q, k, self._heads(self.v_proj(x), self.n_kv_heads)

    def self_qkv(self, x: torch.Tensor, rotate, positions: torch.Tensor | None, cache: LayerCache | None):
        """Project x, rotate q and k (RoPE), and add the new keys and values to the cache: the queries (B, H, T, Dh)
        and every key and value the queries see, (B, Hkv, T_past + T, Dh) each."""
        q, k, v = self.project(x)
        if rotate is not None:
            q, k = rotate(q, k, positions)
        if cache is not None:
            k, v = cache.append(k, v)  # written into the cache in place
        return q, k, v

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, H, T, Dh), k: (B, Hkv, S, Dh), each normalised over Dh when qk_norm is on."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

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
        pos_scores=None,
    ) -> torch.Tensor:
        """x: (B, T, dim); memory: (B, S, dim) for cross-attention; mask: additive
        (B|1, H|1, T, T_keys); rotate(q, k, positions) applies RoPE; pos_scores(q, k, q_proj, k_proj) -> (B, H, T,
        T_keys) is a position term added to q.k^T before the scale (DeBERTa). Returns (B, T, dim)."""
        B, T, _ = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, T, Dh)
            if self.q_norm is not None:
                q = self.q_norm(q)
            if cache is not None and cache.cross_k is not None:
                k, v = cache.cross_k, cache.cross_v
            else:
                k = self._heads(self.k_proj(memory), self.n_kv_heads)  # (B, Hkv, S, Dh)
                if self.k_norm is not None:
                    k = self.k_norm(k)
                v = self._heads(self.v_proj(memory), self.n_kv_heads)
                if cache is not None:
                    cache.cross_k, cache.cross_v = k, v
        else:
            q, k, v = self.self_qkv(x, rotate, positions, cache)
            if pos_scores is not None:  # DeBERTa's c2p + p2c, on the scores' scale, joins the additive mask
                extra = pos_scores(q, k, self.q_proj, self.k_proj) * (self.scale or self.dh ** -0.5)  # (B, H, T, S)
                if is_causal:
                    extra = extra + _causal_bias(T, k.shape[2], extra.dtype, extra.device)
                mask, is_causal = (extra if mask is None else extra + mask.to(extra.dtype)), False
        if self.extra_kv is not None:
            k, v, mask, is_causal = self.extra_kv(k, v, mask, is_causal, q.shape[2])
        if mask is not None and mask.dtype != q.dtype:
            mask = cast_mask(mask, q.dtype)
        out = self.attend(q, k, v, mask, is_causal)  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.dh)  # (B, T, H*Dh)
        return self.o_proj(out)

    def attend(self, q, k, v, mask, is_causal):
        """softmax(q k^T * scale + mask) v for q (B, H, T, Dh) and k, v (B, Hkv, S, Dh) (the seam where the fast
        wing takes another kernel): SDPA, or the eager path where SDPA cannot (soft-capping, dropout)."""
        if self.softcap is not None or (self.training and self.dropout > 0):
            return self._attend_eager(q, k, v, mask, is_causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=self.n_kv_heads != self.n_heads)

    def _attend_eager(self, q, k, v, mask, is_causal):
        """softmax(softcap(QK^T * scale) + mask) with dropout on the probabilities (when training), then V: what
        SDPA cannot do. Its fused kernels have no dropout on CPU and its math path uses bernoulli_; this path is the
        same maths with the cheaper keep mask and as few passes over the (B, H, T, S) scores as autograd allows:
        the scale goes on q, the masks are added in place, and dropout's 1/(1-p) multiplies the (B, H, T, Dh)
        output, so the probabilities are only masked (one pass forward, one backward). The soft cap
        c * tanh(s / c) comes before the masks (Gemma 2)."""
        if self.n_kv_heads != self.n_heads:  # GQA: each kv head serves n_heads / n_kv_heads query heads
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        B, H, T, Dh = q.shape
        S = k.shape[2]
        q = q * (self.scale if self.scale is not None else Dh ** -0.5)
        scores = q @ k.transpose(-1, -2)  # (B, H, T, S); the matmul keeps q and k, so in-place adds are safe
        if self.softcap is not None:  # Gemma 2: logits kept in (-c, c); tanh keeps its output, * c makes a new one
            scores = torch.tanh(scores * (1.0 / self.softcap)) * self.softcap
        if is_causal:
            scores.add_(_causal_bias(T, S, q.dtype, q.device))  # (T, S): 0 or -inf (cheaper than baddbmm's copy)
        if mask is not None:
            scores.add_(mask)  # (B|1, H|1, T, S) broadcasts onto the scores
        probs = scores.softmax(dim=-1)
        if not (self.training and self.dropout > 0):
            return probs @ v  # (B, H, T, Dh)
        keep = _keep_mask(probs.shape, self.dropout, probs.device)
        return (torch.where(keep, probs, 0.0) @ v) * (1.0 / (1.0 - self.dropout))  # (B, H, T, Dh)


def cast_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask in the attention's dtype. The fp32 minimum that ``build_mask`` puts on hidden keys becomes
    -inf in bf16 and fp16; a row with every key hidden (a padding query) would then turn into NaN in a softmax, and
    the NaN keys and values it leaves in a KV cache reach the real queries later (0 * NaN), so values below the
    dtype's own minimum are clamped to it (as transformers' masks use ``finfo(dtype).min``)."""
    mask = mask.to(dtype)
    return mask.clamp_(min=torch.finfo(dtype).min) if dtype.is_floating_point and dtype.itemsize < 4 else mask


def build_mask(
    *,
    q_len: int,
    k_len: int,
    q_offset: int | torch.Tensor = 0,
    causal: bool,
    key_padding: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
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
        document_ids: (B, k_len) several examples packed in one row: a query sees only keys of its own document
            (a block-diagonal mask; queries are the last q_len columns).
        window: sliding-window attention: a query sees only keys fewer than ``window`` columns away (causal: the
            last ``window`` keys up to itself; otherwise |i - j| < window), on top of every other rule. Columns, not
            position ids: the same distance for left-padded rows and packed documents, whose tokens are contiguous.
        bias: (1 or B, H, q_len, k_len) additive logits bias (T5 relative, ALiBi).
    Returns:
        (mask, is_causal): an additive float mask (B|1, H|1, q_len, k_len) or None, and whether
        SDPA should apply its own causal mask (the fast path: causal, nothing else, no cache).
    """
    static = isinstance(q_offset, torch.Tensor)
    needs_causal = causal and (q_len > 1 or static)
    if window is not None and k_len <= window:
        window = None  # every key is within the window: the plain mask (and SDPA's causal fast path) is the same
    if (key_padding is None and prefix_lengths is None and document_ids is None and bias is None and not static
            and window is None):
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
    if window is not None:
        q_pos = q_offset + torch.arange(q_len, device=device)  # (q_len,) the queries' columns
        distance = q_pos[:, None] - torch.arange(k_len, device=device)[None, :]  # (q_len, k_len)
        near = (distance.abs() < window)[None, None]  # (1, 1, q_len, k_len); the causal rule hides the future
        allowed = near if allowed is None else allowed & near
    if key_padding is not None:
        keep = key_padding.to(device=device, dtype=torch.bool)[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
    if document_ids is not None:
        docs = document_ids.to(device)
        same = (docs[:, -q_len:, None] == docs[:, None, :])[:, None]  # (B, 1, q_len, k_len)
        allowed = same if allowed is None else allowed & same
        # a padding query (no document) sees itself: no row is fully masked, which overflows to NaN in bf16
        q_cols = k_len - q_len + torch.arange(q_len, device=device)
        diagonal = torch.arange(k_len, device=device)[None, :] == q_cols[:, None]
        allowed = allowed | diagonal
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
