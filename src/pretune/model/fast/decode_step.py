"""One eager decoding step of a plain decoder-only model as a flat loop over its layers.

Generating one token at a time with a small model is dominated by the weight reads of a few matrix-vector
products per layer; in eager PyTorch what comes on top is the framework: module calls, the checks a general
forward makes on every call (cross-attention? adapters? prefix keys? soft-capping? a static cache?), and the
small tensor ops between the products. ``FlatDecoder.of(model)`` looks at a decoder-only model once and returns a
step that runs its layers as one loop: pre-norm (or sandwich-norm) blocks of self-attention and an FFN with norms
and position modules from the registries and an LM head, the plain projections as matmuls over their (stacked)
weights, and every part the loop does not compute itself — a LoRA or (IA)3 wrapper on a projection, an adapter on
a branch, per-head q/k norms, soft-capped scores — through that part's own method, as the forward calls it. The same
kernels in the same order as ``TransformerLM.forward`` with a ``KVCache``, so the same logits, bitwise (but for the
matrix-vector kernel, below); the per-call checks are made once. A model with anything else (cross-attention,
post-norm, position biases, prefix or prompt tuning, hooks, training mode) gets ``None`` and decodes through its
forward.

The matrix products. With one new token per row, each projection is a matrix-vector product (a few rows times a
weight matrix) that only has to read the weights once; how close a kernel gets to that depends on the CPU. On an AMD
EPYC (AVX2), MKL's GEMV (what ``F.linear`` calls for fp32 on CPU) reads SmolLM2's weights at ~14 GB/s, oneDNN's
matrix-vector kernel at ~25 GB/s: 7.6 vs 3.6 ms for the head alone, 41 vs 30 ms per token. So by default, outside
autograd and autocast in fp32 on CPU, the plain projections and a plain LM head run through oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, the op Inductor's CPU backend uses) on the same weights: the same products,
summed in another order, so the logits match the forward's to fp32 rounding (~1e-6 relative), not bitwise.
``FlatDecoder.of(model, exact=True)`` keeps the forward's kernels and its bitwise logits (the tests check the loop's
structure with it); a torch built without oneDNN gets them anyway.

Used by ``pretune.generation`` for the steps after the prompt (one new token per row, a growing ``KVCache``);
the prompt itself, scoring and training always run the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import build_mask, cast_mask
from ..cache import KVCache
from ..heads import LMHead
from ..layers import Dropout
from ..transformer import Block, Stack
from .attention import FastAttention
from .cache import FastKVCache
from .fused_ce import FastLMHead
from .layers import _SIGNS, FastFeedForward, FastRMSNorm
from .quantized import QuantizedLinear, shared_joint

_NORMS = (FastRMSNorm, nn.LayerNorm, nn.Identity)  # FastRMSNorm covers FastRMSNormPlusOne (a subclass)


def _onednn_linear_op():
    """oneDNN's fp32 linear (input, weight, bias, post-op, scalars, algorithm) where this torch has it, else None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a build without the op: the forward's kernels
        return None


_LINEAR_POINTWISE = _onednn_linear_op()


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN (fp32 CPU tensors, a contiguous weight): for a few rows, a
    matrix-vector kernel that reads the weights at up to twice MKL's bandwidth (see the module's docstring)."""
    return _LINEAR_POINTWISE(x, weight, bias, "none", [], "")


def _plain(*linears: nn.Module) -> bool:
    """Plain ``nn.Linear`` layers that ``FusedLinears`` stacks into one matmul (all with a bias or none)."""
    return all(type(m) is nn.Linear for m in linears) and len({m.bias is None for m in linears}) == 1


class _Layer:
    """What one block's decoding step needs, read once: the norms' forwards, the stacked q/k/v and gate/up
    weights (the same stacked copies ``FusedLinears`` caches for the module path), the output projections. Where
    the block has a part the lean path does not compute itself — a PEFT wrapper on a projection, per-head q/k
    norms, soft-capped scores, an adapter on a branch's output — the step calls that part's own method, as the
    forward does."""

    __slots__ = ("norm1", "norm1_rows", "norm2_rows",
                 "qkv_w", "qkv_b", "o_w", "o_b", "o", "heads", "kv_heads", "dh", "norm2",
                 "gated", "act", "up_w", "up_b", "down_w", "down_b", "ffn", "local", "project", "attend", "post1",
                 "post2", "drop1", "drop2", "qkv_mm", "up_mm", "down_mm")

    def __init__(self, block: Block, local: bool):
        attn, ffn = block.attn, block.ffn
        self.norm1, self.norm2 = block.attn_norm.forward, block.ffn_norm.forward
        # RMSNorms (gain rows, eps) for a step that carries the residual as the rows (x, -x); None: not RMSNorms
        self.norm1_rows = _rows(block.attn_norm)
        self.norm2_rows = _rows(block.ffn_norm)
        # sandwich norms (Gemma 2): each branch's output is normalised before the residual sum
        self.post1 = block.attn_post_norm.forward if block.attn_post_norm is not None else None
        self.post2 = block.ffn_post_norm.forward if block.ffn_post_norm is not None else None
        # a branch's output stage: a Dropout does nothing here; anything else (a Houlsby adapter) runs
        self.drop1 = None if type(block.attn_drop) is Dropout else block.attn_drop.forward
        self.drop2 = None if type(block.ffn_drop) is Dropout else block.ffn_drop.forward
        # the attention's own general projection (q, k, v as (B, heads, T, Dh)) where its fused path does not apply:
        # per-head q/k norms (Qwen3), wrapped projections (LoRA, (IA)3), biases on some of q/k/v only
        # quantised projections (``pretune.quantize``): q/k/v as their stacked quantised matrix, one kernel call
        self.project, self.qkv_mm, self.qkv_w, self.qkv_b = None, None, None, None
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        joint = shared_joint(qkv)
        if attn.q_norm is not None or not (_plain(*qkv) or joint is not None):
            self.project = attn.project
        elif joint is not None:
            self.qkv_mm = joint.forward
        else:
            self.qkv_w, self.qkv_b = attn._qkv.weights(qkv)
        # the attention itself: the attention's own method (SDPA; the one-query kernel in bf16; the eager path for
        # soft-capped scores, Gemma 2)
        self.attend = attn.attend
        self.o = None if type(attn.o_proj) is nn.Linear else attn.o_proj.forward
        if self.o is None:
            self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.heads, self.kv_heads, self.dh = attn.n_heads, attn.n_kv_heads, attn.dh
        self.gated, self.act = ffn.gate_proj is not None, ffn.act
        fused = (ffn.gate_proj, ffn.up_proj) if self.gated else (ffn.up_proj,)
        quantized = _quantized_mm(fused), _quantized_mm((ffn.down_proj,))  # (gate/up, down) or None
        self.up_mm, self.down_mm = quantized if None not in quantized else (None, None)
        self.up_w = self.up_b = self.down_w = self.down_b = None
        plain = _plain(*fused) and type(ffn.down_proj) is nn.Linear
        self.ffn = None if plain or self.up_mm is not None else ffn.forward  # wrapped (or mixed): its own forward
        if plain:
            if self.gated:
                self.up_w, self.up_b = ffn._gate_up.weights(fused)
            else:
                self.up_w, self.up_b = ffn.up_proj.weight, ffn.up_proj.bias
            self.down_w, self.down_b = ffn.down_proj.weight, ffn.down_proj.bias
        self.local = local


def _quantized_mm(linears: tuple[nn.Module, ...]):
    """The forward of the quantised matrix computing ``linears`` (one layer, or a stacked group in order) in one
    kernel call, or None."""
    if len(linears) == 1 and isinstance(linears[0], QuantizedLinear) and linears[0].joint is None:
        return linears[0].forward
    joint = shared_joint(linears)
    return joint.forward if joint is not None else None


def _rows(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """An RMSNorm's (2, dim) gain and eps for the layer_norm over the rows (x, -x) (RMSNorm's path for a few rows
    outside autograd); None for any other norm."""
    return (norm.rows_gain(), norm.eps) if isinstance(norm, FastRMSNorm) else None


def _why_not(model: nn.Module) -> str | None:
    """None when ``model`` decodes with :class:`FlatDecoder`; else the first part that does not (a reason, for
    tests and debugging)."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.arch != "decoder":
        return "not a decoder-only model"
    if model.training:
        return "in training mode"
    if not isinstance(model.head, LMHead):
        return "no LM head"
    if not getattr(model, "fast", False):
        return "the reference model (fast=False): it decodes through its forward"
    stack = model.transformer.decoder
    if type(stack) is not Stack or stack.extra_inputs is not None:
        return "extra input embeddings (prompt tuning)"
    if stack.token_type is not None or stack.embed_norm is not None or stack.embed_proj is not None:
        return "token types, an embedding norm or an embedding projection"
    if stack.position.has_bias or stack.position.has_scores:
        return f"a position term in the scores ({type(stack.position).__name__})"
    if type(stack.drop) is not Dropout:
        return f"embedding output stage {type(stack.drop).__name__}"
    if stack.norm is not None and not isinstance(stack.norm, _NORMS):
        return f"final norm {type(stack.norm).__name__}"
    for block in stack.layers:
        if type(block) is not Block or not block.pre_norm or block.cross_attn is not None:
            return "a block that is not pre-norm (or sandwich) self-attention + FFN"
        attn, ffn = block.attn, block.ffn
        if type(attn) is not FastAttention or attn.extra_kv is not None:
            return "attention with extra keys (prefix tuning)"
        if attn.q_norm is not None and not (isinstance(attn.q_norm, _NORMS) and isinstance(attn.k_norm, _NORMS)):
            return "per-head q/k norms outside the registry"
        if any(n is not None and not isinstance(n, _NORMS) for n in (block.attn_post_norm, block.ffn_post_norm)):
            return "a sandwich norm outside the registry"
        if type(ffn) is not FastFeedForward:
            return f"FFN {type(ffn).__name__}"
        if not isinstance(block.attn_norm, _NORMS) or not isinstance(block.ffn_norm, _NORMS):
            return "a norm outside the registry"
    for m in model.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a forward hook on {type(m).__name__}"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook"
    return None


class FlatDecoder:
    """``step(ids, cache, attention_mask, position_ids)``: next-token logits (B, vocab) for one new token per row,
    given a ``KVCache`` that holds every earlier token (the prompt ran through the model's forward), exactly as
    ``model(ids, attention_mask, position_ids=..., past_key_values=cache, use_cache=True,
    logits_to_keep=1).logits[:, -1]`` computes them. Build with :meth:`of`; valid while the weights do not change
    (one generation)."""

    def __init__(self, model: nn.Module, exact: bool = False):
        self.model = model
        stack: Stack = model.transformer.decoder
        self.stack = stack
        self.embed = model.transformer.embed
        n = stack.n_layers
        blocks = [stack.layers[i % len(stack.layers)] for i in range(n)]
        self.layers = [_Layer(b, i in stack.local) for i, b in enumerate(blocks)]
        self.norm = stack.norm.forward if stack.norm is not None else None
        self.head = model.head.forward
        head = model.head  # a plain LM head (no soft-capping, rescaling or factorisation): one linear map
        plain_head = type(head) is FastLMHead and head.scale is None and head.proj is None
        self.head_wb = (head.weight, head.bias) if plain_head else None
        # the plain projections and the head through oneDNN's matrix-vector kernel (fp32 weights, contiguous)
        plain = [w for layer in self.layers for w in (
            *((layer.qkv_w,) if layer.project is None else ()), *((layer.o_w,) if layer.o is None else ()),
            *((layer.up_w, layer.down_w) if layer.ffn is None else ())) if w is not None] + (
            [self.head_wb[0]] if self.head_wb else [])  # (quantised ones are None: their own kernels)
        self.onednn = not exact and _LINEAR_POINTWISE is not None and all(
            w.dtype == torch.float32 and w.is_cpu and w.is_contiguous() for w in plain)
        # every norm an RMSNorm: a step outside autograd carries the residual stream as the rows (x, -x) (B, 2, dim),
        # so that each norm is RMSNorm's own layer_norm over those rows without building them (2 calls instead of
        # 4) and each residual sum one addcmul with the signs — the same values, bitwise, in fewer calls
        self.final_rows = _rows(stack.norm) if stack.norm is not None else None
        self.rows = all(layer.norm1_rows is not None and layer.norm2_rows is not None for layer in self.layers) and (
            stack.norm is None or self.final_rows is not None)
        self._casts: dict = {}  # autocast dtype -> the plain weights cast to it (see _plain_weights)

    def _plain_weights(self, cast: torch.dtype | None) -> tuple[list[tuple], tuple | None]:
        """Each layer's (o_w, o_b, up_w, up_b, down_w, down_b) and the head's (weight, bias) — None where the layer
        runs the part's own forward — cast to ``cast`` (the autocast dtype, outside autograd) once per generation:
        autocast would cast these fp32 weights on every step (it caches casts of trainable leaves only), a read and
        a write of the output projections, the FFNs and the LM head per token (measured: ~17 ms a step of 32 rows of
        SmolLM2 under bf16 autocast, of ~90). The same rounding as autocast's own cast, so the same logits, bitwise.
        ``cast`` None: the weights as they are."""
        got = self._casts.get(cast)
        if got is None:
            def c(t):
                return t.to(cast) if cast is not None and t is not None and t.is_floating_point() else t

            layers = [(c(layer.o_w), c(layer.o_b)) if layer.o is None else (None, None) for layer in self.layers]
            layers = [o + ((c(layer.up_w), c(layer.up_b), c(layer.down_w), c(layer.down_b)) if layer.ffn is None
                           else (None,) * 4) for o, layer in zip(layers, self.layers)]
            head = tuple(c(t) for t in self.head_wb) if self.head_wb is not None else None
            got = self._casts[cast] = (layers, head)
        return got

    @staticmethod
    def of(model: nn.Module, exact: bool = False) -> FlatDecoder | None:
        """The flat step for ``model``, or None when some part of it needs the model's own forward. ``exact``: the
        forward's kernels for the matrix products too, so the logits are bitwise the forward's (by default, fp32
        steps on CPU use oneDNN's matrix-vector kernel: see the module's docstring)."""
        return FlatDecoder(model, exact) if _why_not(model) is None else None

    def step(self, ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """ids: (B, 1) the newest token of each row; attention_mask: (B, past + 1) 1 = real token (left padding),
        or None; position_ids: (B, 1), or None for column ``past``. Returns logits (B, vocab)."""
        stack = self.stack
        B, T = ids.shape
        past = cache.length
        if T != 1 or past == 0:
            raise ValueError(f"FlatDecoder.step decodes one new token per row after the prompt: got {T} token(s) "
                             f"with {past} cached (run the prompt through the model's forward)")
        x = self.embed(ids)
        if stack.embed_scale is not None:
            x = x * torch.tensor(stack.embed_scale, dtype=x.dtype)
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)
        x = stack.position.add(x, position_ids)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        masks = dict(q_len=T, k_len=past + T, q_offset=past, causal=True, key_padding=attention_mask,
                     device=x.device)
        n_local = sum(layer.local for layer in self.layers)
        full = build_mask(**masks)[0] if n_local < len(self.layers) else None
        local = build_mask(**masks, window=stack.window)[0] if n_local else None
        rotations = (None, None)
        if stack.position.has_rotation:
            rotate = stack.position.rotation(position_ids)
            rotations = (rotate, rotate if stack.local_position is None else
                         stack.local_position.rotation(position_ids))
        caches = [cache.layer(i) for i in range(len(self.layers))]
        fast_cache = isinstance(cache, FastKVCache)  # (a reference KVCache: its own append)
        # fp32 outside autograd and autocast on CPU: oneDNN's matrix-vector kernel for the plain products
        gemv = self.onednn and x.is_cpu and x.dtype == torch.float32 and not torch.is_grad_enabled() and \
            not torch.is_autocast_enabled("cpu")
        linear = onednn_linear if gemv else F.linear
        dev = x.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) and not torch.is_grad_enabled() else None
        weights, head_wb = self._plain_weights(cast)
        layer_norm, addcmul = F.layer_norm, torch.addcmul
        # the rows (x, -x), where RMSNorm itself would take its layer_norm path (see __init__); one row only: with
        # more, a norm's output (B, 1, dim) taken from the (B, 2, dim) rows has other strides than the forward's,
        # and the projections' matmuls round differently on them
        rows = self.rows and B == 1 and x.is_cpu and x.dtype == torch.float32 and not torch.is_grad_enabled()
        if rows:
            x2, pair = x * _SIGNS, (2, x.shape[-1])  # (B, 2, dim)
        for layer, lc, (o_w, o_b, up_w, up_b, down_w, down_b) in zip(self.layers, caches, weights):
            mask = local if layer.local else full
            rotate = rotations[layer.local]
            H, Hkv, dh = layer.heads, layer.kv_heads, layer.dh
            # attention: x + [post](o(attend(rope(qkv(norm(x))))))
            if rows:
                gain, eps = layer.norm1_rows
                h = layer_norm(x2, pair, gain, None, eps).narrow(1, 0, 1)
            else:
                h = layer.norm1(x)
            if layer.project is None:  # the fused path: one token's heads, head-major (B, H + 2 Hkv, 1, Dh)
                y = linear(h, layer.qkv_w, layer.qkv_b) if layer.qkv_mm is None else layer.qkv_mm(h)
                y = y.view(B, -1, 1, dh) if rotate is None else rotate.step(y, H + Hkv, dh)
                kv = y.narrow(1, H, 2 * Hkv)  # (B, 2 Hkv, 1, Dh): keys, then values
                k, v = lc.write_heads(kv) if fast_cache else lc.append(kv.narrow(1, 0, Hkv), kv.narrow(1, Hkv, Hkv))
                q = y.narrow(1, 0, H)
            else:  # the attention's general path, (B, H, T, Dh) and (B, Hkv, T, Dh) (q/k norms, wrappers)
                q, k, v = layer.project(h)
                if rotate is not None:
                    q, k = rotate(q, k, position_ids)
                k, v = lc.append(k, v)
            if mask is not None and mask.dtype != q.dtype:  # (under autocast the projections' dtype, as attention)
                mask = cast_mask(mask, q.dtype)
            a = layer.attend(q, k, v, mask, False)  # (B, H, 1, Dh)
            a = a.reshape(B, 1, H * dh)  # (B, H, 1, Dh) -> (B, 1, H * Dh): for one token, the token-major order
            a = linear(a, o_w, o_b) if layer.o is None else layer.o(a)
            if layer.post1 is not None:
                a = layer.post1(a)
            a = a if layer.drop1 is None else layer.drop1(a)
            if rows:
                x2 = addcmul(x2, a, _SIGNS)  # (x + a, -x - a)
                gain, eps = layer.norm2_rows
                h = layer_norm(x2, pair, gain, None, eps).narrow(1, 0, 1)
            else:
                x = x + a
                h = layer.norm2(x)
            # FFN: x + [post](down(act(gate) * up)) or x + [post](down(act(up)))
            if layer.ffn is not None:  # a wrapped projection: the FFN's own forward
                h = layer.ffn(h)
            else:
                h = linear(h, up_w, up_b) if layer.up_mm is None else layer.up_mm(h)
                if layer.gated:
                    gate, up = h.chunk(2, dim=-1)
                    h = layer.act(gate) * up
                else:
                    h = layer.act(h)
                h = linear(h, down_w, down_b) if layer.down_mm is None else layer.down_mm(h)
            if layer.post2 is not None:
                h = layer.post2(h)
            h = h if layer.drop2 is None else layer.drop2(h)
            if rows:
                x2 = addcmul(x2, h, _SIGNS)
            else:
                x = x + h
        if rows:
            if self.final_rows is not None:
                gain, eps = self.final_rows
                x2 = layer_norm(x2, pair, gain, None, eps)
            x = x2.narrow(1, 0, 1)
        elif self.norm is not None:
            x = self.norm(x)
        x = x[:, -1:]
        plain_head = head_wb is not None and (gemv or cast is not None)  # (else the head's own forward, as before)
        return (linear(x, *head_wb) if plain_head else self.head(x))[:, -1]
