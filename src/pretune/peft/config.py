"""What a parameter-efficient adapter trains: one method or a '+'-joined combination, and its sizes.

The methods themselves (and their help, checks and defaults) are the modules of ``pretune.peft.methods``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..config import ConfigError

BASE_DTYPES = ("fp32", "bf16", "auto")


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
    base_dtype: Literal["fp32", "bf16", "auto"] = "fp32"  # storage of the frozen base's linear weights: bf16 halves
    # their memory (matmuls under train.precision=bf16 round them to bf16 anyway); auto: bf16 when the run's precision
    # resolves to bf16. Embedding tables, norms and biases stay fp32, trainable parameters (and AdamW state) too

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
        if self.base_dtype not in BASE_DTYPES:
            raise ConfigError(f"peft.base_dtype={self.base_dtype!r}: expected one of {', '.join(BASE_DTYPES)}")
        for name in ("targets", "ia3_targets"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [v for v in value.split(",") if v])
        return self


def base_dtype_for(cfg: PeftConfig, precision: str, resolved: str = "") -> str:
    """``cfg.base_dtype`` as a finetuning run uses it. ``precision``: train.precision as set; ``resolved``: as resolved
    for the device (empty while it is not known: ``auto`` is then returned as it is). ``bf16`` needs a PEFT method
    and bf16 matmuls (a bf16 weight in an fp32 matmul would fail or be upcast every step): a ConfigError naming both
    keys otherwise. ``auto``: bf16 exactly when a PEFT run's precision resolves to bf16 (train.precision=auto picks
    it only where the device computes bf16 natively). One process, DDP and FSDP alike (FSDP2 shards a bf16 weight as
    it is and gathers it in bf16, as its bf16 mixed-precision policy gathers fp32 ones)."""
    if cfg.base_dtype == "auto":
        return cfg.base_dtype if not resolved else "bf16" if cfg.method and resolved == "bf16" else "fp32"
    if cfg.base_dtype != "bf16":
        return cfg.base_dtype
    if not cfg.method:
        raise ConfigError("peft.base_dtype=bf16 stores the frozen base of a PEFT run in bf16: set peft.method (full "
                          "finetuning trains every weight, in fp32)")
    now = resolved or precision
    if now in ("fp32", "fp16"):
        how = f"train.precision={precision}" + (f" (resolved to {now} on this device)" if now != precision else "")
        raise ConfigError(f"peft.base_dtype=bf16 needs train.precision=bf16, but {how}: a bf16 weight feeds only bf16 "
                          "matmuls (fp32 ones would fail or upcast it every step). Set train.precision=bf16, or "
                          "peft.base_dtype=auto (bf16 exactly when the precision is) or fp32")
    return "bf16"
