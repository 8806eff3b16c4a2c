"""Norms, activations and feed-forward blocks, each chosen by one string in the config."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


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


# Rows up to which a CPU RMSNorm outside autograd runs as one layer_norm (see RMSNorm): the decoding steps.
LEAN_NORM_ROWS = 64
_SIGNS = torch.tensor([[1.0], [-1.0]])  # x.unsqueeze(-2) * _SIGNS is (x, -x) in one op


class RMSNorm(nn.Module):
    """LayerNorm without mean-centring or bias: x / rms(x) * g (T5, Llama). Statistics in fp32.

    A few fp32 rows on the CPU outside autograd (a decoding step) run as one ``layer_norm`` over (x, -x) instead: the
    2d values have mean 0 and variance mean(x^2), so the first half of their layer norm is x / sqrt(mean(x^2) + eps)
    * g. That is one kernel where torch's CPU RMSNorm is eight (2.13), ~0.4 ms of SmolLM2's ~27 ms per token; the
    same values up to rounding (tests/model/test_layers.py), and the row count alone picks the path, so a decoding
    step and the model's forward on the same token agree bitwise."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._gain2: tuple | None = None  # (key, (2, dim) gain) for the layer_norm path

    def _gain(self) -> torch.Tensor:
        return self.weight

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
                g = self._gain().float()
                # (the weight's storage is held: a freed one's address cannot come back under the same key)
                gain2 = self._gain2 = (key, torch.stack([g, g]), w.untyped_storage())
        return gain2[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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


class RMSNormPlusOne(RMSNorm):
    """Differs from RMSNorm: the gain is stored as an offset from 1, x / rms(x) * (1 + g), g starting at 0 (Gemma).
    In low precision the gain is applied in fp32 before the cast back ((x * w).to(dtype), as Gemma does), not after."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def _gain(self) -> torch.Tensor:
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            y = self._lean(x)
            return y if y is not None else rms_norm(x, self.weight.shape, self._gain(), self.eps)
        return rms_norm(x.float(), self.weight.shape, self._gain(), self.eps).to(x.dtype)


class WrappedLinear(nn.Module):
    """A module that wraps an ``nn.Linear`` (``base_layer``) and changes its output: ``forward(x)`` is
    ``adjust(x, base_layer(x))`` unless ``fusable`` is False (the wrapper must change the input itself). Low-rank
    updates and rescaling vectors (pretune.peft) subclass it; :class:`FusedLinears` runs the base layers of
    several wrapped linears as one matmul and then lets each wrapper adjust its slice."""

    base_layer: nn.Linear

    @property
    def fusable(self) -> bool:
        return True

    def adjust(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


class FusedLinears:
    """Several ``nn.Linear`` layers that read the same input (q, k, v; an FFN's gate and up projections) run as one
    matmul: one read of the input and of a stacked weight instead of one per layer, which matters most when
    decoding one token at a time. Held as a plain attribute by the module that owns the layers (not a submodule:
    the stacked weight is a cache, never a parameter or a state-dict entry).

    Weights that train are concatenated on every call (autograd must reach them; :class:`_StackedLinear` keeps the
    layers' own weights for the backward, not the stacked copy); outside autograd (inference, generation, a frozen
    LoRA base) they are stacked once and reused until a weight changes (in-place updates bump the tensor's version,
    a move gives a new storage). Frozen weights (``requires_grad`` False: a PEFT base, a teacher, a model loaded for
    inference) then become views of the stacked copy, so the model holds them once, not twice, and a write through
    ``param.data`` reaches the stack too; saving copies such views out (``checkpoint.owned``), as safetensors
    requires. Weights that may train keep their own storage and the stack is a separate copy, dropped when they
    train again. A :class:`WrappedLinear` joins the fused matmul through its ``base_layer`` and adjusts its slice
    of the output; one that is not ``fusable`` makes every layer run on its own.
    """

    def __init__(self):
        self._cache: tuple | None = None  # (key, stacked weight, stacked bias)

    def __call__(self, x: torch.Tensor, layers) -> list[torch.Tensor]:
        bases = [p.base_layer if isinstance(p, WrappedLinear) else p for p in layers]
        if (any(type(b) is not nn.Linear or (isinstance(p, WrappedLinear) and not p.fusable)
                for p, b in zip(layers, bases))
                or len({b.bias is None for b in bases}) > 1):  # (some with a bias, some without: rare, unfused)
            return [p(x) for p in layers]
        ys = self._matmul(x, bases).split([base.out_features for base in bases], dim=-1)
        return [y if p is base else p.adjust(x, y) for p, base, y in zip(layers, bases, ys)]

    def joined(self, x: torch.Tensor, layers) -> torch.Tensor | None:
        """The layers' outputs side by side, (..., sum of out_features), from one matmul; None when a layer is
        wrapped (a LoRA or (IA)3 adjusts its own slice: run ``__call__``) or the biases differ."""
        if any(type(p) is not nn.Linear for p in layers) or len({p.bias is None for p in layers}) > 1:
            return None
        return self._matmul(x, layers)

    def _matmul(self, x: torch.Tensor, bases) -> torch.Tensor:
        if torch.is_grad_enabled() and any(b.weight.requires_grad for b in bases) and not torch.compiler.is_compiling():
            # training: the stacked weight is not kept for the backward (the layers' own weights are), and a copy
            # stacked for an evaluation is stale from the first update on: let it go
            self._cache = None
            bias = torch.cat([b.bias for b in bases]) if bases[0].bias is not None else None
            return _StackedLinear.apply(x, bias, *(b.weight for b in bases))
        w, b = self.weights(bases, x.device.type)
        return F.linear(x, w, b)

    def weights(self, bases, device_type: str = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers' weights (and biases) stacked along the output dimension. Frozen ones under autocast are cached
        already cast to the autocast dtype: the matmul would cast them on every call otherwise (autocast caches casts
        of trainable leaves only), which costs a read and a write of every frozen weight per step (LoRA in bf16)."""
        biases = [b.bias for b in bases] if bases[0].bias is not None else []
        tensors = [b.weight for b in bases] + biases
        n = len(bases)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            # training, compiled too: a plain cat that autograd sees through (never a cached stack an evaluation
            # built, which would give these weights no gradient)
            return torch.cat(tensors[:n]), (torch.cat(tensors[n:]) if biases else None)
        if self._cache is not None and torch.compiler.is_compiling():
            # a compiled decoding step (generate(compile=True)) runs after an eager prefill filled this cache, and
            # the weights cannot change under its inference mode; data_ptr() keys would break the graph
            return self._cache[1], self._cache[2]
        cast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if cast is not None and (not tensors[0].is_floating_point() or all(t.dtype == cast for t in tensors)):
            cast = None  # (nothing to cast: a bf16 base under bf16 autocast shares like an fp32 one)
        share = (cast is None and not torch.compiler.is_compiling() and not _distributed()
                 and all(_shareable(t) for t in tensors))
        key = _stack_key(tensors, cast, share)
        if self._cache is None or self._cache[0] != key:
            self._cache = None  # (a stale stack goes before the new one is built)
            # an ordinary tensor even under inference mode: it may become the frozen weights' storage, and a
            # later training step must be able to save them for its backward (inference_mode(False) turns grad
            # mode on: no_grad goes inside it)
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat(tensors[:n])
                b = torch.cat(tensors[n:]) if biases else None
                if share:
                    _view_into(tensors[:n], w)
                    if biases:
                        _view_into(tensors[n:], b)
                elif cast is not None:  # the same rounding the matmul's own cast would do
                    w, b = w.to(cast), (b.to(cast) if b is not None else None)
            # (the storages are held so that a freed weight's address cannot come back under the same key)
            self._cache = (_stack_key(tensors, cast, share), w, b, [t.untyped_storage() for t in tensors])
        return self._cache[1], self._cache[2]


def _stack_key(tensors, cast, share: bool) -> tuple:
    """What a cached stack depends on: each tensor's address and dtype, and its version unless the tensors are
    views of the stack (``share``): then a write through a parameter, or through any tensor sharing its memory
    (``state_dict()``'s), is in the stack already, and rebuilding it would leave such a tensor behind."""
    return (cast, share, *((t.data_ptr(), t.dtype, None if share else t._version) for t in tensors))


def _shareable(t: torch.Tensor) -> bool:
    """A frozen, plain parameter (not a DTensor shard or a fake tensor) that may become a view of a stacked copy."""
    return (isinstance(t, nn.Parameter) and not t.requires_grad and type(t.data) is torch.Tensor
            and not t.is_inference())


def _distributed() -> bool:
    """Inside a process group the parameters may be FSDP's gathered copies, which it frees and refills itself:
    their storage is left alone there."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _view_into(params, stacked: torch.Tensor) -> None:
    """Point each parameter at its rows of ``stacked`` (their concatenation along dim 0): one copy of the values."""
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = stacked.narrow(0, start, rows)
        start += rows


def _keep_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor:
    """Bernoulli(1 - p) keep mask, ~3x cheaper than ``bernoulli_`` on CPU: one 64-bit random draw (63
    random bits) gives four 15-bit uniform words, each compared with a threshold, so p is quantised to
    1/32768 (0.1 -> 0.100006)."""
    n = math.prod(shape)
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device).random_()  # 63 random bits each
    w15 = words.view(torch.int16)[:n].bitwise_and_(0x7FFF)  # the high word's sign bit is always clear
    return (w15 >= min(round(p * 32768), 32767)).view(shape)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p)."""
    if not training or p == 0.0:
        return x
    return torch.where(_keep_mask(x.shape, p, x.device), x * (1.0 / (1.0 - p)), 0.0)


class Dropout(nn.Module):
    """nn.Dropout with the cheaper keep mask of ``dropout`` (same semantics, same RNG stream owner)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _layer_norm(dim: int, eps: float, bias: bool = True) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps, bias=bias)


NORMS = {"layernorm": _layer_norm, "rmsnorm": RMSNorm, "rmsnorm_plus_one": RMSNormPlusOne}


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    return NORMS[cfg.norm](dim or cfg.dim, cfg.norm_eps, cfg.norm_bias)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf GELU (BERT)
    "gelu_tanh": _gelu_tanh,  # tanh approximation (GPT-2 "gelu_new", T5 v1.1 gated-gelu)
    "swish": F.silu,  # Swish_1 = x * sigmoid(x) (Llama's SwiGLU)
    "tanh": torch.tanh,  # RoBERTa's classification head (cls_act)
    "sigmoid": torch.sigmoid,  # GLU gate (Dauphin et al. 2017)
    "identity": lambda x: x,  # Bilinear: no nonlinearity on the gate (Shazeer 2020)
}

# FFN name -> (gated?, activation). Shazeer 2020, "GLU Variants Improve Transformer".
FFNS: dict[str, tuple[bool, str]] = {
    "relu": (False, "relu"),
    "gelu": (False, "gelu"),
    "gelu_tanh": (False, "gelu_tanh"),
    "swish": (False, "swish"),
    "glu": (True, "sigmoid"),
    "bilinear": (True, "identity"),
    "reglu": (True, "relu"),
    "geglu": (True, "gelu"),
    "geglu_tanh": (True, "gelu_tanh"),
    "swiglu": (True, "swish"),
}


class _StackedLinear(torch.autograd.Function):
    """x @ cat(weights).T + bias with the weights that train stacked for the matmul but not kept for the backward
    (it stacks them again): autograd would hold the stacked copy of every fused q/k/v and gate/up weight from the
    forward to the backward. Under autocast the matmul runs in the autocast dtype, as F.linear would."""

    @staticmethod
    def forward(ctx, x, bias, *weights):
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            xc = x.to(dtype)
            out = F.linear(xc, torch.cat(weights).to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xc, *weights = ctx.saved_tensors
        grad_out = grad_out.to(xc.dtype)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_out @ torch.cat(weights).to(xc.dtype)).to(ctx.x_dtype)
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = flat.sum(0)
        grads = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_w = flat.t() @ xc.reshape(-1, xc.shape[-1])  # (sum of out_features, in)
            parts = grad_w.split([w.shape[0] for w in weights])
            grads = [g.to(w.dtype) if need else None for g, w, need in zip(parts, weights, ctx.needs_input_grad[2:])]
        return grad_x, grad_bias, *grads


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


class FeedForward(nn.Module):
    """Original FFN act(x W1 + b1) W2 + b2, or gated (act(xW) * xV) W2 when cfg.ffn is a GLU variant."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        gated, act = FFNS[cfg.ffn]
        self.act = ACTIVATIONS[act]
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)  # xV (gated) or x W1
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias) if gated else None  # xW
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)  # W2
        self._gate_up = FusedLinears()  # xW and xV in one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        down = self.down_proj
        if torch.is_grad_enabled() and type(down) is nn.Linear and not torch.compiler.is_compiling():
            # training: keep only the fused gate/up output for the backward (the inner activation is recomputed)
            gate_up = self._gate_up.joined(x, (self.gate_proj, self.up_proj))
            if gate_up is not None:
                return _GatedDown.apply(gate_up, down.weight, down.bias, self.act)
        gate, up = self._gate_up(x, (self.gate_proj, self.up_proj))
        return down(self.act(gate) * up)
