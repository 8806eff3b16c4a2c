"""(IA)3 (Liu et al. 2022, T-Few): learned vectors l rescaling the keys, the values and the FFN's inner
activation: y = l * (W x) for k_proj / v_proj, W (l * x) for down_proj (the inner activation is its input);
l starts at 1, so the adapted model starts equal to the base."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import PeftConfig
from ..core import PeftError, find_targets, unwrap_all, wrap
from ..layers import PeftLinear

NAME = "ia3"
PARTS = ("ia3",)
MERGEABLE = True  # folds into the rows / columns of W
DEFAULT_LR = 1e-2  # when train.lr is not set (T-Few's 3e-3 (Liu et al. 2022) is for 1000 steps; in 3 epochs of a
# small set it moves too little: BENCHMARKS.md, PEFT vs full)
DEFAULT_TARGETS = ["k_proj", "v_proj", "down_proj"]
INPUT_SIDE = ("down_proj",)  # these layers get the vector on their input (the FFN inner activation)


@dataclass
class Settings(PeftConfig):
    """(IA)3's settings (peft.*)."""

    ia3_targets: list = field(default_factory=list)  # module patterns; empty: keys, values, FFN inner activation


def validate(cfg) -> None:
    return None


def targets(cfg) -> list[str]:
    return list(cfg.ia3_targets) or DEFAULT_TARGETS


def inject(model, cfg, name: str, ctx) -> None:
    for mod_name in find_targets(model, targets(cfg), "(IA)3"):
        layer = wrap(model, mod_name)
        on_input = mod_name.endswith(INPUT_SIDE)
        if layer.ia3 and layer.ia3_input != on_input:
            side = "input" if layer.ia3_input else "output"
            raise PeftError(f"{mod_name} already has (IA)3 vectors on its {side}")
        layer.add_ia3(name, on_input)


def strip(model) -> None:
    unwrap_all(model, PeftLinear, "base_layer")
