"""BitFit (Ben Zaken et al. 2021): train only the bias terms of the body (every linear and norm bias, the
pooler's) and the task head; the adapter saves the trained biases. Needs a model with biases (BERT, GPT-2, not
T5 or Llama)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PeftConfig
from ..core import PeftError, bias_names, own

NAME = "bitfit"
PARTS = ()
MERGEABLE = True  # the trained biases are the model's own
DEFAULT_LR = 1e-3  # peak learning rate when train.lr is not set (Ben Zaken et al. 2021 search 1e-4..1e-3)


@dataclass
class Settings(PeftConfig):
    """BitFit has no settings of its own."""


def validate(cfg) -> None:
    return None


def inject(model, cfg, name: str, ctx) -> None:
    names = bias_names(model)
    if not names:
        raise PeftError("BitFit trains the bias terms, but this model has none (bias=False, no norm biases: T5, "
                        "Llama); choose another method, e.g. lora or ia3")
    own(model, name, names)
