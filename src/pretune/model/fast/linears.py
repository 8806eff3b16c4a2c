"""Several linear layers that read the same input run as one matmul over a stacked weight (q/k/v; an FFN's gate
and up projections).

The fast wing's linears: the reference model runs each projection on its own (``model/attention.py``,
``model/layers.py``); :class:`FusedLinears` gives the same products from one read of the input and of the stacked
weight, which matters most when decoding one token at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import WrappedLinear
from .quantized import shared_joint


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
        joint = shared_joint(bases)  # quantised as one stacked matrix (model/fast/quantized.py)
        if joint is not None and all(p is b or p.fusable for p, b in zip(layers, bases)):
            ys = joint(x).split([base.out_features for base in bases], dim=-1)
            return [y if p is base else p.adjust(x, y) for p, base, y in zip(layers, bases, ys)]
        if (any(type(b) is not nn.Linear or (isinstance(p, WrappedLinear) and not p.fusable)
                for p, b in zip(layers, bases))
                or len({b.bias is None for b in bases}) > 1):  # (some with a bias, some without: rare, unfused)
            return [p(x) for p in layers]
        ys = self._matmul(x, bases).split([base.out_features for base in bases], dim=-1)
        return [y if p is base else p.adjust(x, y) for p, base, y in zip(layers, bases, ys)]

    def joined(self, x: torch.Tensor, layers) -> torch.Tensor | None:
        """The layers' outputs side by side, (..., sum of out_features), from one matmul; None when a layer is
        wrapped (a LoRA or (IA)3 adjusts its own slice: run ``__call__``) or the biases differ."""
        joint = shared_joint(layers)  # quantised as one stacked matrix
        if joint is not None:
            return joint(x)
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
