"""Put adapters into a model (in place), freeze the rest, route adapters per example, merge LoRA.

    summary = inject(model, PeftConfig(method="lora", r=8), name="sst2")   # base frozen, head trainable
    with route(model, ["sst2", None, "spam"]):                              # one adapter per example
        out = model(ids, attention_mask=mask)
    merge(model); unmerge(model)                                            # fold LoRA into W0 and back
    cast_base(model, torch.bfloat16)      # the frozen linear weights stored in bf16 (PeftConfig.base_dtype="bf16")
    quantize_base(model, "nf4")           # ... stored quantised, QLoRA (PeftConfig.base_dtype="nf4" or "int8")

Each method is a module of ``pretune.peft.methods`` (its ``inject`` wraps the layers it changes); this file is
the engine that runs them, whatever the method.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..config import TASK_HEADS
from ..model import QuantizedLinear, dequantize, quantize
from ..model.heads import LMHead, MLMHead
from .config import PeftConfig
from .core import (
    InjectContext,
    PeftError,
    adapter_names,
    adapter_parameters,
    base_parameters,
    base_state,
    is_peft_parameter,
    peft_state,
)
from .layers import PeftLinear, RoutedHead
from .methods import METHODS
from .new_tokens import TokenRows, merge_new_tokens, strip_new_tokens

__all__ = ["inject", "freeze_for", "cast_base", "quantize_base", "base_matmul_weights",
           "trainable_summary", "format_summary", "set_active", "route", "merge", "unmerge",
           "merged_model", "strip_peft", "PeftError", "adapter_names", "adapter_parameters", "is_peft_parameter",
           "peft_state"]


def inject(model, cfg: PeftConfig, name: str = "default", *, tokenizer=None, train: bool = True,
           activate: bool = True, seed: int = 0) -> dict:
    """Add adapter ``name`` (cfg.method: one method or a '+' combination) to ``model`` in place.

    ``name`` becomes the only active adapter (``activate``); with ``train`` every parameter but its own,
    the task head's (classification, tagging, ...) and the base parameters it trains (embeddings, biases) is
    frozen, and with ``cfg.base_dtype="bf16"`` the frozen linear weights are then stored in bf16 (:func:`cast_base`),
    with ``nf4`` / ``int8`` quantised (:func:`quantize_base`, QLoRA).
    Returns {trainable, total, fraction}, plus {base_cast, base_bytes_saved} when the base was cast or quantised.
    """
    cfg = cfg.validated()
    if train and cfg.base_dtype == "auto":
        raise PeftError("peft.base_dtype=auto is resolved by a run from its train.precision (pretune finetune does "
                        "it); inject takes fp32 or bf16")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise PeftError(f"adapter name {name!r}: use letters, digits, '_' and '-' only")
    state = peft_state(model)
    if name in state.configs:
        raise PeftError(f"the model already has an adapter named {name!r}; choose another name")
    ctx = InjectContext(state=state, generator=torch.Generator().manual_seed(seed), tokenizer=tokenizer)
    for method in cfg.methods:
        METHODS[method].inject(model, cfg, name, ctx)
    state.configs[name] = cfg
    if activate:
        state.active = [name]
    if train:
        freeze_for(model, name)
    summary = trainable_summary(model)
    if train and cfg.base_dtype == "bf16":
        cast = cast_base(model, torch.bfloat16)
        summary.update(base_cast=cast["params"], base_bytes_saved=cast["bytes_saved"])
    if train and cfg.base_dtype in ("nf4", "int8"):
        cast = quantize_base(model, cfg.base_dtype)
        summary.update(base_cast=cast["params"], base_bytes_saved=cast["bytes_saved"])
    return summary


def freeze_for(model, name: str) -> None:
    """Only adapter ``name``'s parameters (plus the task head, plus the base parameters it trains) train."""
    state = peft_state(model)
    own = set(adapter_parameters(model, name).values())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in own:
        p.requires_grad_(True)
    if model.config.head in TASK_HEADS and model.head is not None:
        for p in model.head.parameters():
            p.requires_grad_(True)
    params = base_parameters(model)
    for k in state.owned(name):
        params[k].requires_grad_(True)


def base_matmul_weights(model) -> dict[str, nn.Parameter]:
    """The base model's weights that only matmuls read, by base name: every nn.Linear's of the body (wrapped ones
    included) and the LM head's output matrix when it is not the token embedding. Lookup tables (token, position and
    token-type embeddings, relative position tables, a head tied to the embedding) are not among them."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}  # a tied head's weight too
    readers = [m for m in model.modules() if isinstance(m, (nn.Linear, LMHead, MLMHead))]
    wanted = {id(m.weight) for m in readers} - tables
    return {k: p for k, p in base_parameters(model).items() if id(p) in wanted}


@torch.no_grad()
def cast_base(model, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Store the frozen matmul weights of the base (:func:`base_matmul_weights` that do not train) in ``dtype``, in
    place: the same Parameter objects, so ties, wrappers and shared layers stay as they are. ``torch.float32``
    casts them back (exactly: every bf16 value is an fp32 value).

    Under bf16 autocast a linear layer rounds an fp32 weight to bf16 before its matmul, so a bf16-stored weight gives
    the same outputs and gradients bit for bit while taking half the memory (and no per-step cast). The rest stays
    fp32 on purpose: embedding tables (a lookup is not autocast, so a bf16 table would round the residual stream),
    norm weights and biases (1-D, tiny; norms compute in fp32), and everything that trains (adapters, the task
    head, trained biases), with their AdamW state. A bf16 base must then run under bf16 autocast (or be cast back).
    Returns {params: parameters cast, bytes_saved: bytes freed (negative when widening)}."""
    n, saved = 0, 0
    for p in base_matmul_weights(model).values():
        if p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
            continue
        before = p.element_size()
        p.data = p.data.to(dtype)  # the Parameter object stays (ties, optimizer-free: it is frozen)
        n += p.numel()
        saved += p.numel() * (before - p.element_size())
    return {"params": n, "bytes_saved": saved}


@torch.no_grad()
def quantize_base(model, fmt: str) -> dict:
    """QLoRA: store the frozen linear layers of the body (attention and FFN projections with no parameter that trains,
    LoRA's base layers included) quantised, in place — ``nf4`` (torchao's NF4, blocks of 64) or ``int8`` (per output
    channel): ``pretune.model.quantize(..., only_frozen=True, kernels=False)`` with the LM head left as it is. Each
    matmul, with or without gradients, dequantises the weight (to the autocast dtype, or the input's; so a DPO
    reference pass with the adapters off computes the training pass's base exactly) and the input's gradient is
    taken through it; the adapters and everything that trains stay fp32. DoRA's magnitudes are set again from the
    quantised weights, so the adapted model still starts equal to its (quantised) base. Returns {params: weights
    quantised, bytes_saved}."""
    before = {id(m): m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear}
    quantize(model, fmt, head=None, only_frozen=True, kernels=False)
    q = model.quantization
    fp_bytes = sum(b for m_id, b in before.items()
                   if m_id not in {id(m) for m in model.modules() if type(m) is nn.Linear})
    for m in model.modules():
        if isinstance(m, PeftLinear) and isinstance(m.base_layer, QuantizedLinear):
            for name in m.lora_magnitude:
                m.lora_magnitude[name].copy_(m.dora_norm(name))
    return {"params": q["weights"], "bytes_saved": fp_bytes - q["bytes"]}


def trainable_summary(model) -> dict:
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"trainable": trainable, "total": total, "fraction": trainable / max(total, 1)}


def format_summary(s: dict) -> str:
    return f"trainable parameters: {s['trainable']:,} of {s['total']:,} ({100 * s['fraction']:.3f}%)"


def set_active(model, names: str | Sequence[str] | None) -> None:
    """The adapters applied to every row when no per-example routing is given (None: none)."""
    state = peft_state(model)
    names = [] if names is None else [names] if isinstance(names, str) else list(names)
    for n in names:
        if n not in state.configs:
            raise PeftError(f"no adapter named {n!r}; the model has {list(state.configs) or 'none'}")
    state.active = names


@contextlib.contextmanager
def route(model, adapters: Sequence[str | None]) -> Iterator[None]:
    """Inside the block, batch row i uses adapter ``adapters[i]`` (None: the base model)."""
    state = peft_state(model)
    rows: dict[str, list[int]] = {}
    for i, n in enumerate(adapters):
        if n is None:
            continue
        if n not in state.configs:
            raise PeftError(f"row {i}: no adapter named {n!r}; the model has {list(state.configs) or 'none'}")
        rows.setdefault(n, []).append(i)
    merged = sorted({n for m in model.modules() if isinstance(m, PeftLinear) for n in m.merged})
    if merged:
        raise PeftError(f"adapters {merged} are merged into the base weights; unmerge before routing per example")
    for n, r in rows.items():
        owned = state.owned(n)
        if owned and len(r) != len(adapters):
            raise PeftError(f"adapter {n!r} trains base parameters every row shares ({owned[0]}"
                            f"{f' and {len(owned) - 1} more' if len(owned) > 1 else ''}): it cannot run beside other "
                            "adapters in one batch")
    device = next(model.parameters()).device
    old = state.rows, state.batch_rows
    state.rows = {n: torch.tensor(r, dtype=torch.long, device=device) for n, r in rows.items()}
    state.batch_rows = len(adapters)
    try:
        yield
    finally:
        state.rows, state.batch_rows = old


def _names(model, names) -> list[str]:
    state = peft_state(model)
    names = state.active if names is None else [names] if isinstance(names, str) else list(names)
    for n in names:
        if n not in state.configs:
            raise PeftError(f"no adapter named {n!r}; the model has {list(state.configs) or 'none'}")
    return names


def merge(model, names: str | Sequence[str] | None = None) -> None:
    """Fold the LoRA / (IA)3 weights of ``names`` (default: the active adapters) into the base weights (the base
    parameters an embeddings or BitFit adapter trains are in them already). Computed in fp32; a bf16-stored base
    keeps its dtype, so the merged weight is rounded to bf16 (:func:`merged_model` widens the base first)."""
    state = peft_state(model)
    for n in _names(model, names):
        other = [m for m in state.configs[n].methods if not METHODS[m].MERGEABLE]
        if other:
            raise PeftError(f"adapter {n!r} uses {'+'.join(other)}, which adds computation rather than changing "
                            "weights: only LoRA and (IA)3 merge into the base model (embeddings and BitFit "
                            "adapters train base weights directly)")
        for m in model.modules():
            if isinstance(m, PeftLinear):
                if isinstance(m.base_layer, QuantizedLinear):
                    raise PeftError(f"adapter {n!r} cannot merge into a quantised base layer (peft.base_dtype=nf4 or "
                                    "int8 stores it as codes): peft.merged_model dequantises the base first, or "
                                    "load the adapter on the unquantised base")
                m.merge(n)
        merge_new_tokens(model, n)  # new tokens' rows (task.add_tokens) into the embedding table


def unmerge(model, names: str | Sequence[str] | None = None) -> None:
    """Subtract merged adapters again (the base weights come back to within float rounding)."""
    names = _names(model, names) if names is not None else adapter_names(model)
    for m in model.modules():
        if isinstance(m, (PeftLinear, TokenRows)):
            for n in reversed(list(m.merged)):
                if n in names:
                    m.unmerge(n)


def merged_model(model, name: str | None = None):
    """A plain TransformerLM (no PEFT modules) whose weights have adapter ``name`` merged in, with that
    adapter's task head, in fp32 (a bf16-stored base is widened first). The original model is left as it was."""
    from ..model import TransformerLM

    state = peft_state(model)
    name = name or (state.active[0] if len(state.active) == 1 else None)
    if name is None:
        raise PeftError(f"which adapter? the model has {list(state.configs)}; pass name=")
    work = copy.deepcopy(model)
    cast_base(work, torch.float32)  # a bf16-stored base merges in fp32: W0 + s B A is not rounded back to bf16
    dequantize(work)  # a quantised base (QLoRA) too: the weights its codes stand for, in fp32
    merge(work, name)
    routed = isinstance(work.head, RoutedHead)
    own_head = routed and name in work.head.adapter_heads
    head = work.head.adapter_heads[name] if own_head else (work.head.base if routed else work.head)
    cfg = model.config.replace(**state.head_configs[name]) if own_head else model.config
    plain = TransformerLM(cfg)
    state_dict = {k: v for k, v in base_state(work).items() if not k.startswith("head.")}
    if head is not None:
        state_dict.update({f"head.{k}": v for k, v in head.state_dict().items()})
    missing, unexpected = plain.load_state_dict(state_dict, strict=False)
    tied = {"head.weight"} if cfg.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PeftError(f"merged model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return plain.eval()


def strip_peft(model) -> None:
    """Remove every PEFT module in place (wrapped layers get their base layer back; nothing is merged)."""
    for method in METHODS.values():
        strip = getattr(method, "strip", None)
        if strip is not None:
            strip(model)
    strip_new_tokens(model)
    if isinstance(model.head, RoutedHead):
        model.head = model.head.base
    model.peft_state = None
