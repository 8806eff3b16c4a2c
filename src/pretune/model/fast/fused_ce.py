"""Linear + cross-entropy in one pass over row chunks, without materialising the (N, vocab) logits.

For each chunk of rows: logits z = h W^T, loss = logsumexp(z) - z[target], and since the loss is
a scalar, its gradient dL/dz = (softmax(z) - onehot(target)) / n is known in the forward pass, so
dL/dh = dL/dz W and dL/dW = dL/dz^T h are accumulated right away and the chunk's logits freed.
Same FLOPs as head + cross_entropy, a fraction of the memory traffic (no fp32 logits, no separate
log_softmax backward). The idea of Liger-Kernel's FusedLinearCrossEntropy, written for CPU/GPU torch.
"""

from __future__ import annotations

import weakref

import torch

from ..heads import IGNORE_INDEX, LMHead

_CASTS: dict[int, tuple] = {}  # id(frozen weight) -> (weakref to it, key, its low-precision copy); freed with it


def _cast_frozen(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)``, kept for the next call while the weight is frozen and unchanged (a LoRA run's tied
    embedding: 28M parameters cast once instead of once per step; an in-place update bumps ``_version``)."""
    if weight.dtype == dtype or weight.requires_grad or torch.compiler.is_compiling():
        return weight.to(dtype)
    key = (weight.data_ptr(), weight._version, dtype)
    hit = _CASTS.get(id(weight))
    if hit is None or hit[0]() is not weight or hit[1] != key:
        if len(_CASTS) >= 4:  # models come and go: keep the copies of the few heads in use
            _CASTS.clear()
        i = id(weight)
        hit = _CASTS[i] = (weakref.ref(weight, lambda _: _CASTS.pop(i, None)), key, weight.detach().to(dtype))
    return hit[2]


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk, bias):  # h (N, d), weight (V, d), targets (N,), bias (V,) or None
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), _cast_frozen(weight, dtype)
            bf = bias.float() if bias is not None else None  # a fixed logit bias (BART): no gradient
            valid = targets != IGNORE_INDEX
            n = valid.sum().clamp(min=1)
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # a frozen head (PEFT) skips grad_w
            grad_h = torch.empty_like(hc) if need_h else None
            grad_w = None  # (V, d) fp32, the first chunk's product (no zero-filled buffer)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            for s in range(0, hc.shape[0], chunk):
                hs, ts, vs = hc[s:s + chunk], targets[s:s + chunk], valid[s:s + chunk]
                z = (hs @ wc.t()).float()  # (c, V) logits
                if bf is not None:
                    z.add_(bf)
                safe_t = ts.clamp(min=0)
                picked = z.gather(1, safe_t[:, None]).squeeze(1)  # (c,) logit of the target
                top = z.amax(dim=-1, keepdim=True)  # (c, 1)
                z.sub_(top).exp_()  # exp(z - max), in place: no second (c, V) buffer
                total = z.sum(dim=-1, keepdim=True)  # (c, 1)
                lse = (top + total.log()).squeeze(1)  # logsumexp(z)
                loss += ((lse - picked) * vs).sum()
                if not (need_h or need_w):  # evaluation: the loss only
                    continue
                w_row = vs.float() / n  # mean over valid targets; ignored rows get weight 0
                z.mul_(w_row[:, None] / total)  # softmax(z) / n
                z[torch.arange(z.shape[0], device=z.device), safe_t] -= w_row  # - onehot / n
                g = z.to(dtype)
                if need_h:
                    grad_h[s:s + chunk] = g @ wc
                if need_w:  # (V, d), accumulated in fp32 (in place when the chunks are fp32: no (V, d) temporary)
                    if grad_w is None:
                        grad_w = (g.t() @ hs).float()
                    elif g.dtype == grad_w.dtype:
                        grad_w.addmm_(g.t(), hs)
                    else:
                        grad_w.add_(g.t() @ hs)
            if need_w and grad_w is None:  # no rows at all
                grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ctx.save_for_backward(grad_h, grad_w)  # None for an input that needs no gradient
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # loss.backward() passes 1: hand over the gradients computed in the forward as they are. The engine frees
        # the saved tensors before accumulating, so the (vocab, dim) weight gradient becomes .grad without a copy
        # (a product would allocate another one while every activation is still held: the backward's peak)
        one = grad_out.numel() == 1 and float(grad_out) == 1.0
        return (None if grad_h is None else (grad_h if one else grad_h * grad_out).to(h_dtype),
                None if grad_w is None else (grad_w if one else grad_w * grad_out).to(w_dtype), None, None, None)


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               *, chunk: int = 1024, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits h @ weight.T (+ bias) against targets (-100 ignored).

    Args:
        h: (N, d) hidden states; weight: (V, d) output embedding; targets: (N,) token ids.
        bias: (V,) a fixed logit bias (BART's final_logits_bias); it gets no gradient.
        chunk: rows per chunk; memory holds one (chunk, V) block of logits at a time.
    With no valid target the loss is 0 with zero gradients (F.cross_entropy would give NaN).
    """
    return _FusedLinearCrossEntropy.apply(h, weight, targets, chunk, bias)


class _FusedLinearTokenLogprobs(torch.autograd.Function):
    """log p(target) per row of softmax((h W^T + bias) / temperature), a row chunk of logits at a time; the backward
    computes each chunk's logits again (one more matmul) instead of keeping (N, vocab) of them. Unlike the mean
    cross-entropy's, the gradient is not known in the forward: each token's comes from the loss above it."""

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, chunk, bias):
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        with torch.autocast(dev, enabled=False):
            hc, wc = h.to(dtype), _cast_frozen(weight, dtype)
            out = torch.empty(hc.shape[0], dtype=torch.float32, device=h.device)
            lse = torch.empty_like(out)
            for s in range(0, hc.shape[0], chunk):
                z = _chunk_logits(hc[s:s + chunk], wc, bias, temperature)
                lse[s:s + chunk] = torch.logsumexp(z, dim=1)
                out[s:s + chunk] = z.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse[s:s + chunk]
        ctx.save_for_backward(hc, weight, targets, lse, bias)
        ctx.meta = (temperature, chunk, dtype, h.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out (N,): d loss / d log p(target)
        hc, weight, targets, lse, bias = ctx.saved_tensors
        temperature, chunk, dtype, h_dtype = ctx.meta
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hc) if need_h else None
        grad_w = None
        with torch.autocast(hc.device.type, enabled=False):
            wc = _cast_frozen(weight, dtype)
            for s in range(0, hc.shape[0], chunk):
                hs, g = hc[s:s + chunk], grad_out[s:s + chunk].float()
                z = _chunk_logits(hs, wc, bias, temperature)
                # d log p(t) / dz = onehot(t) - softmax(z), then / temperature for the logits before the division
                z.sub_(lse[s:s + chunk, None]).exp_().mul_(-(g / temperature)[:, None])
                z.scatter_add_(1, targets[s:s + chunk, None], (g / temperature)[:, None])
                gz = z.to(dtype)
                if need_h:
                    grad_h[s:s + chunk] = gz @ wc
                if need_w:
                    grad_w = (gz.t() @ hs).float() if grad_w is None else grad_w.add_(gz.t() @ hs)
        if need_w and grad_w is None:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return (None if grad_h is None else grad_h.to(h_dtype),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None)


def _chunk_logits(hs: torch.Tensor, wc: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = (hs @ wc.t()).float()  # (c, V)
    if bias is not None:
        z.add_(bias.float())  # a fixed logit bias: no gradient
    return z.div_(temperature) if temperature != 1.0 else z


def fused_linear_token_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                temperature: float = 1.0, chunk: int = 512,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target) (N,) in fp32 under softmax((h @ weight.T + bias) / temperature), without the (N, vocab)
    logits: memory holds one (chunk, vocab) block at a time, forward and backward (the backward computes the
    chunk's logits again). GRPO's and preference tuning's per-token log-probabilities: with 2,048 completion tokens
    of SmolLM2, the (2,048 x 49,152) fp32 logits, their copy at the temperature and the log-softmax's gradient come
    to ~1.2 GB. ``bias`` is a fixed logit bias (no gradient)."""
    return _FusedLinearTokenLogprobs.apply(h, weight, targets, float(temperature), chunk, bias)


class FastLMHead(LMHead):
    """LMHead (same weights, same logits) whose ``cross_entropy`` runs :func:`fused_linear_cross_entropy`: the
    (N, vocab) logits are never built. Equal to the reference's loss and gradients up to rounding."""

    def cross_entropy(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.fusable:
            return super().cross_entropy(h, targets)
        x = h * self.scale if self.scale is not None else h
        if self.proj is not None:
            x = self.proj(x)
        return fused_linear_cross_entropy(x, self.weight, targets, bias=self.bias)

    def token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        if not self.fusable:
            return super().token_logprobs(h, targets, temperature)
        x = h * self.scale if self.scale is not None else h
        if self.proj is not None:
            x = self.proj(x)
        return fused_linear_token_logprobs(x, self.weight, targets, temperature=temperature, bias=self.bias)
