"""What a parameter-efficient adapter trains: one method or a '+'-joined combination, and its settings.

The shared settings are ``PeftConfig``'s (``method``, ``base_dtype``); each method declares its own in its module of
``pretune.peft.methods`` (``Settings``, a subclass), with its checks and defaults. ``PeftConfig(method="lora", r=8)``
is lora's settings and ``PeftConfig(method="lora+prompt", ...)`` those of both (one class holding both methods'
fields); ``peft_settings(values)`` builds them from a mapping, checked."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from ..config import ConfigError
from ..runconfig import Owned

BASE_DTYPES = ("fp32", "bf16", "auto", "nf4", "int8")
QUANTIZED_BASES = ("nf4", "int8")  # QLoRA: the frozen base's linear weights stored quantised (pretune.model.quantize)


@dataclass
class PeftConfig(metaclass=Owned):
    """One adapter: ``method`` is a method of ``pretune.peft.methods.METHODS`` or a combination such as
    ``lora+prompt`` or ``embeddings+adapter``; the fields of the methods it names come with it."""

    method: str = ""  # lora | adapter | prefix | prompt | ia3 | embeddings | bitfit, or a '+'-joined combination
    base_dtype: Literal["fp32", "bf16", "auto", "nf4", "int8"] = "fp32"  # storage of the frozen base's linear
    # weights: bf16 halves their memory (matmuls under train.precision=bf16 round them to bf16 anyway); auto: bf16 when
    # the run's precision resolves to bf16; nf4 / int8 (QLoRA): torchao's 4-bit NormalFloat (~0.13x fp32) or int8 per
    # output channel (~0.25x), dequantised for each matmul, any precision. Embedding tables, norms and biases stay
    # fp32, trainable parameters (and AdamW state) too

    SELECTOR = "method"  # PeftConfig(method=X, ...) is the settings of method(s) X (runconfig.Owned)

    @classmethod
    def settings_for(cls, method: str) -> type[PeftConfig]:
        return settings_class(method)

    @classmethod
    def all_keys(cls) -> set[str]:
        return set(peft_defaults())

    @classmethod
    def from_values(cls, values: dict) -> PeftConfig:
        """``runconfig.section("peft", PeftConfig, values)``: the named methods' settings, checked."""
        return peft_settings(values)

    @property
    def methods(self) -> list[str]:
        return [m for m in self.method.split("+") if m]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "adapter config") -> PeftConfig:
        """The settings an adapter file records (keys of methods it does not use, which files written before the
        settings were split list, are left out)."""
        try:
            return peft_settings(data).validated()
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def validate(self) -> None:
        """Check the values of a named method (runconfig.owned_section calls it); none named: nothing to check."""
        if self.methods:
            self.validated()

    def validated(self) -> PeftConfig:
        from . import METHODS  # the registry, through the package (its modules import this one)

        methods = self.methods
        names = ", ".join(METHODS)
        if not methods:
            raise ConfigError(f"peft.method is empty; choose one of {names} or a '+' combination")
        _check_names(self.method)
        for m in methods:
            METHODS[m].validate(self)
        if self.base_dtype not in BASE_DTYPES:
            raise ConfigError(f"peft.base_dtype={self.base_dtype!r}: expected one of {', '.join(BASE_DTYPES)}")
        for name in ("targets", "ia3_targets"):
            value = getattr(self, name, None)
            if isinstance(value, str):
                setattr(self, name, [v for v in value.split(",") if v])
        return self


def _check_names(method: str) -> list[str]:
    from . import METHODS

    methods = [m for m in method.split("+") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"peft.method={method!r}: unknown method {bad[0]!r}; expected one of {', '.join(METHODS)} "
                          "(or a combination such as lora+prompt)")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"peft.method={method!r} names a method twice")
    return methods


@functools.cache
def settings_class(method: str) -> type[PeftConfig]:
    """The settings dataclass of ``method``: PeftConfig itself when empty (full finetuning), the method's own
    ``Settings``, or for a combination one class holding the fields of each (a field two methods share, such as
    prefix's and prompt's ``n_virtual``, is one setting)."""
    if not method:
        return PeftConfig
    from . import METHODS

    classes = list(dict.fromkeys(METHODS[m].Settings for m in _check_names(method)))
    if len(classes) == 1:
        return classes[0]
    # the first method's fields first (a dataclass collects its bases' fields from the last base to the first)
    combined = Owned(f"PeftConfig[{method}]", tuple(reversed(classes)), {"__doc__": f"The settings of {method}."})
    return dataclass(combined)


def peft_settings(values: dict | None = None, **kw) -> PeftConfig:
    """The typed, checked ``peft`` section: ``values`` (and keyword overrides) with ``method`` picking the method(s).
    Keys of other methods are left out (a sweep over methods may share them; an adapter file or run.yaml written
    before the settings were split lists every key); a key no method has is an error naming the nearest."""
    from ..runconfig import owned_section
    from . import METHODS

    values = {**(values or {}), **kw}
    method = values.get("method") or ""
    return owned_section("peft", settings_class(str(method)), values, kind="peft method", name=str(method),
                         owners={n: m.Settings for n, m in METHODS.items()}, selector="method",
                         others="any")


def peft_defaults() -> dict:
    """Every method's settings at their defaults, in one mapping (a config's bottom layer: a PEFT setting given on
    the command line is typed by it)."""
    from ..runconfig import union_defaults
    from . import METHODS

    return union_defaults([PeftConfig, *(m.Settings for m in METHODS.values())])


def base_dtype_for(cfg: PeftConfig, precision: str, resolved: str = "") -> str:
    """``cfg.base_dtype`` as a finetuning run uses it. ``precision``: train.precision as set; ``resolved``: as resolved
    for the device (empty while it is not known: ``auto`` is then returned as it is). ``bf16`` needs a PEFT method
    and bf16 matmuls (a bf16 weight in an fp32 matmul would fail or be upcast every step): a ConfigError naming both
    keys otherwise. ``auto``: bf16 exactly when a PEFT run's precision resolves to bf16 (train.precision=auto picks
    it only where the device computes bf16 natively). One process, DDP and FSDP alike (FSDP2 shards a bf16 weight as
    it is and gathers it in bf16, as its bf16 mixed-precision policy gathers fp32 ones)."""
    if cfg.base_dtype == "auto":
        return cfg.base_dtype if not resolved else "bf16" if cfg.method and resolved == "bf16" else "fp32"
    if cfg.base_dtype in QUANTIZED_BASES:
        if not cfg.method:
            raise ConfigError(f"peft.base_dtype={cfg.base_dtype} stores the frozen base of a PEFT run quantised "
                              "(QLoRA): set peft.method (full finetuning trains every weight, in fp32)")
        return cfg.base_dtype
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
