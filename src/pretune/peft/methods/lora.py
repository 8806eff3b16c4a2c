"""LoRA (Hu et al. 2021): W = W0 + (alpha/r) B A on the target linear layers (rsLoRA: alpha/sqrt(r)); A
Kaiming-uniform, B zeros, so the adapted model starts equal to the base. ``dora``: DoRA (Liu et al. 2024), W =
m (W0 + s B A) / ||W0 + s B A|| per output row with m trained (starting at ||W0||). ``targets=["all-linear"]``:
every linear layer of the body, as peft's ``target_modules="all-linear"``. ``bias`` as in peft (and the lecture's
LoRA code): ``none`` trains no bias, ``all`` every bias of the body, ``lora_only`` those of the adapted layers;
trained biases are saved with the adapter (peft's adapter_config.json records the option)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import PeftConfig
from ..core import PeftError, bias_names, find_targets, own, unwrap_all, wrap
from ..layers import PeftLinear

NAME = "lora"
PARTS = ("lora_A", "lora_B", "lora_magnitude")
MERGEABLE = True  # folds into W0 (merge / peft merge)
DEFAULT_LR = 1e-3  # when train.lr is not set (Hu et al. 2021: 2e-4..5e-4 for RoBERTa-base; small models: more)
DEFAULT_TARGETS = ["q_proj", "v_proj"]
BIAS = ("none", "all", "lora_only")


@dataclass
class Settings(PeftConfig):
    """LoRA's settings (peft.*)."""

    targets: list = field(default_factory=list)  # module patterns (leaf name, dotted suffix or regex), or
    # ["all-linear"]: every linear layer of the body (peft's "all-linear": not the output head); empty: q_proj, v_proj
    r: int = 8  # rank
    alpha: float = 16.0  # scaling alpha / r
    dora: bool = False  # weight-decomposed (DoRA, Liu et al. 2024): a trained magnitude per row (peft's use_dora)
    rslora: bool = False  # scale by alpha / sqrt(r) (rank-stabilised LoRA, Kalajdzievski 2023; peft's use_rslora)
    dropout: float = 0.0  # dropout on the input of A
    bias: str = "none"  # biases trained with the adapter: none, all (every bias of the body), lora_only


def validate(cfg) -> None:
    if cfg.r <= 0:
        raise PeftError(f"peft.r={cfg.r}: the LoRA rank must be >= 1")
    if cfg.alpha <= 0:
        raise PeftError(f"peft.alpha={cfg.alpha}: must be > 0")
    if not 0 <= cfg.dropout < 1:
        raise PeftError(f"peft.dropout={cfg.dropout}: must be in [0, 1)")
    if cfg.bias not in BIAS:
        raise PeftError(f"peft.bias={cfg.bias!r}: expected one of {', '.join(BIAS)}")


ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output layer


def targets(cfg) -> list[str]:
    names = list(cfg.targets) or DEFAULT_TARGETS
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise PeftError(f"peft.targets={names}: {ALL_LINEAR!r} already names every linear layer; give it alone")
        return [r".*"]  # a regular expression over the body's linear layers (heads are never targets)
    return names


def inject(model, cfg, name: str, ctx) -> None:
    found = find_targets(model, targets(cfg), "LoRA")
    for mod_name, m in found.items():
        limit = min(m.in_features, m.out_features)
        if cfg.r > limit:
            raise PeftError(f"LoRA rank r={cfg.r} is larger than layer {mod_name} allows "
                            f"({m.in_features} -> {m.out_features}: at most {limit})")
    for mod_name in found:
        layer: PeftLinear = wrap(model, mod_name)
        layer.add_lora(name, cfg.r, cfg.alpha, cfg.dropout, rslora=cfg.rslora)
        if cfg.dora:
            layer.add_dora(name)
        with torch.no_grad():  # A from our own generator: the same adapter for the same seed
            bound = 1.0 / layer.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) on (r, in) = U(+-1/sqrt(in))
            shape = layer.lora_A[name].weight.shape
            layer.lora_A[name].weight.copy_(torch.rand(shape, generator=ctx.generator) * 2 * bound - bound)
    if cfg.bias == "all":
        own(model, name, bias_names(model))
    elif cfg.bias == "lora_only":
        own(model, name, bias_names(model, list(found)))


def strip(model) -> None:
    unwrap_all(model, PeftLinear, "base_layer")
