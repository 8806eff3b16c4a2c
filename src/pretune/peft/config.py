"""What a parameter-efficient adapter trains: one method or a '+'-joined combination, and its sizes.

The methods themselves (and their help, checks and defaults) are the modules of ``pretune.peft.methods``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import ConfigError


@dataclass
class PeftConfig:
    """One adapter: ``method`` is a method of ``pretune.peft.methods.METHODS`` or a combination such as
    ``lora+prompt`` or ``embeddings+adapter``. Each method reads the fields that concern it."""

    method: str = ""  # lora | adapter | prefix | prompt | ia3 | embeddings | bitfit, or a '+'-joined combination
    targets: list = field(default_factory=list)  # lora: module patterns (leaf name, dotted suffix or regex), or
    # ["all-linear"]: every linear layer of the body (peft's "all-linear": not the output head)
    r: int = 8  # lora rank
    alpha: float = 16.0  # lora scaling alpha / r
    dora: bool = False  # lora: weight-decomposed (DoRA, Liu et al. 2024): a trained magnitude per row (use_dora)
    rslora: bool = False  # lora: scale by alpha / sqrt(r) (rank-stabilised LoRA, Kalajdzievski 2023; peft use_rslora)
    dropout: float = 0.0  # lora: dropout on the input of A
    bias: str = "none"  # lora: biases trained with the adapter: none, all (every bias of the body), lora_only
    ia3_targets: list = field(default_factory=list)  # (IA)3 module patterns; default keys, values, FFN inner
    reduction_factor: int = 16  # adapter: bottleneck width = dim / reduction_factor
    adapter_act: str = "relu"  # adapter nonlinearity: relu, gelu, swish, tanh
    n_virtual: int = 20  # prefix / prompt: number of virtual tokens
    prefix_projection: int = 0  # prefix: hidden width of the reparametrisation MLP (0: train the prefixes directly)
    prompt_init: str = "vocab"  # prompt: vocab (rows of random vocabulary embeddings), random, or text:WORDS
    embed_positions: bool = False  # embeddings: also train a learned position table

    @property
    def methods(self) -> list[str]:
        return [m for m in self.method.split("+") if m]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "adapter config") -> PeftConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown PEFT keys {unknown}; expected some of {sorted(known)}")
        return cls(**data).validated()

    def validated(self) -> PeftConfig:
        from .methods import METHODS

        methods = self.methods
        names = ", ".join(METHODS)
        if not methods:
            raise ConfigError(f"peft.method is empty; choose one of {names} or a '+' combination")
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ConfigError(f"peft.method={self.method!r}: unknown method {bad[0]!r}; expected one of {names} "
                              "(or a combination such as lora+prompt)")
        if len(set(methods)) != len(methods):
            raise ConfigError(f"peft.method={self.method!r} names a method twice")
        for m in methods:
            METHODS[m].validate(self)
        for name in ("targets", "ia3_targets"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [v for v in value.split(",") if v])
        return self
