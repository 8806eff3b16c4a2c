"""What a parameter-efficient adapter trains: one method or a '+'-joined combination, and its sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import ConfigError

METHODS = ("lora", "adapter", "prefix", "prompt", "ia3", "embeddings")
METHOD_HELP = {
    "lora": "low-rank update W0 + (alpha/r) B A of the target linear layers (Hu et al. 2021)",
    "adapter": "Houlsby bottleneck (down, nonlinearity, up, residual) after attention and after the FFN",
    "prefix": "trainable key/value prefixes at every self-attention layer (Li & Liang 2021)",
    "prompt": "a soft prompt of n_virtual trainable embeddings prepended to the input (Lester et al. 2021)",
    "ia3": "learned vectors rescaling keys, values and the FFN inner activation (Liu et al. 2022, T-Few)",
    "embeddings": "train the token embedding matrix only (language adaptation)",
}
DEFAULT_TARGETS = {"lora": ["q_proj", "v_proj"], "ia3": ["k_proj", "v_proj", "down_proj"]}
IA3_INPUT = ("down_proj",)  # (IA)3 scales the input of these layers (the FFN inner activation), not the output
ACTIVATIONS = ("relu", "gelu", "swish", "tanh")


@dataclass
class PeftConfig:
    """One adapter: ``method`` is a method of METHODS or a combination such as ``lora+prompt`` or
    ``embeddings+adapter``. Fields of methods not in ``method`` are ignored."""

    method: str = ""  # lora | adapter | prefix | prompt | ia3 | embeddings, or a '+'-joined combination
    targets: list = field(default_factory=list)  # lora: module patterns (leaf name, dotted suffix or regex)
    r: int = 8  # lora rank
    alpha: float = 16.0  # lora scaling alpha / r
    dropout: float = 0.0  # lora: dropout on the input of A
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

    def lora_targets(self) -> list[str]:
        return list(self.targets) or DEFAULT_TARGETS["lora"]

    def ia3_target_list(self) -> list[str]:
        return list(self.ia3_targets) or DEFAULT_TARGETS["ia3"]

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
        methods = self.methods
        if not methods:
            raise ConfigError(f"peft.method is empty; choose one of {', '.join(METHODS)} or a '+' combination")
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ConfigError(f"peft.method={self.method!r}: unknown method {bad[0]!r}; expected one of "
                              f"{', '.join(METHODS)} (or a combination such as lora+prompt)")
        if len(set(methods)) != len(methods):
            raise ConfigError(f"peft.method={self.method!r} names a method twice")
        if "lora" in methods:
            if self.r <= 0:
                raise ConfigError(f"peft.r={self.r}: the LoRA rank must be >= 1")
            if self.alpha <= 0:
                raise ConfigError(f"peft.alpha={self.alpha}: must be > 0")
            if not 0 <= self.dropout < 1:
                raise ConfigError(f"peft.dropout={self.dropout}: must be in [0, 1)")
        if "adapter" in methods:
            if self.reduction_factor < 1:
                raise ConfigError(f"peft.reduction_factor={self.reduction_factor}: must be >= 1")
            if self.adapter_act not in ACTIVATIONS:
                raise ConfigError(f"peft.adapter_act={self.adapter_act!r}: expected one of {ACTIVATIONS}")
        if ("prefix" in methods or "prompt" in methods) and self.n_virtual < 1:
            raise ConfigError(f"peft.n_virtual={self.n_virtual}: prefix/prompt tuning needs >= 1 virtual token")
        if self.prefix_projection < 0:
            raise ConfigError(f"peft.prefix_projection={self.prefix_projection}: must be >= 0")
        init_ok = self.prompt_init in ("vocab", "random") or self.prompt_init.startswith("text:")
        if "prompt" in methods and not init_ok:
            raise ConfigError(f"peft.prompt_init={self.prompt_init!r}: expected vocab, random or text:WORDS")
        for name in ("targets", "ia3_targets"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [v for v in value.split(",") if v])
        return self
