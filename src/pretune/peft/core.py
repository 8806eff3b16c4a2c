"""What every PEFT method builds on: the model's PEFT state, finding and wrapping target layers, and telling
PEFT parameters (and the base parameters an adapter trains) from the base model's own."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError
from ..io.checkpoint import unique_state
from ..model.attention import Attention
from ..model.transformer import Block
from .layers import PEFT_PARTS, PeftLinear, PeftState


class PeftError(ConfigError):
    """A PEFT request that cannot be met; the message names the adapter, module or tensor."""


@dataclass
class InjectContext:
    """What a method's ``inject`` gets besides the model and the config."""

    state: PeftState
    generator: torch.Generator  # initialisation (the same adapter for the same seed)
    tokenizer: object | None = None  # prompt tuning initialised from words


def peft_state(model) -> PeftState:
    if getattr(model, "peft_state", None) is None:
        model.peft_state = PeftState()
    return model.peft_state


def adapter_names(model) -> list[str]:
    state = getattr(model, "peft_state", None)
    return list(state.configs) if state is not None else []


def _param_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(^|\.)({'|'.join(PEFT_PARTS)})\.{re.escape(name)}(\.|$)")


def adapter_parameters(model, name: str) -> dict[str, nn.Parameter]:
    """The parameters that belong to adapter ``name`` (not its task head, not the base parameters it trains)."""
    rx = _param_pattern(name)
    return {n: p for n, p in model.named_parameters() if rx.search(n) and ".adapter_heads." not in f".{n}"}


def is_peft_parameter(param_name: str) -> bool:
    return re.search(rf"(^|\.)({'|'.join(PEFT_PARTS)})(\.|$)", param_name) is not None


def strip_name(param: str, name: str) -> str:
    """A parameter name without its adapter name (``...lora_A.spam.weight`` -> ``...lora_A.weight``)."""
    return re.sub(rf"(^|\.)({'|'.join(PEFT_PARTS)})\.{re.escape(name)}(\.|$)", r"\1\2\3", param)


def base_name(param: str) -> str:
    """The base model's name of a (possibly wrapped) parameter: wrappers' ``base_layer.`` / ``inner.`` /
    ``base.`` steps left out."""
    name = param.replace(".base_layer.", ".").replace(".inner.", ".")
    return "head." + name[len("head.base."):] if name.startswith("head.base.") else name


def base_state(model) -> dict[str, torch.Tensor]:
    """The model's own tensors under their plain names (PEFT wrappers and parameters left out)."""
    return {base_name(k): v for k, v in unique_state(model).items()
            if not is_peft_parameter(k) and not k.startswith(("peft_", "head.adapter_heads."))}


def base_parameters(model) -> dict[str, nn.Parameter]:
    """The model's own parameters under their plain names, as :func:`base_state` names them."""
    seen, out = set(), {}
    for k, p in model.named_parameters():
        if id(p) in seen or is_peft_parameter(k) or k.startswith(("peft_", "head.adapter_heads.")):
            continue
        seen.add(id(p))
        out[base_name(k)] = p
    return out


def bias_names(model, modules: Sequence[str] | None = None) -> list[str]:
    """Base names of the body's bias parameters (the transformer and the pooler, not the task head); with
    ``modules``, only those of these (wrapped) linear layers."""
    names = [k for k in base_parameters(model) if k.endswith(".bias") and not k.startswith("head.")]
    if modules is None:
        return names
    wanted = {f"{base_name(m)}.bias" for m in modules}
    return [k for k in names if k in wanted]


def own(model, name: str, params: Sequence[str]) -> None:
    """Adapter ``name`` trains (and saves) these base parameters; another adapter that owns one is an error."""
    state = peft_state(model)
    for k in params:
        other = state.owners.get(k)
        if other is not None and other != name:
            raise PeftError(f"adapter {other!r} already trains {k}; one adapter may train a base parameter")
    for k in params:
        state.owners[k] = name


def matches(module_name: str, pattern: str) -> bool:
    """A target pattern matches a module by its leaf name (``q_proj``), a dotted suffix
    (``attn.q_proj``) or, failing both, a regular expression over the whole name."""
    if module_name == pattern or module_name.endswith("." + pattern):
        return True
    try:
        return re.fullmatch(pattern, module_name) is not None
    except re.error:
        return False


def linear_modules(model) -> dict[str, nn.Linear | PeftLinear]:
    """The body's linear layers by full name (heads, pooler and PEFT modules themselves excluded)."""
    out = {}
    for name, m in model.transformer.named_modules(prefix="transformer"):
        if isinstance(m, PeftLinear):
            out[name] = m
        elif isinstance(m, nn.Linear) and not re.search(r"\.(lora_A|lora_B|adapters|base_layer)(\.|$)", name):
            out[name] = m
    return out


def find_targets(model, patterns: Sequence[str], what: str) -> dict[str, nn.Linear | PeftLinear]:
    mods = linear_modules(model)
    found = {}
    for pat in patterns:
        hit = {n: m for n, m in mods.items() if matches(n, pat)}
        if not hit:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in mods})
            raise PeftError(f"{what} target {pat!r} matches no linear layer of the model; its linear layers are "
                            f"named {', '.join(leaves)} (e.g. {next(iter(mods))}); a pattern is a leaf name, a "
                            f"dotted suffix or a regular expression over the full name")
        found.update(hit)
    return found


def wrap(model, module_name: str) -> PeftLinear:
    """The PeftLinear at ``module_name``, wrapping the nn.Linear there on first use."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    current = getattr(parent, leaf)
    if isinstance(current, PeftLinear):
        return current
    wrapped = PeftLinear(current, peft_state(model))
    setattr(parent, leaf, wrapped)
    return wrapped


def unwrap_all(model, cls: type[nn.Module], inner: str) -> None:
    """Put back the module each ``cls`` wrapper holds as ``inner`` (nothing merged)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, cls):
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, getattr(m, inner))


def unique(modules) -> list:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def self_attentions(model) -> list[Attention]:
    return unique(m for m in model.transformer.modules() if isinstance(m, Attention) and not m.cross)


def blocks(model) -> list[Block]:
    return unique(m for m in model.transformer.modules() if isinstance(m, Block))


def module_dict(model, attr: str) -> nn.ModuleDict:
    """The nn.ModuleDict ``model.<attr>``, created on first use (prefix encoders, soft prompts)."""
    if getattr(model, attr, None) is None:
        setattr(model, attr, nn.ModuleDict())
    return getattr(model, attr)
