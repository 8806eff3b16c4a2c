"""Put adapters into a model (in place), freeze the rest, route adapters per example, merge LoRA.

    summary = inject(model, PeftConfig(method="lora", r=8), name="sst2")   # base frozen, head trainable
    with route(model, ["sst2", None, "spam"]):                              # one adapter per example
        out = model(ids, attention_mask=mask)
    merge(model); unmerge(model)                                            # fold LoRA into W0 and back
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..config import TASK_HEADS, ConfigError
from ..model.attention import Attention
from ..model.transformer import Block
from .config import IA3_INPUT, PeftConfig
from .layers import AdapterSite, Bottleneck, PeftLinear, PeftState, PrefixEncoder, PrefixSite, PromptSite, SoftPrompt

_PEFT_PARTS = ("lora_A", "lora_B", "ia3", "adapters", "peft_prefix", "peft_prompt", "peft_heads")


class PeftError(ConfigError):
    """A PEFT request that cannot be met; the message names the adapter, module or tensor."""


def peft_state(model) -> PeftState:
    if getattr(model, "peft_state", None) is None:
        model.peft_state = PeftState()
    return model.peft_state


def adapter_names(model) -> list[str]:
    state = getattr(model, "peft_state", None)
    return list(state.configs) if state is not None else []


def _param_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(^|\.)({'|'.join(_PEFT_PARTS)})\.{re.escape(name)}(\.|$)")


def adapter_parameters(model, name: str) -> dict[str, nn.Parameter]:
    """The parameters that belong to adapter ``name`` (not its task head, not trained embeddings)."""
    rx = _param_pattern(name)
    return {n: p for n, p in model.named_parameters() if rx.search(n)}


def is_peft_parameter(param_name: str) -> bool:
    return re.search(rf"(^|\.)({'|'.join(_PEFT_PARTS)})(\.|$)", param_name) is not None


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


def _unique(modules) -> list:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def _self_attentions(model) -> list[Attention]:
    return _unique(m for m in model.transformer.modules() if isinstance(m, Attention) and not m.cross)


def _blocks(model) -> list[Block]:
    return _unique(m for m in model.transformer.modules() if isinstance(m, Block))


def _ensure_dict(model, attr: str) -> nn.ModuleDict:
    if getattr(model, attr, None) is None:
        setattr(model, attr, nn.ModuleDict())
    return getattr(model, attr)


def inject(model, cfg: PeftConfig, name: str = "default", *, tokenizer=None, train: bool = True,
           activate: bool = True, seed: int = 0) -> dict:
    """Add adapter ``name`` (cfg.method: one method or a '+' combination) to ``model`` in place.

    ``name`` becomes the only active adapter (``activate``); with ``train`` every parameter but its own,
    the task head's (classification, tagging, ...) and the embeddings it trains is frozen.
    Returns {trainable, total, fraction}.
    """
    cfg = cfg.validated()
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise PeftError(f"adapter name {name!r}: use letters, digits, '_' and '-' only")
    state = peft_state(model)
    if name in state.configs:
        raise PeftError(f"the model already has an adapter named {name!r}; choose another name")
    mcfg = model.config
    methods = cfg.methods
    gen = torch.Generator().manual_seed(seed)
    if "lora" in methods:
        targets = find_targets(model, cfg.lora_targets(), "LoRA")
        for mod_name, m in targets.items():
            limit = min(m.in_features, m.out_features)
            if cfg.r > limit:
                raise PeftError(f"LoRA rank r={cfg.r} is larger than layer {mod_name} allows "
                                f"({m.in_features} -> {m.out_features}: at most {limit})")
        for mod_name in targets:
            layer = wrap(model, mod_name)
            layer.add_lora(name, cfg.r, cfg.alpha, cfg.dropout)
            with torch.no_grad():  # A from our own generator: the same adapter for the same seed
                bound = 1.0 / layer.in_features ** 0.5  # kaiming_uniform(a=sqrt(5)) on (r, in) = U(+-1/sqrt(in))
                layer.lora_A[name].weight.copy_(torch.rand(layer.lora_A[name].weight.shape, generator=gen)
                                                * 2 * bound - bound)
    if "ia3" in methods:
        for mod_name in find_targets(model, cfg.ia3_target_list(), "(IA)3"):
            layer = wrap(model, mod_name)
            on_input = mod_name.endswith(IA3_INPUT)
            if layer.ia3 and layer.ia3_input != on_input:
                side = "input" if layer.ia3_input else "output"
                raise PeftError(f"{mod_name} already has (IA)3 vectors on its {side}")
            layer.add_ia3(name, on_input)
    if "adapter" in methods:
        for block in _blocks(model):
            for attr in ("attn_adapter", "ffn_adapter"):
                if getattr(block, attr) is None:
                    setattr(block, attr, AdapterSite(state))
                getattr(block, attr).adapters[name] = Bottleneck(mcfg.dim, cfg.reduction_factor, cfg.adapter_act)
    if "prefix" in methods:
        attns = _self_attentions(model)
        encoders = _ensure_dict(model, "peft_prefix")
        for i, attn in enumerate(attns):
            if attn.prefix is None:
                attn.prefix = PrefixSite(state, encoders, i, attn.n_kv_heads, attn.dh)
        encoders[name] = PrefixEncoder(len(attns), cfg.n_virtual, attns[0].n_kv_heads * attns[0].dh, mcfg.dim,
                                       cfg.prefix_projection)
    if "prompt" in methods:
        prompts = _ensure_dict(model, "peft_prompt")
        stack = model.transformer.input_stack
        if stack.prompt is None:
            stack.prompt = PromptSite(state, prompts)
        prompts[name] = SoftPrompt(cfg.n_virtual, mcfg.embedding_dim)
        _init_prompt(prompts[name], model.transformer.embed.weight, cfg, tokenizer, gen)
    if "embeddings" in methods:
        if state.embeddings is not None:
            raise PeftError(f"adapter {state.embeddings!r} already trains the token embeddings; one adapter may")
        state.embeddings = name
    state.configs[name] = cfg
    if activate:
        state.active = [name]
    if train:
        freeze_for(model, name)
    return trainable_summary(model)


def _init_prompt(prompt: SoftPrompt, embed: torch.Tensor, cfg: PeftConfig, tokenizer, gen) -> None:
    """Lester et al. 2021: initialise from vocabulary embeddings (sampled rows, or the words of a text)."""
    n = prompt.n_virtual
    with torch.no_grad():
        if cfg.prompt_init == "random":
            prompt.embedding.copy_(torch.randn(n, embed.shape[1], generator=gen) * embed.std().item())
            return
        if cfg.prompt_init.startswith("text:"):
            if tokenizer is None:
                raise PeftError("peft.prompt_init=text:... needs the tokenizer")
            ids = tokenizer.encode(cfg.prompt_init[5:]) if hasattr(tokenizer, "encode") else []
            ids = [i for i in (ids.ids if hasattr(ids, "ids") else ids)]
            if not ids:
                raise PeftError(f"peft.prompt_init={cfg.prompt_init!r} encodes to no tokens")
            ids = (ids * (n // len(ids) + 1))[:n]
        else:
            ids = torch.randint(0, embed.shape[0], (n,), generator=gen).tolist()
        prompt.embedding.copy_(embed[torch.tensor(ids, device=embed.device)].float())


def freeze_for(model, name: str) -> None:
    """Only adapter ``name``'s parameters (plus the task head, plus the embeddings it trains) train."""
    state = peft_state(model)
    own = set(adapter_parameters(model, name).values())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in own:
        p.requires_grad_(True)
    if model.config.head in TASK_HEADS and model.head is not None:
        for p in model.head.parameters():
            p.requires_grad_(True)
    if state.embeddings == name:
        model.transformer.embed.weight.requires_grad_(True)
        cfg = state.configs.get(name)
        pos = getattr(model.transformer.input_stack.position, "weight", None)
        if cfg is not None and cfg.embed_positions and isinstance(pos, nn.Parameter):
            pos.requires_grad_(True)


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
    if state.embeddings is not None and state.embeddings in rows and len(rows[state.embeddings]) != len(adapters):
        raise PeftError(f"adapter {state.embeddings!r} trains the token embeddings, which every row shares: it "
                        "cannot run beside other adapters in one batch")
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
    """Fold the LoRA / (IA)3 weights of ``names`` (default: the active adapters) into the base weights."""
    state = peft_state(model)
    for n in _names(model, names):
        other = [m for m in state.configs[n].methods if m not in ("lora", "ia3", "embeddings")]
        if other:
            raise PeftError(f"adapter {n!r} uses {'+'.join(other)}, which adds computation rather than changing "
                            "weights: only LoRA and (IA)3 merge into the base model")
        for m in model.modules():
            if isinstance(m, PeftLinear):
                m.merge(n)


def unmerge(model, names: str | Sequence[str] | None = None) -> None:
    """Subtract merged adapters again (the base weights come back to within float rounding)."""
    names = _names(model, names) if names is not None else adapter_names(model)
    for m in model.modules():
        if isinstance(m, PeftLinear):
            for n in reversed(list(m.merged)):
                if n in names:
                    m.unmerge(n)


def merged_model(model, name: str | None = None):
    """A plain TransformerLM (no PEFT modules) whose weights have adapter ``name`` merged in, with that
    adapter's task head. The original model is left as it was."""
    import copy

    from ..model import TransformerLM

    state = peft_state(model)
    name = name or (state.active[0] if len(state.active) == 1 else None)
    if name is None:
        raise PeftError(f"which adapter? the model has {list(state.configs)}; pass name=")
    work = copy.deepcopy(model)
    merge(work, name)
    own_head = getattr(work, "peft_heads", None) is not None and name in work.peft_heads
    head = work.peft_heads[name] if own_head else work.head
    cfg = model.config.replace(**state.head_configs[name]) if own_head else model.config
    plain = TransformerLM(cfg)
    strip_peft(work)
    state_dict = {k: v for k, v in work.state_dict().items() if not k.startswith("head.")}
    state_dict.update({f"head.{k}": v for k, v in head.state_dict().items()})
    missing, unexpected = plain.load_state_dict(state_dict, strict=False)
    tied = {"head.weight"} if cfg.tie_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PeftError(f"merged model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return plain.eval()


def strip_peft(model) -> None:
    """Remove every PEFT module in place (wrapped layers get their base layer back; nothing is merged)."""
    for name, m in list(model.named_modules()):
        if isinstance(m, PeftLinear):
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, m.base_layer)
    for m in model.modules():
        if isinstance(m, Block):
            m.attn_adapter = m.ffn_adapter = None
        if isinstance(m, Attention):
            m.prefix = None
    for stack in (model.transformer.encoder, model.transformer.decoder):
        if stack is not None:
            stack.prompt = None
    for attr in ("peft_prefix", "peft_prompt", "peft_heads"):
        if getattr(model, attr, None) is not None:
            delattr(model, attr)
    model.peft_state = None
