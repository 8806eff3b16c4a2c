"""Fast RoPE: for a few tokens (decoding), the rotation of every q and k head as one batched matmul with each
position's (d, d) rotation matrix, on the fused q/k/v projection's token-major heads (``fast/attention.py``)."""

from __future__ import annotations

import torch

from ..position import RotaryPositions, Rotation, _rope


class FastRotation(Rotation):
    """A Rotation that also rotates token-major heads (``heads``, ``step``): the same products and sums as the
    reference's elementwise form, so the same values up to rounding."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
        super().__init__(cos, sin, positions)
        self._per_token = {}  # (dtype, n, heads) -> each position's rotation of each head as a (d, d) matrix

    def matrices(self, y: torch.Tensor, n: int, h: int, d: int) -> torch.Tensor | None:
        """(T, h, d, d) or (B, T, h, d, d): each position's rotation matrix per head of y (B, T, ...), built once per
        forward (cos on the diagonal, +-sin at the pair's other coordinate, the identity for the heads after the first
        n); None when they would be large (many tokens, or many rows with their own positions)."""
        positions = self.positions
        B, T = y.shape[0], y.shape[1]
        if (1 if positions.dim() == 1 else B) * T * h * d * d > 1 << 20:
            return None
        key = (y.dtype, n, h)
        mats = self._per_token.get(key)
        if mats is None:
            c, s = self.tables(y.dtype)  # (T, d) or (B, 1, T, d)
            c, s = (c[:, 0], s[:, 0]) if c.dim() == 4 else (c, s)  # (B, T, d) or (T, d)
            lead = c.shape[:-1]
            # cos 1 and sin 0 on the value heads: (..., h, d)
            c = torch.cat([c[..., None, :].expand(*lead, n, d), c.new_ones(*lead, h - n, d)], -2)
            s = torch.cat([s[..., None, :].expand(*lead, n, d), s.new_zeros(*lead, h - n, d)], -2)
            mats = self._per_token[key] = torch.diag_embed(c) + _half_turn(d, y.dtype, y.device) * s[..., None, :]
        return mats

    def heads(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """Token-major heads y (B, T, heads, d) with the first ``n`` rotated (the q and k heads of the fused q/k/v
        projection; the value heads after them are kept). For a few tokens (decoding) the rotation is one batched
        matmul with each position's (d, d) rotation matrix per head (:meth:`matrices`), instead of the dozen
        elementwise calls of the reference for q and k: the same products and sums, so the same values up to
        rounding; a new tensor. For more tokens, the reference's elementwise rotation on the q and k heads of y in
        place."""
        B, T, h, d = y.shape
        mats = self.matrices(y, n, h, d)
        if mats is not None:
            if self.positions.dim() == 1:  # (T, h, B, d) @ (T, h, d, d): the batch rows are the matmul's rows
                return torch.matmul(y.permute(1, 2, 0, 3), mats).permute(2, 0, 1, 3)
            return torch.matmul(y.unsqueeze(-2), mats).squeeze(-2)  # (B, T, h, 1, d) @ (B, T, h, d, d)
        c, s = self.tables(y.dtype)
        c, s = (c[:, 0, :, None], s[:, 0, :, None]) if c.dim() == 4 else (c[:, None], s[:, None])
        qk = y.narrow(2, 0, n)
        qk.copy_(_rope(qk, c, s))
        return y

    def step(self, y: torch.Tensor, n: int, d: int) -> torch.Tensor:
        """:meth:`heads` for one token per row, from the fused projection's output y (B, 1, h * d) to head-major
        (B, h, 1, d), with fewer view calls (a decoding step): the same matmul on the same operands, so the same
        values as ``heads(y.unflatten(-1, (-1, d)), n).transpose(1, 2)``."""
        B, h = y.shape[0], y.shape[-1] // d
        mats = self.matrices(y, n, h, d)
        if mats is None:
            return self.heads(y.view(B, 1, h, d), n).transpose(1, 2)
        if self.positions.dim() == 2:  # each row its own positions: (B, 1, h, 1, d) @ (B, 1, h, d, d)
            return torch.matmul(y.view(B, 1, h, 1, d), mats).view(B, h, 1, d)
        if B == 1:  # (1, h, 1, d) @ (1, h, d, d) is already head-major
            return torch.matmul(y.view(1, h, 1, d), mats)
        return torch.matmul(y.view(B, 1, h, d).permute(1, 2, 0, 3), mats).permute(2, 1, 0, 3)


class FastRotaryPositions(RotaryPositions):
    """RotaryPositions whose rotations are :class:`FastRotation` (same tables, same values)."""

    rotation_type = FastRotation


_HALF_TURNS: dict[tuple, torch.Tensor] = {}


def _half_turn(d: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(d, d) R with x @ R = cat(-x2, x1) (the sin term of the reference's rotation as a matrix): -1 at (j + d/2, j),
    +1 at (j, j + d/2). Cached per size, dtype and device."""
    key = (d, dtype, str(device), torch.is_inference_mode_enabled())
    r = _HALF_TURNS.get(key)
    if r is None:
        half = torch.arange(d // 2, device=device)
        r = torch.zeros(d, d, dtype=dtype, device=device)
        r[half + d // 2, half] = -1.0
        r[half, half + d // 2] = 1.0
        _HALF_TURNS[key] = r
    return r


