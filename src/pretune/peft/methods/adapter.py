"""Houlsby adapters (Houlsby et al. 2019): a bottleneck (down to dim / reduction_factor, nonlinearity, up) added
to the output of every block's attention and FFN branches before the residual sum; ``up`` starts at zero, so
the adapted model starts equal to the base. The adapter wraps each branch's output stage (``Block.attn_drop``,
``Block.ffn_drop``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PeftConfig
from ..core import PeftError, blocks, unwrap_all
from ..layers import Bottleneck, BranchAdapter

NAME = "adapter"
PARTS = ("adapters",)
MERGEABLE = False  # adds computation
DEFAULT_LR = 1e-3  # peak learning rate when train.lr is not set (Houlsby et al. 2019 search 3e-5..3e-3)
BRANCHES = ("attn_drop", "ffn_drop")  # the branch outputs an adapter wraps
ACTIVATIONS = ("relu", "gelu", "swish", "tanh")


@dataclass
class Settings(PeftConfig):
    """Houlsby adapters' settings (peft.*)."""

    reduction_factor: int = 16  # bottleneck width = dim / reduction_factor
    adapter_act: str = "relu"  # nonlinearity: relu, gelu, swish, tanh


def validate(cfg) -> None:
    if cfg.reduction_factor < 1:
        raise PeftError(f"peft.reduction_factor={cfg.reduction_factor}: must be >= 1")
    if cfg.adapter_act not in ACTIVATIONS:
        raise PeftError(f"peft.adapter_act={cfg.adapter_act!r}: expected one of {ACTIVATIONS}")


def inject(model, cfg, name: str, ctx) -> None:
    dim = model.config.dim
    for block in blocks(model):
        for attr in BRANCHES:
            site = getattr(block, attr)
            if not isinstance(site, BranchAdapter):
                site = BranchAdapter(site, ctx.state)
                setattr(block, attr, site)
            site.adapters[name] = Bottleneck(dim, cfg.reduction_factor, cfg.adapter_act)


def strip(model) -> None:
    unwrap_all(model, BranchAdapter, "inner")
