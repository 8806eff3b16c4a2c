"""Positional information behind one small interface.

Each stack (encoder, decoder) owns one position module. A module may do any of these things:
  - ``add(x, positions)``: add an absolute position embedding to the input (sinusoidal, learned);
  - ``rotate(q, k, positions)``: rotate queries and keys (RoPE);
  - ``bias(q_pos, k_pos)``: a (1, H, Tq, Tk) term added to QK^T before softmax (T5 relative, ALiBi);
  - ``scores(q_pos, k_pos)``: a function of each layer's queries, keys and projections giving a (B, H, Tq, Tk)
    term added to QK^T, on its scale (DeBERTa's disentangled attention); ``score_terms`` such terms set the scale.
The defaults do nothing, so a stack calls all of them and never asks which kind it has.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from .layers import Dropout, make_norm


class NoPosition(nn.Module):
    """No positional information at all (a bag of tokens, unless the mask is causal)."""

    has_bias = False
    has_rotation = False
    has_scores = False
    score_terms = 0  # dot products added to q.k (DeBERTa: 2); the attention scale is 1/sqrt(Dh * (1 + score_terms))

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__()

    def add(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x

    def rotate(self, q, k, positions):
        return q, k

    def reserve(self, n: int) -> None:
        """Make positions < n usable without growing anything later (before a compiled decoding step). RoPE needs
        nothing here: a static cache's forward asks ``rotation`` for tables of its whole capacity."""

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None

    def scores(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """None, or ``fn(q, k, q_proj, k_proj) -> (B, H, Tq, Tk)``: a term added to each layer's q.k^T before the
        scale (q: (B, H, Tq, Dh), k: (B, H, Tk, Dh), the layer's query and key projections)."""
        return None


class SinusoidalPositions(NoPosition):
    """Differs from none: adds fixed sin/cos of position (Vaswani et al. 2017 §3.5)."""

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        self.dim = cfg.embedding_dim
        self.register_buffer("table", self._table(cfg.max_seq_len), persistent=False)

    def _table(self, n: int) -> torch.Tensor:
        pos = torch.arange(n, dtype=torch.float32)[:, None]  # (n, 1)
        inv = torch.exp(torch.arange(0, self.dim, 2, dtype=torch.float32) * (-math.log(10000.0) / self.dim))
        table = torch.zeros(n, self.dim)
        table[:, 0::2] = torch.sin(pos * inv)  # PE(pos, 2i)
        table[:, 1::2] = torch.cos(pos * inv)  # PE(pos, 2i+1)
        return table

    def reserve(self, n: int) -> None:
        if n > self.table.shape[0]:
            self.table = self._table(n).to(self.table.device)

    def add(self, x, positions):
        # sinusoids extrapolate: grow the table (not inside a compiled step, which cannot branch on values:
        # reserve() ran before it)
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.table.shape[0]:
            self.table = self._table(int(positions.max()) + 1).to(self.table.device)
        return x + self.table[positions].to(x.dtype)


class LearnedPositions(NoPosition):
    """Differs from none: a trained table of max_seq_len absolute position vectors (BERT, GPT-2)."""

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        self.offset = cfg.position_offset
        self.weight = nn.Parameter(torch.empty(cfg.max_seq_len, cfg.embedding_dim))
        nn.init.normal_(self.weight, std=0.02)

    def add(self, x, positions):
        positions = positions + self.offset
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.weight.shape[0]:
            raise ValueError(
                f"sequence needs position {int(positions.max())} but the learned position table has "
                f"{self.weight.shape[0]} rows (max_seq_len={self.weight.shape[0]}, offset={self.offset})")
        return x + nn.functional.embedding(positions, self.weight)


class Rotation:
    """RoPE at given positions: ``rotation(q, k)`` rotates queries (B, H, T, d) and keys (B, Hkv, T, d) by the cos/sin
    rows ``cos``, ``sin`` ((T, d) or (B, 1, T, d)) that :meth:`RotaryPositions.rotation` looked up for ``positions``."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
        self.positions = positions
        self._by_dtype = {cos.dtype: (cos, sin)}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._by_dtype.get(dtype)
        if found is None:  # e.g. bf16 under autocast: cast once, not per layer
            cos, sin = next(iter(self._by_dtype.values()))
            found = self._by_dtype[dtype] = (cos.to(dtype), sin.to(dtype))
        return found

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = self.tables(q.dtype)
        return _rope(q, c, s), _rope(k, c, s)


class RotaryPositions(NoPosition):
    """Differs from none: rotates each (q, k) coordinate pair by p*theta_j (Su et al. 2021), so
    q_m.k_n depends only on n - m. Pairs are (j, j + d/2), the layout of HF Llama checkpoints. The frequencies
    may be rescaled for a longer context (``cfg.rope_scaling``, one of ROPE_SCALINGS)."""

    has_rotation = True
    rotation_type = Rotation  # what ``rotation`` returns

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        d = cfg.dh
        inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # theta_j, (d/2,)
        inv_freq = ROPE_SCALINGS[cfg.rope_scaling](inv_freq, cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._max = cfg.max_seq_len

    def _cos_sin(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cache is None or self._cache[0] < n or self._cache[1].device != device:
            n = max(n, self._max)
            angles = torch.arange(n, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)
            angles = torch.cat([angles, angles], dim=-1)  # (n, d)
            self._cache = (n, angles.cos(), angles.sin())
        return self._cache[1], self._cache[2]

    def rotate(self, q, k, positions):
        """q: (B, H, T, d), k: (B, Hkv, T, d), positions: (B, T) or (T,)."""
        return self.rotation(positions)(q, k, positions)

    def rotation(self, positions: torch.Tensor, length: int | None = None) -> Rotation:
        """``rotate`` with the cos/sin rows of ``positions`` looked up once: a stack calls this once per forward
        and every layer reuses the tables. ``length``: the tables must cover positions < length (a static cache's
        capacity; None: read max(positions), which a compiled step cannot do)."""
        cos, sin = self._cos_sin(int(positions.max()) + 1 if length is None else length, positions.device)
        cos, sin = cos[positions], sin[positions]  # (B, T, d) or (T, d)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d)
        return self.rotation_type(cos, sin, positions)


def llama3_inv_freq(inv_freq: torch.Tensor, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (Meta's ``apply_scaling``; transformers' ``rope_type="llama3"``).

    With L = original_max_seq_len and wavelength w_j = 2 pi / theta_j: frequencies with w_j > L / low_freq_factor
    (they never turned a full circle in pretraining) are divided by ``factor``; those with w_j < L / high_freq_factor
    are kept; in between, s = (L / w_j - low_freq_factor) / (high_freq_factor - low_freq_factor) blends the two:
    (1 - s) theta_j / factor + s theta_j. inv_freq: (d/2,) theta_j; returns the scaled (d/2,) frequencies.
    """
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return llama3_inv_freq(inv_freq, factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                           high_freq_factor=cfg.rope_high_freq_factor,
                           original_max_seq_len=cfg.rope_original_max_seq_len)


# cfg.rope_scaling -> fn(theta_j (d/2,), cfg) -> the frequencies RoPE rotates by
ROPE_SCALINGS = {
    "none": lambda inv_freq, cfg: inv_freq,
    "llama3": _llama3,
}


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RelativeBias(NoPosition):
    """Differs from none: a learned per-head scalar for each bucket of (key - query) distance,
    added to QK^T (T5, Raffel et al. 2020 §2.1). Buckets are exact for small distances and
    logarithmic up to relative_max_distance; encoders bucket both directions, decoders only the past."""

    has_bias = True

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        self.bidirectional = not causal
        self.n_buckets = cfg.relative_buckets
        self.max_distance = cfg.relative_max_distance
        self.bias_table = nn.Embedding(cfg.relative_buckets, cfg.n_heads)  # (buckets, H)
        nn.init.normal_(self.bias_table.weight, std=0.02)

    def bucket(self, relative: torch.Tensor) -> torch.Tensor:
        """relative = key_pos - query_pos (any shape) -> bucket index in [0, n_buckets)."""
        n = self.n_buckets
        out = torch.zeros_like(relative)
        if self.bidirectional:
            n //= 2
            out = out + (relative > 0).long() * n  # keys to the right use the upper half
            dist = relative.abs()
        else:
            dist = (-relative).clamp(min=0)  # only the past has distinct buckets
        exact = n // 2
        log_part = torch.log(dist.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
        large = exact + (log_part * (n - exact)).long()
        large = large.clamp(max=n - 1)
        return out + torch.where(dist < exact, dist, large)

    def bias(self, q_pos, k_pos):
        rel = k_pos[None, :] - q_pos[:, None]  # (Tq, Tk)
        values = self.bias_table(self.bucket(rel))  # (Tq, Tk, H)
        return values.permute(2, 0, 1)[None]  # (1, H, Tq, Tk)


def log_buckets(relative: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """DeBERTa's log-bucketed relative positions (transformers' ``make_log_bucket_position``, the same float32 ops):
    distances below buckets / 2 are kept, longer ones become sign(r) * (mid + ceil(log(|r| / mid) /
    log((max_distance - 1) / mid) * (mid - 1))) with mid = buckets // 2, so max_distance - 1 lands on buckets - 1.
    relative: any shape of integer distances -> the same shape, long."""
    sign = torch.sign(relative)
    mid = buckets // 2
    near = (relative < mid) & (relative > -mid)
    dist = torch.where(near, torch.tensor(mid - 1).type_as(relative), relative.abs())
    log_base = torch.log(torch.tensor((max_distance - 1) / mid, device=relative.device))  # float32, as transformers
    log_pos = torch.ceil(torch.log(dist / mid) / log_base * (mid - 1)) + mid
    return torch.where(dist <= mid, relative.type_as(log_pos), log_pos * sign).long()


class DisentangledPositions(NoPosition):
    """Differs from none: DeBERTa's disentangled attention (He et al. 2021 §3.1, the v2/v3 form). Relative
    distances delta(i, j) = bucket(i - j) index 2 * span learned vectors P (LayerNorm'd, shared by the layers); each
    layer projects them with its own query and key projections (share_att_key) and adds to q_i.k_j the
    content-to-position term q_i.Pk[delta] and the position-to-content term k_j.Pq[delta], all three on the scale
    1/sqrt(3 Dh). span = position_buckets (0: max_relative_positions, distances clipped there)."""

    has_scores = True
    score_terms = 2  # c2p and p2c

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        self.buckets, self.max_distance = cfg.position_buckets, cfg.max_relative_positions
        self.span = cfg.position_buckets or cfg.max_relative_positions
        self.rel_embed = nn.Embedding(2 * self.span, cfg.dim)  # (2 span, dim): distances -span..span-1
        nn.init.normal_(self.rel_embed.weight, std=0.02)
        self.rel_norm = make_norm(cfg)
        self.drop = Dropout(cfg.dropout)  # transformers' pos_dropout, drawn again in each layer

    def bucket(self, relative: torch.Tensor) -> torch.Tensor:
        """relative = query_pos - key_pos (any shape) -> the index of its vector in rel_embed, in [0, 2 span)."""
        delta = log_buckets(relative, self.buckets, self.max_distance) if self.buckets else relative
        return (delta + self.span).clamp(0, 2 * self.span - 1)

    def scores(self, q_pos, k_pos):
        rel = self.rel_norm(self.rel_embed.weight)  # (2 span, dim), once per forward for every layer
        index = self.bucket(q_pos[:, None] - k_pos[None, :])  # (Tq, Tk)

        def score(q, k, q_proj, k_proj):
            B, H, Tq, Dh = q.shape
            Tk = k.shape[2]
            r = self.drop(rel).to(q.dtype)
            pos_q = q_proj(r).view(-1, H, Dh).transpose(0, 1)  # (2 span, H*Dh) -> (H, 2 span, Dh)
            pos_k = k_proj(r).view(-1, H, Dh).transpose(0, 1)
            c2p = (q @ pos_k.transpose(-1, -2)).gather(-1, index.expand(B, H, Tq, Tk))  # q_i . Pk[delta(i, j)]
            # k_j . Pq[delta(i, j)]: (B, H, Tk, 2 span) gathered at (j, delta(i, j)), then (B, H, Tq, Tk)
            p2c = (k @ pos_q.transpose(-1, -2)).gather(-1, index.T.expand(B, H, Tk, Tq)).transpose(-1, -2)
            return c2p + p2c

        return score


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """m_i = 2^(-8i/h), i = 1..h (Press et al. 2022); for h not a power of two, the slopes of the
    nearest lower power of two followed by every other slope of the next power (the paper's recipe)."""

    def pow2(h: int) -> list[float]:
        return [2.0 ** (-8.0 * i / h) for i in range(1, h + 1)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(pow2(n_heads))
    low = 2 ** math.floor(math.log2(n_heads))
    return torch.tensor(pow2(low) + pow2(2 * low)[0::2][: n_heads - low])


class ALiBi(NoPosition):
    """Differs from none: adds -m_h * |i - j| to head h's attention logits; no learned parameters."""

    has_bias = True

    def __init__(self, cfg: ModelConfig, *, causal: bool):
        super().__init__(cfg, causal=causal)
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        dist = (k_pos[None, :] - q_pos[:, None]).abs().float()  # (Tq, Tk)
        return -self.slopes[None, :, None, None] * dist[None, None]  # (1, H, Tq, Tk)


POSITIONS = {
    "none": NoPosition,
    "sinusoidal": SinusoidalPositions,
    "learned": LearnedPositions,
    "rope": RotaryPositions,
    "relative": RelativeBias,
    "alibi": ALiBi,
    "disentangled": DisentangledPositions,
}
