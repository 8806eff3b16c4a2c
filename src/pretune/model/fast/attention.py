"""Fast self-attention: q, k and v as one matmul, rotated and written into the cache as one token-major tensor.

:class:`FastAttention` overrides the reference attention's two seams, ``project`` and ``self_qkv``
(``model/attention.py``), and ``attend`` for one query per row in bf16 or fp16 on CPU (a decoding step);
everything else (masks, SDPA or the eager path, the output projection) is the reference's.

One query in bf16 on CPU. For a decoding step (one new token per row), PyTorch's CPU SDPA in bf16 takes ~10x as
long as the same attention written as two matmuls and a softmax (measured on an AMD EPYC with AVX512-BF16: 1.2 vs
0.13 ms for 32 rows of SmolLM2's 9 heads over 111 keys; its fp32 kernel takes 0.19 ms) — the kernel is built for
blocks of queries. :meth:`FastAttention.attend` therefore computes one query's attention itself: the scores of a
kv head's query heads against its keys as one matmul in fp32 (q and k upcast, so the scores are not rounded to
bf16 before the softmax, as SDPA's kernel keeps them), the mask added, the softmax in fp32, its probabilities in the
values' dtype times the values. The same maths up to rounding; the forward and the flat decoding step
(``decode_step.py``) both call it, so their logits stay bitwise equal.

Training in bf16 on CPU with short rows. SDPA's CPU backward in bf16 is slow too: forward and backward of 32 rows of
111 tokens (SmolLM2's 9 query and 3 kv heads; a GRPO step's completions) take ~3.5x as long as the same attention as
batched matmuls with the probabilities kept in bf16 for the backward (:class:`_ShortAttention`, one thread on an AMD
EPYC with AVX512-BF16: ~300 vs ~85 ms). Keeping the probabilities costs B x H x T x S x 2 bytes a layer (7 MB there),
so :meth:`FastAttention.attend` takes this path only where that stays small (``SHORT_ATTENTION_ELEMENTS``), in bf16
or fp16 on CPU, with or without autograd (without it, its forward alone is within ~1.5x of SDPA's either way, and
the same kernel in both keeps a policy's log-probs equal to its reference's); longer rows keep SDPA's kernel, which
holds no probabilities.
"""

from __future__ import annotations

import torch

from ..attention import Attention, _causal_bias
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

    def attend(self, q, k, v, mask, is_causal):
        if (not q.is_cpu or q.dtype not in (torch.bfloat16, torch.float16) or self.softcap is not None
                or (self.training and self.dropout > 0)):
            return super().attend(q, k, v, mask, is_causal)
        # the kernel follows from the shapes alone, never from grad mode or train/eval mode: a policy and its
        # reference, or the log-probs a rollout keeps and the loss's, compute the same attention bitwise
        B, H, T, _ = q.shape
        if T == 1 and not is_causal:
            return attend_one_query(q, k, v, mask, self.scale)
        if B * H * T * k.shape[2] <= SHORT_ATTENTION_ELEMENTS and not torch.compiler.is_compiling():
            if is_causal:
                bias = _causal_bias(T, k.shape[2], torch.float32, q.device)[None, None]  # (1, 1, T, S)
                mask = bias if mask is None else mask + bias
            return _ShortAttention.apply(q, k, v, mask, self.scale if self.scale is not None else q.shape[-1] ** -0.5)
        return super().attend(q, k, v, mask, is_causal)

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


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float | None) -> torch.Tensor:
    """Attention of one query per row (a decoding step), as two matmuls and an fp32 softmax (see the module's
    docstring). q: (B, H, 1, Dh); k, v: (B, Hkv, S, Dh) with H a multiple of Hkv; mask: additive, (B|1, H|1, 1, S),
    or None. Returns (B, H, 1, Dh) in v's dtype."""
    B, H, _, dh = q.shape
    hkv, S = k.shape[1], k.shape[2]
    g = H // hkv
    scores = torch.matmul(q.reshape(B, hkv, g, dh).float(), k.transpose(-1, -2).float())  # (B, Hkv, G, S)
    scores.mul_(scale if scale is not None else dh ** -0.5)
    if mask is not None:  # (B|1, H|1, 1, S) -> broadcastable onto (B, Hkv, G, S)
        scores.add_(mask.reshape(mask.shape[0], hkv, g, S) if mask.shape[1] != 1 else mask)
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(B, H, 1, dh)


SHORT_ATTENTION_ELEMENTS = 1 << 23  # B x H x T x S up to which training attention keeps its bf16 probabilities (16 MB)


class _ShortAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v for q (B, H, T, Dh), k and v (B, Hkv, S, Dh), in the inputs' low precision
    with the scores and the softmax in fp32: a kv head's query heads as the rows of one matmul, the probabilities kept
    in bf16 for the backward (dv = p^T do, ds = p (do v^T - rowsum(do o)) * scale, dq = ds k, dk = ds^T q). See the
    module's docstring for when and why. mask: additive, (B|1, H|1, T, S), or None."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        B, H, T, dh = q.shape
        hkv, S = k.shape[1], k.shape[2]
        g = H // hkv
        qg = q.reshape(B, hkv, g * T, dh)  # a kv head's query heads, one after another, as rows
        with torch.autocast(q.device.type, enabled=False):
            scores = torch.matmul(qg, k.transpose(-1, -2)).view(B, hkv, g, T, S).float().mul_(scale)
            if mask is not None:  # (B|1, H|1, T|1, S) onto (B, Hkv, G, T, S)
                m, mh = mask.shape[0], mask.shape[1]
                mask = mask.expand(m, mh, T, S)
                scores.add_(mask.reshape(m, 1, 1, T, S) if mh == 1 else mask.reshape(m, hkv, g, T, S))
            probs = torch.softmax(scores, dim=-1).to(q.dtype).view(B, hkv, g * T, S)
            del scores
            out = torch.matmul(probs, v)  # (B, Hkv, G T, Dh)
        ctx.save_for_backward(qg, k, v, probs, out)
        ctx.scale = scale
        return out.view(B, H, T, dh)

    @staticmethod
    def backward(ctx, grad_out):
        qg, k, v, probs, out = ctx.saved_tensors
        with torch.autocast(qg.device.type, enabled=False):
            do = grad_out.reshape(out.shape).to(qg.dtype)
            dv = torch.matmul(probs.transpose(-1, -2), do)  # (B, Hkv, S, Dh): summed over each kv head's queries
            dp = torch.matmul(do, v.transpose(-1, -2)).float()  # (B, Hkv, G T, S)
            delta = (do.float() * out.float()).sum(-1, keepdim=True)  # rowsum(do * o) = rowsum(p * dp)
            ds = dp.sub_(delta).mul_(probs).mul_(ctx.scale).to(qg.dtype)
            dq = torch.matmul(ds, k).reshape(grad_out.shape)
            dk = torch.matmul(ds.transpose(-1, -2), qg)
        return dq, dk, dv, None, None
