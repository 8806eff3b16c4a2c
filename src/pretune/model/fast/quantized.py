"""Frozen linear layers whose weights are stored quantised: what ``pretune.quantize(model, "int8" | "int4")`` swaps
in for decoding, and what ``peft.base_dtype=nf4 | int8`` (QLoRA) stores the frozen base as.

Decoding one token at a time reads every weight once per token, so storing fewer bytes per weight is the largest
speed-up left for an eager CPU step. The formats and their kernels (PyTorch's own CPU ops; no hand-written maths):

- ``int8``: per output channel, symmetric: W ~ s_n * q_nk, q in [-127, 127], s_n = max_k |W_nk| / 127.
  ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations: its fp32 path is 10-40x slower on this CPU).
- ``int4``: group-wise along the input dimension, asymmetric (min/max), ``INT4_GROUP`` = 32 inputs a group:
  W ~ (q - 8) * s + z, q in [0, 15], one (s, z) per group and output channel, in bf16 —
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``. 32 is the finest group
  the kernel takes (and llama.cpp's Q4_0/Q4_1 block): measured on SmolLM2 in BENCHMARKS.md.
- ``nf4`` (training only: QLoRA's base): torchao's NF4 (``to_nf4``: 4-bit NormalFloat codes in blocks of 64, the
  blocks' scales quantised again, Dettmers et al. 2023), dequantised for each matmul. A weight that is not a whole
  number of blocks (a tiny model's) is padded with zeros to one (exact: a zero weight is NF4's code 0.0, and the
  padding never raises a block's absmax).

The kernels want shapes the CPU code was written for (int8: inputs a multiple of 16; int4: outputs a multiple of 16
and whole groups): other shapes are padded with zero rows/columns when quantised (exact: zero weights add nothing).
Outside autograd on a CPU every matmul (one token, a prompt) runs the kernel; one that needs gradients (QLoRA) or
runs elsewhere dequantises the weight and runs ``F.linear``. A QLoRA base (``quantize(..., kernels=False)``) always
dequantises: a pass without gradients (a DPO reference pass with the adapters off, dev scoring) then computes what
the training pass computes, bit for bit, not the kernel's bf16-activation rounding of it. No weight gradient is ever
computed (the layer is frozen): the input's gradient is taken through the dequantised weight, recomputed in the
backward rather than kept.

Layers that read one input (q/k/v, an FFN's gate and up) are quantised as one stacked matrix, one kernel call for
all of them (``FusedLinears`` and the flat decoding step use it); each projection keeps its own module, which
computes its slice of the stacked product when called alone.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..heads import LMHead
from ..layers import WrappedLinear
from .fused_ce import FastLMHead

MODES = ("int8", "int4")  # pretune.quantize: decoding (PyTorch's CPU kernels)
BASE_MODES = ("nf4", "int8")  # peft.base_dtype: a QLoRA base (training)
INT4_GROUP = 32  # inputs sharing one int4 (scale, zero): the kernel takes 32, 64, 128 or 256
NF4_BLOCK = 64  # torchao's (and QLoRA's) NF4 block: 64 weights share one absmax scale
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what quantize swaps


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class QuantizedLinear(nn.Module):
    """Differs from ``nn.Linear``: the weight is frozen and stored quantised (a subclass says how); ``weight`` is its
    dequantised value (fp32, computed on each access: for DoRA's row norms, inspection and saving). ``bias`` stays a
    frozen fp32 parameter. A member of a stacked group holds no weight of its own: it computes its rows of the group's
    product (``joint``), its bias a view of the group's."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self._joint: list = []  # [stacked module, first row] for a member of a group (a list: not a submodule)
        self.kernels = True  # the format's kernel outside autograd (decoding); False: always the dequantised weight

    @property
    def joint(self) -> tuple[QuantizedLinear, int] | None:
        return (self._joint[0], self._joint[1]) if self._joint else None

    # -- what a subclass provides
    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (padded) weight (out_padded, in_padded) in ``dtype`` (fp32: exactly what the codes stand for; bf16:
        computed in bf16, one rounding more)."""
        raise NotImplementedError

    def _kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (M, in_padded) -> (M, out_padded) through the format's kernel, or None where it has none."""
        return None

    # -- shared
    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (out_features, in_features) the stored codes stand for, in ``dtype``."""
        if self.joint is not None:
            joint, start = self.joint
            return joint.dequantized(dtype).narrow(0, start, self.out_features)
        w = self._dequantized(dtype)
        return w[: self.out_features, : self.in_features].to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized()


    @property
    def stored_bytes(self) -> int:
        """Bytes of the quantised weight as stored (a member: 0, its group's module holds them)."""
        return 0 if self.joint is not None else sum(
            b.numel() * b.element_size() for b in self._stored())

    def _stored(self) -> list[torch.Tensor]:
        return list(self.buffers(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.joint is not None:
            joint, start = self.joint
            return joint(x).narrow(-1, start, self.out_features)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            return _DequantizedLinear.apply(x.to(dtype), self, bias)
        rows = x.reshape(-1, x.shape[-1])  # (M, in)
        y = None
        if x.is_cpu and self.kernels:  # the kernels, whatever the rows (faster than dequantising at 1, 32 and 512
            # rows: BENCHMARKS.md); a QLoRA base has them off (module docstring)
            k_pad = self._in_padded - self.in_features
            y = self._kernel(F.pad(rows, (0, k_pad)) if k_pad else rows)
        if y is None:
            return F.linear(x.to(dtype), self.dequantized(dtype), bias)
        y = y[:, : self.out_features].to(dtype).view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    @property
    def _in_padded(self) -> int:
        return self.in_features

    def _apply(self, fn, recurse=True):  # .to() / .cpu(): the group's stacked module moves with its members
        if self.joint is not None:
            self.joint[0]._apply(fn, recurse)
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Saved as the linear layer it stands for (``weight`` dequantised to fp32, ``bias``): adapters, exports and
        the HF name maps see the model's usual names and shapes."""
        destination[prefix + "weight"] = self.dequantized()
        bias = self.bias
        if bias is not None:
            destination[prefix + "bias"] = bias if keep_vars else bias.detach()

    def extra_repr(self) -> str:
        group = f", rows {self.joint[1]}.. of a stacked group" if self.joint is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{group}"


class _DequantizedLinear(torch.autograd.Function):
    """F.linear(x, dequantised W, bias) that keeps only the quantised layer for the backward (the dequantised weight
    is made again there): the frozen weight gets no gradient, the input's is grad @ W."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return F.linear(x, layer.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.dequantized(grad.dtype), None, None


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric int8: W ~ scales[:, None] * qweight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, bias)
        w = weight.detach().float()
        k_pad = _pad_to(in_f, 16) - in_f  # the kernel reads inputs in blocks of 16
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight", F.pad(q, (0, k_pad)))  # (out, in_padded) int8
        self.register_buffer("scales", scales)  # (out,) fp32
        self._scales_bf16 = None

    @property
    def _in_padded(self) -> int:
        return self.qweight.shape[1]

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]  # (|q| <= 127: exact in bf16)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self._scales_bf16 is None or self._scales_bf16.device != self.scales.device:
            self._scales_bf16 = self.scales.to(torch.bfloat16)
        # bf16 activations: the kernel's fp32 path is 10-40x slower on AVX512 (BENCHMARKS.md)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self._scales_bf16)


class Int4Linear(QuantizedLinear):
    """Group-wise asymmetric int4, ``group`` inputs a group: W ~ (q - 8) * scale + zero per (output, group), packed for
    PyTorch's CPU int4 kernel; (scale, zero) in bf16, as the kernel takes them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group: int = INT4_GROUP):
        if group not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size {group}: expected 32, 64, 128 or 256 (the CPU kernel's)")
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, bias)
        self.group = group
        w = F.pad(weight.detach().float(), (0, _pad_to(in_f, group) - in_f, 0, _pad_to(out_f, 16) - out_f))
        n, k = w.shape
        wg = w.view(n, k // group, group)  # (out, groups, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-6)  # (out, groups)
        zero = lo + 8 * scale  # the value of code 8
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))

    @property
    def _in_padded(self) -> int:
        return self.scales_and_zeros.shape[0] * self.group

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        # the kernel applied to the identity: (in, out) = W^T, exactly the weights it multiplies by
        eye = torch.eye(self._in_padded, dtype=torch.bfloat16, device=self.packed.device)
        return self._kernel(eye).t().float()

    def _apply(self, fn, recurse=True):  # a model.to(dtype=...) casts float buffers: the kernel takes bf16 only
        out = super()._apply(fn, recurse)
        if self.scales_and_zeros.dtype != torch.bfloat16:
            self.scales_and_zeros = self.scales_and_zeros.to(torch.bfloat16)
        return out

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group,
                                                          self.scales_and_zeros)


class NF4Linear(QuantizedLinear):
    """torchao's NF4 (4-bit NormalFloat, blocks of ``NF4_BLOCK``, the scales quantised again): QLoRA's base. No
    kernel: each matmul dequantises (torchao's ``get_original_weight``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        try:
            from torchao.quantization import to_nf4
        except ImportError as e:
            raise ImportError("peft.base_dtype=nf4 needs torchao (pip install 'pretune[quant]', or make install): "
                              f"{e}") from None
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, bias)
        w = weight.detach().to(torch.bfloat16).contiguous()
        pad = _pad_to(w.numel(), NF4_BLOCK) - w.numel()
        if pad:  # not whole blocks (a tiny model): flattened and padded with zeros (exact; see the module docstring)
            w = F.pad(w.flatten(), (0, pad))
        blocks = w.numel() // NF4_BLOCK
        scaler_block = max(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % b == 0)  # torchao's default 256
        self.nf4 = to_nf4(w, NF4_BLOCK, scaler_block)  # a tensor subclass (a plain attribute: moved by _apply)
        self.nf4.requires_grad_(False)
        self._pairs = None  # the code-byte table of _dequantized, made on first use

    def _stored(self) -> list[torch.Tensor]:
        t = self.nf4
        return [t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4]

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """torchao's ``get_original_weight`` values, bitwise, ~4x faster on a CPU (measured: 98 vs 394 ms for a 3072
        x 576 weight): each code byte looks its two values up in a 256-row table at once (torchao widens every code
        to int64 and looks it up alone), then each block of 64 is scaled by its dequantised scaler."""
        t = self.nf4
        if self._pairs is None or self._pairs.device != t.nf4.device:
            byte = torch.arange(256, device=t.nf4.device)
            self._pairs = torch.stack([t.nf4[byte >> 4], t.nf4[byte & 15]], dim=-1)  # (256, 2): (high, low) nibble
        scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
        w = self._pairs[t.quantized_data.long()].view(-1, t.block_size) * scalers[:, None]  # in bf16, as torchao
        n = self.out_features * self.in_features  # (less any padding)
        return w.view(-1)[:n].view(self.out_features, self.in_features).to(dtype)

    def __deepcopy__(self, memo):
        """A copy sharing the frozen NF4 codes (torchao's NF4Tensor re-quantises when deep-copied, with its default
        scaler blocks, which a small weight does not divide into)."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k == "nf4" else copy.deepcopy(v, memo)
        return new

    def _apply(self, fn, recurse=True):
        moved = fn(self.nf4)
        if type(moved) is type(self.nf4):  # a move; a cast (model.float()) would dequantise it: kept as it is
            self.nf4 = moved
        return super()._apply(fn, recurse)


FORMATS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear, "nf4": NF4Linear}


class QuantizedLMHead(FastLMHead):
    """Differs from the LM head: the logits come from a quantised copy of its weight (``head_quantized``); the
    embedding it may be tied to stays fp32 for the lookup. Its losses run through those logits too (the fused
    fp32 cross-entropy would score another model)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            h = h * self.scale
        if self.proj is not None:
            h = self.proj(h)
        y = self.head_quantized(h)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def cross_entropy(self, h, targets):
        return LMHead.cross_entropy(self, h, targets)

    def token_logprobs(self, h, targets, temperature: float = 1.0):
        return LMHead.token_logprobs(self, h, targets, temperature)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # the fp32 weight, not the decoding copy
        LMHead._save_to_state_dict(self, destination, prefix, keep_vars)


def shared_joint(layers) -> QuantizedLinear | None:
    """The stacked quantised module whose members ``layers`` are, all of them in order, or None."""
    joints = [getattr(m, "joint", None) for m in layers]
    if any(j is None for j in joints) or len({id(j[0]) for j in joints}) != 1:
        return None
    start = 0
    for m, (_, first) in zip(layers, joints):
        if first != start:
            return None
        start += m.out_features
    joint = joints[0][0]
    return joint if start == joint.out_features else None


def _unwrap(m: nn.Module) -> nn.Module:
    return m.base_layer if isinstance(m, WrappedLinear) else m


def _replace(parent: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``parent.name`` was (inside a PEFT wrapper: as its base layer)."""
    old = getattr(parent, name)
    if isinstance(old, WrappedLinear):
        old.base_layer = new
    else:
        setattr(parent, name, new)


def _quantizable(m: nn.Module | None, only_frozen: bool) -> bool:
    return type(m) is nn.Linear and not (only_frozen and any(p.requires_grad for p in m.parameters()))


def _quantize_group(parent: nn.Module, names: tuple[str, ...], fmt: type[QuantizedLinear], only_frozen: bool,
                    kernels: bool, **kw) -> int:
    """Quantise the linears ``names`` of ``parent`` as one stacked matrix (when they read one input, all frozen, all
    with a bias or none), else each alone; ``kernels``: as :func:`quantize`. Returns the weights quantised."""
    bases = [_unwrap(getattr(parent, n)) for n in names]
    todo = [(n, b) for n, b in zip(names, bases) if _quantizable(b, only_frozen)]
    if len(todo) == len(names) > 1 and len({b.bias is None for b in bases}) == 1:
        weight = torch.cat([b.weight.detach() for b in bases])
        bias = torch.cat([b.bias.detach() for b in bases]) if bases[0].bias is not None else None
        joint = fmt(weight, bias, **kw)
        joint.kernels = kernels
        start = 0
        for n, b in zip(names, bases):
            member = QuantizedLinear(b.in_features, b.out_features, None)
            member._joint[:] = [joint, start]
            if bias is not None:  # its rows of the stacked bias, shared (the group's product adds them once)
                member.bias = nn.Parameter(joint.bias.narrow(0, start, b.out_features), requires_grad=False)
            start += b.out_features
            _replace(parent, n, member)
        return weight.numel()
    count = 0
    for n, b in todo:
        q = fmt(b.weight.detach(), None if b.bias is None else b.bias.detach(), **kw)
        q.kernels = kernels
        _replace(parent, n, q)
        count += b.weight.numel()
    return count


def quantize(model: nn.Module, mode: str = "int8", *, head: str | None = "int8",
             group: int = INT4_GROUP, only_frozen: bool = False, kernels: bool = True) -> nn.Module:
    """Store the frozen linear weights of ``model``'s body in ``mode`` (``int8``, ``int4``; ``nf4`` for a QLoRA base),
    in place: every attention and FFN projection that is a plain ``nn.Linear`` with no trainable parameter, a PEFT
    wrapper's base layer included (LoRA adapters stay fp32 and unmerged on top). q/k/v, and an FFN's gate/up, become
    one stacked quantised matrix each. ``head``: ``int8`` (default), ``int4`` or None (fp32): how the LM head's
    weight is copied for the logits; a tied embedding keeps its fp32 table for the lookup. ``group``: int4's group size.
    ``only_frozen``: leave linears with a parameter that trains (a QLoRA base under ``bias=all``) as they are.
    ``kernels``: run the format's kernel for matmuls outside autograd on a CPU (decoding: bf16 activations); False
    (a QLoRA base): every matmul through the dequantised weight, the function training differentiates.
    Returns ``model``, with ``model.quantization`` = {mode, head (its format or None), weights (linear weights
    quantised), bytes (as stored)}."""
    if mode not in FORMATS:
        raise ValueError(f"quantize mode {mode!r}: expected one of {', '.join(FORMATS)}")
    if head is not None and head not in MODES:
        raise ValueError(f"quantize head={head!r}: expected one of {', '.join(MODES)} or None (kept fp32)")
    if not only_frozen and any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(f"quantize {mode!r} for decoding runs PyTorch's CPU kernels: move the model to the CPU "
                         "first")
    kw = {"group": group} if mode == "int4" else {}
    count = 0
    for module in list(model.modules()):
        if isinstance(module, QuantizedLinear) or isinstance(module, WrappedLinear):
            continue
        own = [n for n in PROJECTIONS if isinstance(getattr(module, n, None), nn.Module)]
        if not own:
            continue
        # the fast wing's self-attention and FFN stack them (cross-attention's q reads another input than k, v)
        fused = (hasattr(module, "_qkv") and not module.cross) or hasattr(module, "_gate_up")
        groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")] if fused else []
        done = set()
        for g in groups:
            if all(n in own for n in g):
                count += _quantize_group(module, g, FORMATS[mode], only_frozen, kernels, **kw)
                done.update(g)
        for n in own:
            if n not in done:
                count += _quantize_group(module, (n,), FORMATS[mode], only_frozen, kernels, **kw)
    head_fmt = None
    h = getattr(model, "head", None)
    inner = getattr(h, "base", h)  # a RoutedHead (adapters' own task heads) wraps the model's head
    if head is not None and type(inner) is FastLMHead and not (only_frozen and inner.weight.requires_grad):
        w = inner.weight.detach()
        q = (Int4Linear(w, group=group) if head == "int4" else Int8Linear(w))
        inner.__class__ = QuantizedLMHead
        object.__setattr__(inner, "head_quantized", q)  # not a submodule: state dicts keep the fp32 weight only
        head_fmt = head
    model.quantization = {"mode": mode, "head": head_fmt, "weights": count, "bytes": quantized_bytes(model)}
    return model


def dequantize(model: nn.Module) -> nn.Module:
    """Undo :func:`quantize` in place: every quantised linear becomes an ``nn.Linear`` holding its dequantised weight
    (fp32), a quantised LM head the plain fast one. Returns ``model``."""
    for module in list(model.modules()):
        for n, child in list(module.named_children()):
            base = _unwrap(child)
            if isinstance(base, QuantizedLinear):
                bias = base.bias
                lin = nn.Linear(base.in_features, base.out_features, bias=bias is not None)
                lin.weight = nn.Parameter(base.dequantized(), requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
                _replace(module, n, lin)
        if type(module) is QuantizedLMHead:
            module.__class__ = FastLMHead
            del module.__dict__["head_quantized"]
    return model


def quantized_bytes(model: nn.Module) -> int:
    """Bytes the quantised weights of ``model`` take as stored (groups counted once)."""
    seen, total = set(), 0
    for m in model.modules():
        for q in ((m,) if isinstance(m, QuantizedLinear) else ()) + (
                (m.head_quantized,) if type(m) is QuantizedLMHead else ()):
            q = q.joint[0] if q.joint is not None else q
            if id(q) not in seen:
                seen.add(id(q))
                total += q.stored_bytes
    return total
