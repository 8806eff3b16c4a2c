"""Adapter folders: only the PEFT weights (+ the task head), never the base model.

    adapter/
      pretune_adapter.json       methods and sizes, head fields and label map, the base model's path
                                 and config (to refuse a different base), layout
      adapter_model.safetensors  the weights
      adapter_config.json        (LoRA adapters) the ``peft`` library's config: the folder loads with
                                 ``peft.PeftModel.from_pretrained`` and its tensors use peft's names
      tokenizer.json, task.json  when saved by ``pretune finetune``

LoRA adapters of a model that exports to Hugging Face, task head included (BERT, RoBERTa, GPT-2, T5, Llama, Qwen2,
Qwen3, Mistral, Gemma, Gemma 2) are written
in peft's layout: ``base_model.model.<HF module>.lora_A.weight`` (and, with ``bias`` all / lora_only, the
trained biases under their HF names); other adapters use pretune's parameter names with the adapter name left
out, and the base parameters they train (embeddings, BitFit's biases) under their own names, and
pretune_adapter.json says why (``layout_why``: another method, or a head no transformers class has, such as a
classification head on mean pooling, the default on a sentence-transformers checkpoint like MiniLM). A folder written
by ``peft`` itself (no pretune_adapter.json) loads too: LoRA with per-module ranks, rsLoRA, fused GPT-2 c_attn,
heads in modules_to_save, trained biases.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import TASK_HEADS
from ..io.checkpoint import CheckpointError, atomic_folder, read_weights
from ..io.checkpoint import owned as owned_tensor
from ..io.new_tokens import grow_vocab
from . import new_tokens
from .config import PeftConfig
from .core import (
    PeftError,
    adapter_parameters,
    base_parameters,
    base_state,
    is_peft_parameter,
    linear_modules,
    own,
    peft_state,
    strip_name,
    wrap,
)
from .inject import inject, set_active
from .layers import PeftLinear, RoutedHead
from .new_tokens import new_token_indices

META_FILE = "pretune_adapter.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_CONFIG_FILE = "adapter_config.json"
HF_PREFIX = "base_model.model."
_HEAD_FIELDS = ("head", "num_labels", "labels", "pooling", "classifier_dropout", "multi_label")
# what an adapter records of its base and refuses to load into a model that differs (the shapes, and the options of
# bases that have the same shapes: Llama / Mistral / Gemma 2 checkpoints differ only in these); an adapter saved
# before a field existed does not record it and is not checked on it
_BASE_FIELDS = ("arch", "vocab_size", "dim", "n_layers", "n_decoder_layers", "n_heads", "n_kv_heads", "head_dim",
                "decoder_heads", "ffn_dim", "decoder_ffn_dim", "embed_dim", "ffn", "norm", "norm_placement",
                "qkv_bias", "qk_norm", "rope_scaling", "rope_factor", "scale_embeddings", "sliding_window",
                "sliding_layers", "attn_softcap", "logit_softcap")
_TASK_TYPES = {"classification": "SEQ_CLS", "regression": "SEQ_CLS", "tagging": "TOKEN_CLS", "qa": "QUESTION_ANS"}
_HF_HEADS = ("classifier.", "score.", "qa_outputs.")
_LEGACY_NAMES = {".attn_adapter.adapters.": ".attn_drop.adapters.",  # adapters saved before branch wrapping
                 ".ffn_adapter.adapters.": ".ffn_drop.adapters."}


# ---------------------------------------------------------------------------------------------
# our module names <-> Hugging Face module names
# ---------------------------------------------------------------------------------------------
@dataclass
class HfPlace:
    """Where one of our linear layers lives in the Hugging Face model: module, output rows, layout."""

    module: str  # e.g. "transformer.h.0.attn.c_attn"
    start: int  # our rows are HF output rows start..stop (a fused q/k/v matrix holds three layers)
    stop: int
    fan_in_fan_out: bool  # HF stores the weight as (in, out) (GPT-2's Conv1D)


def hf_places(model, modules: list[str]) -> dict[str, HfPlace] | None:
    """HF places of our linear ``modules``, found by running the family's exporter on marker tensors
    (value = module id * 2^20 + row), so fused, transposed and renamed weights are all located exactly.
    None when the model's config has no Hugging Face equivalent."""
    from ..interop import InteropError, _family_for_config

    try:
        fam = _family_for_config(model.config)
    except InteropError:
        return None
    state = base_state(model)
    ids = {f"{m}.weight": i + 1 for i, m in enumerate(modules)}
    markers = {}
    for k, t in state.items():
        if k in ids:
            rows = torch.arange(t.shape[0], dtype=torch.float64)[:, None]
            markers[k] = (ids[k] * 2.0 ** 20 + rows).expand(t.shape)
        else:
            markers[k] = torch.zeros((), dtype=torch.float64).expand(t.shape)
    hf = fam.weights_to_hf(markers, model.config)
    places: dict[str, HfPlace] = {}
    for hf_name, t in hf.items():
        if not hf_name.endswith(".weight") or t.dim() != 2 or float(t.max()) < 2 ** 20:
            continue
        transposed = bool((t[0] != t[0, 0]).any()) and bool((t[:, 0] == t[0, 0]).all()) and t.shape[1] > 1
        rows = (t[0] if transposed else t[:, 0]).long()  # the HF output axis
        ident = rows >> 20
        for i in ident.unique().tolist():
            if i == 0:  # rows of a layer not asked about
                continue
            idx = (ident == i).nonzero().flatten()
            start, stop = int(idx[0]), int(idx[-1]) + 1
            name = modules[i - 1]
            if stop - start != len(idx) or not torch.equal(rows[start:stop] & (2 ** 20 - 1),
                                                           torch.arange(stop - start)):
                raise PeftError(f"{name}: its rows are permuted in the Hugging Face layout; cannot convert LoRA")
            places[name] = HfPlace(hf_name[: -len(".weight")], start, stop, transposed)
    return places


# ---------------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------------
def _head_of(model, name: str):
    """(head module, head fields) saved with adapter ``name``: its own loaded head, else the model's task head."""
    state = peft_state(model)
    head = model.head
    if isinstance(head, RoutedHead):
        if name in head.adapter_heads:
            return head.adapter_heads[name], state.head_configs[name]
        head = head.base
    if model.config.head in TASK_HEADS and head is not None:
        return head, {k: getattr(model.config, k) for k in _HEAD_FIELDS}
    return None, None


def _lora_layers(model, name: str) -> dict[str, PeftLinear]:
    return {n: m for n, m in linear_modules(model).items() if isinstance(m, PeftLinear) and name in m.lora_A}


def save_adapter(model, path: str | os.PathLike, name: str | None = None, *, base: str = "", tokenizer=None,
                 extra_files: dict[str, str] | None = None) -> Path:
    """Write adapter ``name`` (default: the only / active one) and its task head to ``path`` atomically.

    ``base`` records where the base model lives (a pretune checkpoint or HF folder) for ``load_peft_model``;
    ``tokenizer`` (a tokenizers.Tokenizer) is saved beside it; ``extra_files`` maps file names to text.
    """
    state = peft_state(model)
    if name is None:
        if len(state.configs) != 1 and len(state.active) != 1:
            raise PeftError(f"which adapter? the model has {list(state.configs) or 'none'}; pass name=")
        name = state.active[0] if len(state.active) == 1 else next(iter(state.configs))
    if name not in state.configs:
        raise PeftError(f"no adapter named {name!r}; the model has {list(state.configs) or 'none'}")
    cfg: PeftConfig = state.configs[name]
    head, head_fields = _head_of(model, name)
    head_tensors = {f"head.{k}": v.detach() for k, v in head.state_dict().items()} if head is not None else {}
    if model.config.tie_embeddings:
        head_tensors.pop("head.weight", None)
    lora = _lora_layers(model, name)
    places = hf_places(model, list(lora)) if cfg.methods == ["lora"] else None
    owned = {k: base_parameters(model)[k].detach() for k in state.owned(name)}  # base tensors it trains
    meta = {"format": "pretune-adapter", "version": 1, "name": name, "peft": cfg.to_dict(),
            "head": head_fields, "base": {"model": str(base), **{k: getattr(model.config, k) for k in _BASE_FIELDS}},
            "lora_scaling": {n: m.lora_scaling[name] for n, m in lora.items()},
            "layout": "peft" if places is not None else "pretune"}
    if new_token_indices(model, name):  # task.add_tokens under PEFT: the rows it holds (the base grows to fit)
        meta["new_tokens"] = new_token_indices(model, name)
    if places is None:
        meta["layout_why"] = _why_not_peft(model.config, cfg)
    if places is not None:
        tensors, peft_cfg = _to_peft(model, name, lora, places, head_tensors, head_fields, owned)
        rows, indices = new_tokens.peft_tensors(model, name, HF_PREFIX)
        if rows:  # peft's TrainableTokens beside LoRA
            tensors.update(rows)
            peft_cfg["trainable_token_indices"] = indices
    else:
        tensors = {strip_name(k, name): p.detach() for k, p in adapter_parameters(model, name).items()}
        tensors.update(head_tensors)
        tensors.update(owned)
        peft_cfg = None
    path = Path(path)
    with atomic_folder(path) as tmp:
        save_file({k: owned_tensor(v) for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE),
                  metadata={"format": "pt"})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if peft_cfg is not None:
            (tmp / PEFT_CONFIG_FILE).write_text(json.dumps(peft_cfg, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
    return path


def _why_not_peft(cfg, peft_cfg: PeftConfig) -> str:
    """Why an adapter of ``peft_cfg`` on a model of ``cfg`` is written in pretune's layout rather than peft's: peft's
    files name the modules of a transformers model, so only a LoRA adapter on a model (head included) that exports
    to transformers has them."""
    from ..interop import InteropError, _family_for_config

    if peft_cfg.methods != ["lora"]:
        return f"pretune writes peft's layout for LoRA alone, not for {peft_cfg.method}"
    try:
        fam = _family_for_config(cfg.replace(head="none", multi_label=False))  # the body alone: its HF family
    except InteropError:
        return "the model has no Hugging Face equivalent, whose module names peft's files use"
    why = fam.export_mismatch(cfg)  # the head (e.g. mean pooling, which no transformers class has)
    return f"the model with its head has no transformers class: {why}" if why else "no Hugging Face places"


def _to_peft(model, name, lora: dict[str, PeftLinear], places: dict[str, HfPlace], head_tensors, head_fields,
             owned: dict[str, torch.Tensor]):
    """peft's tensors and adapter_config.json for a LoRA adapter. Layers fused in HF (GPT-2 c_attn) with
    different A matrices become one LoRA of rank sum(r_i) with a block-diagonal B (exact). Trained biases
    (``bias`` all / lora_only) go under their HF names (``<module>.base_layer.bias`` for a LoRA module, as peft
    writes them)."""
    from ..interop import _family_for_config

    by_module: dict[str, list[str]] = {}
    for ours, place in places.items():
        by_module.setdefault(place.module, []).append(ours)
    tensors: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, float]] = {}  # hf module -> (rank, alpha)
    fan_in_fan_out = False
    rslora = peft_state(model).configs[name].rslora  # alpha / sqrt(r): written as peft's use_rslora
    dora = peft_state(model).configs[name].dora  # + lora_magnitude_vector per module: peft's use_dora
    for module, ours in by_module.items():
        ours.sort(key=lambda n: places[n].start)
        out_rows = max(places[n].stop for n in ours) if len(ours) > 1 else None
        layers = [lora[n] for n in ours]
        As = [m.lora_A[name].weight.detach() for m in layers]
        scales = [m.lora_scaling[name] for m in layers]
        fan_in_fan_out |= places[ours[0]].fan_in_fan_out
        if len(ours) == 1 and places[ours[0]].start == 0:
            A, B = As[0], layers[0].lora_B[name].weight.detach()
            r = A.shape[0]
            shapes[module] = (r, scales[0] * (math.sqrt(r) if rslora else r))
        else:  # a fused HF matrix: stack the ranks, B block-diagonal in HF row order, scaling folded in
            total_out = _hf_out_rows(model, module, out_rows)
            A = torch.cat(As)
            r = A.shape[0]
            B = A.new_zeros(total_out, r)
            col = 0
            for n, m, s in zip(ours, layers, scales):
                rr = m.lora_A[name].weight.shape[0]
                B[places[n].start:places[n].stop, col:col + rr] = m.lora_B[name].weight.detach() * s
                col += rr
            shapes[module] = (r, math.sqrt(r) if rslora else float(r))  # scaling 1
        tensors[f"{HF_PREFIX}{module}.lora_A.weight"] = A
        tensors[f"{HF_PREFIX}{module}.lora_B.weight"] = B
        if dora:  # DoRA's magnitude is per output row: a fused HF matrix gets its layers' rows in order
            if any(name not in m.lora_magnitude for m in layers):
                raise PeftError(f"{module}: some of its layers use DoRA and some do not; peft cannot express that")
            tensors[f"{HF_PREFIX}{module}.lora_magnitude_vector"] = torch.cat(
                [m.lora_magnitude[name].detach() for m in layers])
    modules_to_save = []
    if head_tensors:
        head_cfg = model.config.replace(**head_fields)
        fam = _family_for_config(head_cfg)
        body = {k: torch.zeros(()).expand(v.shape) for k, v in base_state(model).items() if not k.startswith("head.")}
        hf_head = fam.weights_to_hf({**body, **head_tensors}, head_cfg)
        for k, v in hf_head.items():
            if k.startswith(_HF_HEADS):
                tensors[f"{HF_PREFIX}{k}"] = v
                modules_to_save.append(k.split(".")[0])
    for hf_name, t in _hf_biases(model, owned).items():
        module = hf_name[: -len(".bias")]
        tensors[f"{HF_PREFIX}{module}{'.base_layer' if module in by_module else ''}.bias"] = t
    (r, alpha), _ = Counter(shapes.values()).most_common(1)[0]
    cfg = peft_state(model).configs[name]
    peft_cfg = {
        "peft_type": "LORA", "task_type": _task_type(model.config), "r": int(r), "lora_alpha": float(alpha),
        "lora_dropout": cfg.dropout, "target_modules": sorted(by_module), "bias": cfg.bias,
        "fan_in_fan_out": fan_in_fan_out, "modules_to_save": sorted(set(modules_to_save)) or None,
        "rank_pattern": {m: s[0] for m, s in shapes.items() if s[0] != r},
        "alpha_pattern": {m: s[1] for m, s in shapes.items() if s[1] != alpha},
        "use_rslora": rslora, "use_dora": dora, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": None, "revision": None, "layers_to_transform": None, "layers_pattern": None,
    }
    return tensors, peft_cfg


def _hf_biases(model, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF bias tensors that hold the base biases in ``owned`` (their current values; a fused HF bias such as
    GPT-2's c_attn.bias whole), found by exporting markers as hf_places does."""
    from ..interop import _family_for_config

    if not owned:
        return {}
    fam = _family_for_config(model.config)
    state = base_state(model)
    marks = {k: (torch.ones if k in owned else torch.zeros)((), dtype=torch.float64).expand(v.shape)
             for k, v in state.items()}
    marked = fam.weights_to_hf(marks, model.config)
    values = fam.weights_to_hf(state, model.config)
    return {k: values[k] for k, t in marked.items() if k.endswith(".bias") and float(t.max()) > 0}


def _hf_out_rows(model, module: str, fallback: int) -> int:
    """Output rows of an HF module (a fused matrix may hold layers the adapter does not target)."""
    places = hf_places(model, list(linear_modules(model)))
    stops = [p.stop for p in places.values() if p.module == module]
    return max(stops) if stops else fallback


def _task_type(cfg) -> str | None:
    """peft's ``task_type`` of the model an adapter belongs to."""
    from ..model.layout import layout_of

    if cfg.head in _TASK_TYPES:
        return _TASK_TYPES[cfg.head]
    if cfg.head == "lm":
        return "SEQ_2_SEQ_LM" if layout_of(cfg).encoder_decoder else "CAUSAL_LM"
    return None


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def read_meta(path: str | os.PathLike) -> dict | None:
    p = Path(path) / META_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PeftError(f"{p}: not valid JSON ({e})") from None


def is_adapter_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / WEIGHTS_FILE).is_file() and ((p / META_FILE).is_file() or (p / PEFT_CONFIG_FILE).is_file())


def _check_base(model, meta: dict, path: Path) -> None:
    saved = meta.get("base") or {}
    for k in _BASE_FIELDS:
        if k in saved and saved[k] != getattr(model.config, k):
            raise PeftError(f"{path}: the adapter was saved for a different base model: its {k} is {saved[k]!r}, "
                            f"this model's is {getattr(model.config, k)!r}"
                            + (f" (saved for {saved['model']})" if saved.get("model") else ""))


def load_adapter(model, path: str | os.PathLike, name: str | None = None, *, activate: bool = True) -> str:
    """Load an adapter folder (pretune or peft) into ``model`` under ``name``; returns the name used."""
    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise PeftError(f"{path}: no {WEIGHTS_FILE} (not an adapter folder)")
    meta = read_meta(path)
    tensors = read_weights(path / WEIGHTS_FILE)
    state = peft_state(model)
    name = name or (meta or {}).get("name") or "default"
    if name in state.configs:
        raise PeftError(f"the model already has an adapter named {name!r}; pass name=")
    if meta is not None:
        if meta.get("new_tokens") and (meta.get("base") or {}).get("vocab_size", 0) > model.config.vocab_size:
            grow_vocab(model, meta["base"]["vocab_size"])  # the adapter's new tokens: rows it then fills
        _check_base(model, meta, path)
    if meta is None or meta.get("layout") == "peft":
        head_fields = (meta or {}).get("head")
        _load_peft_lora(model, path, tensors, name, head_fields, meta)
    else:
        _load_pretune(model, path, tensors, name, meta)
    if activate:
        set_active(model, [name])
    return name


def _put_head(model, name: str, head_tensors: dict[str, torch.Tensor], head_fields: dict | None, path: Path):
    """The adapter's own task head, kept beside the model's (heads are routed per example too)."""
    from ..model.heads import HEADS

    if not head_tensors:
        return
    state = peft_state(model)
    if head_fields and head_fields.get("head") in TASK_HEADS:
        cfg = model.config.replace(**{k: head_fields[k] for k in _HEAD_FIELDS if k in head_fields})
        head = HEADS[cfg.head](cfg, model.transformer.embed)
    elif model.config.head in TASK_HEADS:
        head = copy.deepcopy(model.head)
        head_fields = {k: getattr(model.config, k) for k in _HEAD_FIELDS}
    else:
        raise PeftError(f"{path}: the adapter has a task head ({', '.join(sorted(head_tensors))}) but the model "
                        "has none and the adapter does not say which")
    expected = head.state_dict()
    head_tensors = {k.removeprefix("head."): t for k, t in head_tensors.items()}
    for k, t in head_tensors.items():
        if k not in expected:
            raise PeftError(f"{path}: head tensor {k!r} does not belong to a {head_fields.get('head')} head")
        if tuple(t.shape) != tuple(expected[k].shape):
            raise PeftError(f"{path}: head tensor {k!r} has shape {tuple(t.shape)}, the head expects "
                            f"{tuple(expected[k].shape)} (an adapter for a different label set or base model)")
    head.load_state_dict({**expected, **head_tensors})
    head.to(next(model.parameters()).device)
    if not isinstance(model.head, RoutedHead):
        model.head = RoutedHead(model.head, state)
    model.head.adapter_heads[name] = head.train(model.training)
    state.head_configs[name] = {k: head_fields.get(k) for k in _HEAD_FIELDS}


def _load_pretune(model, path: Path, tensors, name: str, meta: dict) -> None:
    cfg = PeftConfig.from_dict(meta["peft"], source=str(path / META_FILE))
    build = copy.copy(cfg)
    build.prompt_init = "random"  # the file holds the trained prompt; no tokenizer needed to build it
    inject(model, build, name, train=False, activate=False)
    peft_state(model).configs[name] = cfg
    if meta.get("new_tokens"):
        new_tokens.train_new_tokens(model, name, meta["new_tokens"], train=False)
    own_params = {strip_name(k, name): p for k, p in adapter_parameters(model, name).items()}
    for old, new in _LEGACY_NAMES.items():
        tensors = {k.replace(old, new): t for k, t in tensors.items()}
    head_tensors = {k: v for k, v in tensors.items() if k.startswith("head.")}
    scaling = meta.get("lora_scaling") or {}
    base = base_parameters(model)
    trained_base = [k for k in tensors if not k.startswith("head.") and not is_peft_parameter(k)]
    own(model, name, [k for k in trained_base if k in base])
    with torch.no_grad():
        for k, t in tensors.items():
            if k.startswith("head."):
                continue
            if k in trained_base:  # a base parameter the adapter trained (embeddings, biases)
                target = base.get(k)
                if target is None:
                    raise PeftError(f"{path}: tensor {k!r} is not a parameter of this model")
                if target.shape != t.shape:
                    raise PeftError(f"{path}: tensor {k!r} has shape {tuple(t.shape)}, the model's is "
                                    f"{tuple(target.shape)}: the adapter was saved for a different base model")
                target.copy_(t)
                continue
            if k not in own_params:
                raise PeftError(f"{path}: tensor {k!r} has no place in this model (a different base or method)")
            if own_params[k].shape != t.shape:
                m = re.match(r"(.+)\.lora_[AB]\.weight$", k)
                if m and m.group(1) in scaling:  # a LoRA of another rank (e.g. imported with a rank_pattern)
                    _relora(model, m.group(1), name, tensors, scaling[m.group(1)], cfg.dropout)
                    own_params = {strip_name(kk, name): p for kk, p in adapter_parameters(model, name).items()}
                if own_params[k].shape != t.shape:
                    raise PeftError(f"{path}: tensor {k!r} has shape {tuple(t.shape)}, the model expects "
                                    f"{tuple(own_params[k].shape)}: the adapter was saved for a different base "
                                    "model")
            own_params[k].copy_(t)
        for module, s in scaling.items():
            layer = model.get_submodule(module)
            if isinstance(layer, PeftLinear) and name in layer.lora_scaling:
                layer.lora_scaling[name] = float(s)
    _put_head(model, name, head_tensors, meta.get("head"), path)


def _relora(model, module: str, name: str, tensors, scaling: float, p: float) -> None:
    layer = model.get_submodule(module)
    r = tensors[f"{module}.lora_A.weight"].shape[0]
    dora = name in layer.lora_magnitude
    layer.remove(name)
    layer.add_lora(name, r, scaling * r, p)
    if dora:
        layer.add_dora(name)  # its magnitude is read from the file next


def _pattern_value(patterns: dict, module: str, default):
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return value
    return default


def _load_peft_lora(model, path: Path, tensors, name: str, head_fields: dict | None, meta: dict | None) -> None:
    cfg_file = path / PEFT_CONFIG_FILE
    if not cfg_file.is_file():
        raise PeftError(f"{path}: no {PEFT_CONFIG_FILE}")
    pc = json.loads(cfg_file.read_text())
    kind = pc.get("peft_type")
    if kind != "LORA":
        raise PeftError(f"{cfg_file}: peft_type {kind!r} is not supported; pretune reads peft LoRA adapters "
                        "(other methods are saved in pretune's own layout)")
    for flag, why in (("lora_bias", "LoRA biases"),):
        if pc.get(flag):
            raise PeftError(f"{cfg_file}: {why} ({flag}=true) is not supported")
    bias = pc.get("bias") or "none"
    if bias not in ("none", "all", "lora_only"):
        raise PeftError(f"{cfg_file}: bias={bias!r} is not one of none, all, lora_only")
    token_rows = {k: tensors.pop(k) for k in list(tensors) if new_tokens.PEFT_SUFFIX in k}
    if token_rows or pc.get("trainable_token_indices"):
        new_tokens.load_peft_tensors(model, name, token_rows, pc.get("trainable_token_indices") or [], path)
    stripped = {}

    def copy_rank(key: str) -> int:  # a module's trained copy (modules_to_save) beats its other copies
        return 2 if ".modules_to_save." in key else 0 if ".original_module." in key else 1

    for k, t in sorted(tensors.items(), key=lambda kv: copy_rank(kv[0])):
        k = k[len(HF_PREFIX):] if k.startswith(HF_PREFIX) else k
        k = re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", k)  # older files keep the adapter name
        k = re.sub(r"\.lora_magnitude_vector(\.[^.]+)?(\.weight)?$", ".lora_magnitude_vector", k)  # DoRA
        k = re.sub(r"\.modules_to_save(\.[^.]+)?\.(weight|bias)$", r".\2", k)  # (with or without the adapter name)
        k = k.replace(".original_module.", ".").replace(".base_layer.", ".")
        stripped[k] = t
    lora_modules = sorted({k.rsplit(".", 2)[0] for k in stripped if re.search(r"\.lora_[AB]\.weight$", k)})
    lora_key = r"\.(lora_[AB]\.weight|lora_magnitude_vector)$"
    rest = {k: t for k, t in stripped.items() if not re.search(lora_key, k)}
    dora = bool(pc.get("use_dora"))
    head_hf = {k: t for k, t in rest.items() if k.startswith(_HF_HEADS) or not k.endswith(".bias")}
    bias_hf = {k: t for k, t in rest.items() if k not in head_hf}
    mods = list(linear_modules(model))
    places = hf_places(model, mods)
    if places is None:
        raise PeftError(f"{path}: a peft LoRA adapter needs a model with a Hugging Face layout; this config has none")
    by_hf: dict[str, list[str]] = {}
    for ours, place in places.items():
        by_hf.setdefault(place.module, []).append(ours)
    r0, alpha0 = int(pc.get("r", 8)), float(pc.get("lora_alpha", 8))
    rslora = bool(pc.get("use_rslora"))
    dropout = float(pc.get("lora_dropout") or 0.0)
    layers_seen = []
    for module in lora_modules:
        ours = by_hf.get(module) or _suffix_match(module, by_hf)
        if not ours:
            raise PeftError(f"{path}: LoRA module {module!r} matches no layer of this model (HF modules like "
                            f"{next(iter(by_hf))!r}): an adapter for a different architecture")
        A, B = stripped[f"{module}.lora_A.weight"], stripped[f"{module}.lora_B.weight"]
        r = A.shape[0]
        alpha = float(_pattern_value(pc.get("alpha_pattern"), module, alpha0))
        rank = int(_pattern_value(pc.get("rank_pattern"), module, r0))
        if rank != r:
            raise PeftError(f"{path}: {module}.lora_A has rank {r}, adapter_config.json says {rank}")
        scale = alpha / (r ** 0.5 if rslora else r)
        for n in ours:
            layer = wrap(model, n)
            place = places[n]
            if A.shape[1] != layer.in_features or B.shape[0] < place.stop:
                raise PeftError(f"{path}: {module} LoRA shapes A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                                f"{n} ({layer.in_features} -> {layer.out_features}): an adapter for a different "
                                "base model")
            layer.add_lora(name, r, scale * r, dropout)
            with torch.no_grad():
                layer.lora_A[name].weight.copy_(A)
                layer.lora_B[name].weight.copy_(B[place.start:place.stop])
                if dora:
                    magnitude = stripped.get(f"{module}.lora_magnitude_vector")
                    if magnitude is None or magnitude.shape[0] < place.stop:
                        raise PeftError(f"{path}: use_dora is set but {module} has no lora_magnitude_vector of "
                                        f"{place.stop} rows")
                    layer.add_dora(name)
                    layer.lora_magnitude[name].copy_(magnitude[place.start:place.stop])
            layers_seen.append(n)
    state = peft_state(model)
    state.configs[name] = PeftConfig(method="lora", targets=layers_seen, r=r0, alpha=alpha0, dropout=dropout,
                                     bias=bias, rslora=rslora, dora=dora)
    if bias_hf:
        _load_hf_biases(model, name, bias_hf, path)
    if head_hf:
        from ..interop import _family_for_config

        head_cfg = model.config.replace(**{k: v for k, v in (head_fields or {}).items() if k in _HEAD_FIELDS}) \
            if head_fields else model.config
        fam = _family_for_config(head_cfg)
        try:
            ours_head = fam.weights_from_hf(head_hf, head_cfg)
        except Exception as e:  # noqa: BLE001 - name the file with the converter's reason
            raise PeftError(f"{path}: cannot map the saved head tensors {sorted(head_hf)}: {e}") from None
        _put_head(model, name, ours_head, head_fields, path)


def _load_hf_biases(model, name: str, bias_hf: dict[str, torch.Tensor], path: Path) -> None:
    """Trained biases of a peft LoRA adapter (``bias`` all / lora_only), under their HF names: the base model
    exported to HF with these biases put in and imported back gives our biases (fused ones, such as GPT-2's
    c_attn.bias, split as the family's importer splits them)."""
    from ..interop import _family_for_config

    fam = _family_for_config(model.config)
    state = base_state(model)
    hf = fam.weights_to_hf(state, model.config)
    for k, t in bias_hf.items():  # the same name, or one with the task model's prefix more or less (bert., ...)
        hits = [h for h in hf if h == k or h.endswith("." + k) or k.endswith("." + h)]
        if len(hits) != 1:
            raise PeftError(f"{path}: bias {k!r} matches {'no' if not hits else 'more than one'} tensor of this model "
                            f"(HF names like {next(iter(hf))!r})")
        key = hits[0]
        if tuple(hf[key].shape) != tuple(t.shape):
            raise PeftError(f"{path}: bias {k!r} has shape {tuple(t.shape)}, the model's is {tuple(hf[key].shape)}")
        hf[key] = t
    ours = fam.weights_from_hf(hf, model.config)
    params = base_parameters(model)
    changed = [k for k, v in ours.items() if k in params and k.endswith(".bias") and not torch.equal(v, state[k])]
    own(model, name, changed)
    with torch.no_grad():
        for k in changed:
            params[k].copy_(ours[k])


def _suffix_match(module: str, by_hf: dict[str, list[str]]) -> list[str]:
    """peft adapters made on a bare body (e.g. GPT2Model) name modules without the task model's prefix."""
    hits = [k for k in by_hf if k.endswith("." + module) or module.endswith("." + k)]
    return by_hf[hits[0]] if len(hits) == 1 else []


def adapter_size(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file() and f.name in (WEIGHTS_FILE,))


__all__ = ["save_adapter", "load_adapter", "hf_places", "is_adapter_folder", "read_meta", "CheckpointError"]
