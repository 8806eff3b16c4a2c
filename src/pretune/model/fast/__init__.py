"""The fast wing: the reference model's modules as subclasses with the same parameters and buffers, computing the
same maths in fewer passes (stacked q/k/v and gate/up weights, written-out backwards, fused norms, token-major KV
caches, RoPE as matrices, the LM head fused with its cross-entropy), plus the flat decoding step generation uses.

``accelerate(model)`` swaps them in, module by module, keeping every parameter, buffer and name where it was
(``TransformerLM(config)`` does it by default; ``fast=False`` keeps the reference). Nothing here changes what a model
computes beyond rounding: ``tests/model/test_fast.py`` holds every fast model equal to its reference. A speed change
belongs here, never in the reference files.
"""

from __future__ import annotations

from torch import nn

from ..attention import Attention
from ..heads import LMHead
from ..layers import FeedForward, RMSNorm, RMSNormPlusOne
from ..position import RotaryPositions
from .attention import FastAttention
from .cache import FastKVCache, FastLayerCache
from .fused_ce import FastLMHead, fused_linear_cross_entropy
from .layers import FastFeedForward, FastRMSNorm, FastRMSNormPlusOne
from .position import FastRotaryPositions

# reference class -> its fast twin (exact types: a subclass with its own maths, e.g. SoftCappedLMHead, stays)
FAST: dict[type, type] = {
    Attention: FastAttention,
    FeedForward: FastFeedForward,
    RMSNorm: FastRMSNorm,
    RMSNormPlusOne: FastRMSNormPlusOne,
    RotaryPositions: FastRotaryPositions,
    LMHead: FastLMHead,
}

__all__ = ["FAST", "accelerate", "FastKVCache", "FastLayerCache", "fused_linear_cross_entropy"]


def accelerate(model: nn.Module) -> nn.Module:
    """Swap each module of ``model`` whose type is a key of :data:`FAST` for its fast twin, in place: the same
    object with a subclass's methods, so parameters, buffers, names and their order stay exactly as they were (PEFT,
    FSDP and compilation applied afterwards see the reference's names). Returns ``model``."""
    for module in model.modules():
        fast = FAST.get(type(module))
        if fast is not None:
            module.__class__ = fast
            init = getattr(module, "_init_fast", None)
            if init is not None:
                init()
    return model
