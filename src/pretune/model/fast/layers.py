"""Fast norms and feed-forward blocks: the same parameters and maths as ``model/layers.py``, in fewer passes.

- :class:`FastRMSNorm`: torch's fused RMSNorm kernel; under autograd a function with its backward written out;
  a decoding step's few rows as one ``layer_norm`` over (x, -x).
- :class:`FastFeedForward`: gate and up as one matmul; in training a function that keeps only their joint output
  for the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import FeedForward, RMSNorm, RMSNormPlusOne, _gelu_tanh
from .linears import FusedLinears


def _rms_norm_composite(x, shape, weight, eps):
    return F.rms_norm(x, shape, weight, eps)


def _rms_norm_fused(x, shape, weight, eps):
    if torch.compiler.is_compiling():  # dynamo does not trace the kernel; inductor fuses the composite anyway
        return F.rms_norm(x, shape, weight, eps)
    return torch._fused_rms_norm(x, list(shape), weight, eps)[0]


# torch's fused RMSNorm kernel (forward and backward), where this torch has it: F.rms_norm is a composite of ~6
# kernels on the CPU (2.13). Bitwise the same results (tests/model/test_layers.py); on one decoding token of
# SmolLM2 9 vs 36 us per call (1 thread), on an 8 x 256 x 512 batch's forward + backward ~1.4x faster.
rms_norm = _rms_norm_fused if hasattr(torch, "_fused_rms_norm") else _rms_norm_composite


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm under autograd with its backward written out: y = x * r * w, r = 1 / sqrt(mean(x^2) + eps) (in
    fp32), and dL/dx = r * (g w - x_hat * mean(g w x_hat)) with x_hat = x * r, dL/dw = sum over rows of g x_hat.

    Keeps only x and r (one value per row) for the backward and recomputes x_hat there, where autograd through
    torch's CPU kernel (2.13: pow, mean, add, rsqrt and two muls, each differentiated) keeps more and makes about
    twice the passes over the activations; with a frozen gain (every PEFT base) dL/dw is not computed at all. The
    forward is bitwise torch's; the input gradient agrees to rounding (tests/model/test_layers.py). Used for fp32
    inputs only (under bf16 autocast the residual stream, so every norm's input, is fp32 too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, r)
        return (x * r).mul_(weight)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        x_hat = x * r
        dx = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dx = torch.addcmul(gw, x_hat, (gw * x_hat).mean(-1, keepdim=True), value=-1).mul_(r)
        dw = (g * x_hat).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# Rows up to which a CPU RMSNorm outside autograd runs as one layer_norm (see FastRMSNorm): the decoding steps.
LEAN_NORM_ROWS = 64
_SIGNS = torch.tensor([[1.0], [-1.0]])  # x.unsqueeze(-2) * _SIGNS is (x, -x) in one op


class FastRMSNorm(RMSNorm):
    """RMSNorm (same weight, same values) through torch's fused kernel; under autograd in fp32 through
    :class:`_RMSNormFunction`; a few fp32 rows on the CPU outside autograd (a decoding step) as one ``layer_norm`` over
    (x, -x): the 2d values have mean 0 and variance mean(x^2), so the first half of their layer norm is
    x / sqrt(mean(x^2) + eps) * g. That is one kernel where torch's CPU RMSNorm is eight (2.13), ~0.4 ms of SmolLM2's
    ~27 ms per token; the same values up to rounding (tests/model/test_fast.py), and the row count alone picks the
    path, so a decoding step and the model's forward on the same token agree bitwise."""

    def __init__(self, *args, **kwargs):  # built directly (accelerate() swaps the class of a built one instead)
        super().__init__(*args, **kwargs)
        self._init_fast()

    def _init_fast(self) -> None:
        self._gain2: tuple | None = None  # (key, (2, dim) gain, storage) for the layer_norm path

    def _lean(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer_norm path's result, or None where it does not apply (many rows, autograd, not the CPU)."""
        w = self.weight
        if (not x.is_cpu or x.numel() > LEAN_NORM_ROWS * x.shape[-1] or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return None
        return F.layer_norm(x.unsqueeze(-2) * _SIGNS, (2, x.shape[-1]), self.rows_gain(), None, self.eps).select(-2, 0)

    def rows_gain(self) -> torch.Tensor:
        """The (2, dim) fp32 gain of the layer_norm path over the rows (x, -x), built once per weight version."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        gain2 = self._gain2
        if gain2 is None or gain2[0] != key:
            # an ordinary tensor, usable in and out of inference mode (inference_mode(False) turns grad mode on:
            # no_grad goes inside it)
            with torch.inference_mode(False), torch.no_grad():
                g = self.gain().float()
                # (the weight's storage is held: a freed one's address cannot come back under the same key)
                gain2 = self._gain2 = (key, torch.stack([g, g]), w.untyped_storage())
        return gain2[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu and torch.is_grad_enabled():  # CUDA training: torch's own kernels are faster (H200: the
            return super().forward(x)  # written-out backward made a bf16 training step 0.72-0.89x; BENCHMARKS.md)
        if x.dtype == torch.float32:
            w = self.weight
            if (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad) and w.dtype == torch.float32
                    and not torch.compiler.is_compiling()):  # training (compiled: inductor fuses the composite)
                return _RMSNormFunction.apply(x, w, self.eps)
            y = self._lean(x)
            return y if y is not None else rms_norm(x, w.shape, w, self.eps)
        # low precision: normalise in fp32, scale in the weight's dtype (as T5/Llama do)
        y = rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return self.weight.to(x.dtype) * y


class FastRMSNormPlusOne(FastRMSNorm, RMSNormPlusOne):
    """RMSNormPlusOne (gain 1 + g, Gemma) on FastRMSNorm's kernels (no written-out backward: its gain is 1 + g)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            y = self._lean(x)
            return y if y is not None else rms_norm(x, self.weight.shape, self.gain(), self.eps)
        return rms_norm(x.float(), self.weight.shape, self.gain(), self.eps).to(x.dtype)


# act -> fn(grad, x, out): act's backward at x written into ``out`` (the kernels autograd's own backward nodes run)
_ACT_BACKWARD = {
    F.silu: lambda grad, x, out: torch.ops.aten.silu_backward.grad_input(grad, x, grad_input=out),
    F.gelu: lambda grad, x, out: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="none",
                                                                        grad_input=out),
    _gelu_tanh: lambda grad, x, out: torch.ops.aten.gelu_backward.grad_input(grad, x, approximate="tanh",
                                                                            grad_input=out),
}


class _GatedDown(torch.autograd.Function):
    """down(act(gate) * up) from the fused gate/up output with only that output saved for the backward: the inner
    activation act(gate) * up (and act(gate)) are recomputed there instead of kept, two (N, ffn_dim) tensors per
    layer fewer held between forward and backward. Same kernels as the plain path (linear; the activation's own
    backward kernel), so the same values and gradients."""

    @staticmethod
    def forward(ctx, gate_up, weight, bias, act):  # gate_up (..., 2F) = [gate | up]; weight (dim, F)
        gate, up = gate_up.chunk(2, dim=-1)
        inner = act(gate) * up
        out = F.linear(inner, weight.to(inner.dtype), None if bias is None else bias.to(inner.dtype))
        ctx.save_for_backward(gate_up, weight)
        ctx.act, ctx.has_bias = act, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate_up, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        act_backward = _ACT_BACKWARD.get(ctx.act)
        if act_backward is None or grad_out.dtype != gate_up.dtype:
            return _GatedDown._backward_through_autograd(ctx, grad_out, gate_up, weight, need_x, need_w)
        gate, up = gate_up.chunk(2, dim=-1)
        a = ctx.act(gate)
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        # a frozen down projection (a LoRA base) gets no weight gradient: that product is a third of this backward
        grad_w = (flat.t() @ (a * up).reshape(-1, a.shape[-1])).to(weight.dtype) if need_w else None
        grad_b = flat.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_gate_up = None
        if need_x:
            # d inner = grad_out W; d up = d inner * act(gate); d gate = act'(gate) * (d inner * up): what autograd's
            # Mul and activation nodes compute, written straight into the two halves of one (..., 2F) gradient
            # (autograd would allocate each and concatenate them for the chunk)
            grad_inner = grad_out @ weight.to(a.dtype)  # (..., F)
            grad_gate_up = torch.empty_like(gate_up)
            grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
            torch.mul(grad_inner, a, out=grad_up)
            act_backward(grad_inner.mul_(up), gate, grad_gate)
        return grad_gate_up, grad_w, grad_b, None

    @staticmethod
    def _backward_through_autograd(ctx, grad_out, gate_up, weight, need_x: bool, need_w: bool):
        """Any other activation (or mixed dtypes): recompute under autograd and let it differentiate."""
        with torch.enable_grad():
            leaf = gate_up.detach().requires_grad_(need_x)
            gate, up = leaf.chunk(2, dim=-1)
            inner = ctx.act(gate) * up
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = (flat.t() @ inner.detach().reshape(-1, inner.shape[-1])).to(weight.dtype) if need_w else None
        grad_b = flat.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_gate_up = None
        if need_x:
            grad_inner = grad_out @ weight.to(inner.dtype)  # (..., F)
            (grad_gate_up,) = torch.autograd.grad(inner, leaf, grad_inner)
        return grad_gate_up, grad_w, grad_b, None


class FastFeedForward(FeedForward):
    """FeedForward (same projections, same values) with gate and up as one matmul (:class:`FusedLinears`) and, in
    training, :class:`_GatedDown` keeping only that joint output for the backward."""

    def __init__(self, *args, **kwargs):  # built directly (accelerate() swaps the class of a built one instead)
        super().__init__(*args, **kwargs)
        self._init_fast()

    def _init_fast(self) -> None:
        self._gate_up = FusedLinears()  # xW and xV in one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None or (not x.is_cpu and torch.is_grad_enabled()):
            # (CUDA training: the reference is faster, H200 bf16 step 0.87-0.92x with the stacked gate/up and the
            # recomputing backward; BENCHMARKS.md)
            return super().forward(x)
        down = self.down_proj
        if torch.is_grad_enabled() and type(down) is nn.Linear and not torch.compiler.is_compiling():
            # training: keep only the fused gate/up output for the backward (the inner activation is recomputed)
            gate_up = self._gate_up.joined(x, (self.gate_proj, self.up_proj))
            if gate_up is not None:
                return _GatedDown.apply(gate_up, down.weight, down.bias, self.act)
        gate, up = self._gate_up(x, (self.gate_proj, self.up_proj))
        return down(self.act(gate) * up)
