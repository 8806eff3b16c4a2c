"""Train the token embedding matrix only (language adaptation), optionally with a learned position table
(``embed_positions``); the adapter saves the trained matrix."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import PeftConfig
from ..core import base_parameters, own

NAME = "embeddings"
PARTS = ()
MERGEABLE = True  # the trained matrix is the model's own
DEFAULT_LR = 1e-4  # when train.lr is not set (the whole matrix moves, as in full finetuning)


@dataclass
class Settings(PeftConfig):
    """Embeddings-only training's settings (peft.*)."""

    embed_positions: bool = False  # also train a learned position table


def validate(cfg) -> None:
    return None


def inject(model, cfg, name: str, ctx) -> None:
    params = base_parameters(model)
    owned = ["transformer.embed.weight"]
    pos = getattr(model.transformer.input_stack.position, "weight", None)
    if cfg.embed_positions and isinstance(pos, nn.Parameter):
        owned += [k for k, p in params.items() if p is pos]
    own(model, name, owned)
