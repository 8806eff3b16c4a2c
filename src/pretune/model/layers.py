"""Norms, activations and feed-forward blocks, each chosen by one string in the config."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


class RMSNorm(nn.Module):
    """LayerNorm without mean-centring or bias: x / rms(x) * g (T5, Llama). Statistics in fp32."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def gain(self) -> torch.Tensor:
        """g, the per-coordinate scale."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # low precision: normalise in fp32, scale in the weight's dtype (as T5/Llama do)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return self.weight.to(x.dtype) * y


class RMSNormPlusOne(RMSNorm):
    """Differs from RMSNorm: the gain is stored as an offset from 1, x / rms(x) * (1 + g), g starting at 0 (Gemma).
    In low precision the gain is applied in fp32 before the cast back ((x * w).to(dtype), as Gemma does), not after."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.gain(), self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.gain(), self.eps).to(x.dtype)


class WrappedLinear(nn.Module):
    """A module that wraps an ``nn.Linear`` (``base_layer``) and changes its output: ``forward(x)`` is
    ``adjust(x, base_layer(x))`` unless ``fusable`` is False (the wrapper must change the input itself). Low-rank
    updates and rescaling vectors (pretune.peft) subclass it; a layer that computes several base layers' outputs at
    once (the fast wing, ``model/fast/``) then lets each wrapper adjust its own slice."""

    base_layer: nn.Linear

    @property
    def fusable(self) -> bool:
        return True

    def adjust(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


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


class FeedForward(nn.Module):
    """Original FFN act(x W1 + b1) W2 + b2, or gated (act(xW) * xV) W2 when cfg.ffn is a GLU variant."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        gated, act = FFNS[cfg.ffn]
        self.act = ACTIVATIONS[act]
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)  # xV (gated) or x W1
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias) if gated else None  # xW
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)  # W2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
