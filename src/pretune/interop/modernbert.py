"""ModernBERT (ModernBertModel / ModernBertForMaskedLM, ModernBertForSequenceClassification /
TokenClassification / QuestionAnswering; Warner et al. 2024).

Quirks: pre-norm, but layer 0 has no norm on its attention input (``first_attn_norm=False``: the embedding norm
serves); queries, keys and values are one fused ``Wqkv`` (split in thirds) and the GLU's two input projections one
``Wi`` whose first half is activated (``input``: our gate_proj) and second half multiplies (``gate``: our up_proj);
no biases by default (``attention_bias`` = ``mlp_bias``: our ``bias``; ``norm_bias``; ``classifier_bias``: our
``head_dense_bias``). The layers ``layer_types`` names "sliding_attention" (older configs: every layer but each
``global_attn_every_n_layers``-th from layer 0) see the keys at most ``local_attention // 2`` away (our
``sliding_window = local_attention // 2 + 1``) and rotate with their own RoPE base (``rope_parameters`` per layer
type, older configs ``global_rope_theta`` / ``local_rope_theta``: our ``rope_base`` / ``rope_local_base``). The MLM
head is dense + act + norm, then the tied decoder with its bias; every task class puts the same prediction head
(``head_transform``) before its classifier, on the first token or on the mean of the real ones (``classifier_pooling``:
our ``pooling``). Dropout sits elsewhere than ours (embeddings, attention output, inside the MLP): imports take
``mlp_dropout`` as ``dropout`` (training only; outputs are equal). transformers may unpad or use SDPA / flash
attention; the parity tests compare with its eager attention too.
"""

from __future__ import annotations

import re

import torch

from ..config import TASK_HEADS, ModelConfig
from . import (
    HF_ACTS,
    PLAIN_OPTIONS,
    InteropError,
    mismatch,
    rename,
    strip_prefix,
    task_arch,
    task_config_to_hf,
    task_fields,
    task_mismatch,
)
from .llama import layer_types, window_fields

MODEL_TYPES = ("modernbert",)

ACTS = HF_ACTS
_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu", "swish": "silu"}
_GATED = {"gelu": "geglu", "gelu_tanh": "geglu_tanh", "relu": "reglu", "swish": "swiglu"}  # hidden_activation -> ffn
_FFN_ACT = {ffn: act for act, ffn in _GATED.items()}

_BODY = [
    ("embeddings.tok_embeddings.weight", "transformer.embed.weight"),
    ("embeddings.norm", "transformer.encoder.embed_norm"),
    ("layers.{}.attn_norm", "transformer.encoder.layers.{}.attn_norm"),  # none on layer 0
    ("layers.{}.attn.Wqkv.q", "transformer.encoder.layers.{}.attn.q_proj"),  # split from Wqkv
    ("layers.{}.attn.Wqkv.k", "transformer.encoder.layers.{}.attn.k_proj"),
    ("layers.{}.attn.Wqkv.v", "transformer.encoder.layers.{}.attn.v_proj"),
    ("layers.{}.attn.Wo", "transformer.encoder.layers.{}.attn.o_proj"),
    ("layers.{}.mlp_norm", "transformer.encoder.layers.{}.ffn_norm"),
    ("layers.{}.mlp.Wi.input", "transformer.encoder.layers.{}.ffn.gate_proj"),  # split from Wi: act(input) * gate
    ("layers.{}.mlp.Wi.gate", "transformer.encoder.layers.{}.ffn.up_proj"),
    ("layers.{}.mlp.Wo", "transformer.encoder.layers.{}.ffn.down_proj"),
    ("final_norm", "transformer.encoder.norm"),
]
_MLM = [("head.dense", "head.dense"), ("head.norm", "head.norm"), ("decoder.bias", "head.bias"),
        ("decoder.weight", "head.weight")]  # decoder.weight: only when untied
_TASK = [("head.dense", "head.transform.dense"), ("head.norm", "head.transform.norm"), ("classifier", "head.out")]
_TASK_ARCHS = {"classification": "ModernBertForSequenceClassification",
               "regression": "ModernBertForSequenceClassification",
               "tagging": "ModernBertForTokenClassification", "qa": "ModernBertForQuestionAnswering"}
_TOP = ("head.", "decoder.", "classifier.")  # the task / MLM classes' own tensors (the body is under model.)
_FUSED = {"Wqkv": ("q", "k", "v"), "Wi": ("input", "gate")}
_PIECE = re.compile(r"^(.*\.(?:attn\.Wqkv|mlp\.Wi))\.(q|k|v|input|gate)\.(weight|bias)$")
# the model-core options a ModernBERT sets itself (the others must be off)
_OWN = ("sliding_window", "sliding_layers", "rope_local_base", "first_attn_norm", "head_transform", "head_dense_bias")
_THETAS = (("full_attention", "global_rope_theta", 160000.0), ("sliding_attention", "local_rope_theta", 10000.0))


def _split(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wqkv (3 dim, dim) -> Wqkv.q/.k/.v (dim, dim); Wi (2 ffn_dim, dim) -> Wi.input/.gate (ffn_dim, dim)."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"^(.*\.(?:attn\.Wqkv|mlp\.Wi))\.(weight|bias)$", name)
        if m is None:
            out[name] = t
            continue
        parts = _FUSED[m[1].rsplit(".", 1)[1]]
        for part, piece in zip(parts, t.chunk(len(parts), dim=0)):
            out[f"{m[1]}.{part}.{m[2]}"] = piece
    return out


def _merge(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``_split``: the pieces concatenated in transformers' order."""
    out, pieces = {}, {}
    for name, t in tensors.items():
        m = _PIECE.match(name)
        if m is None:
            out[name] = t
        else:
            pieces.setdefault((m[1], m[3]), {})[m[2]] = t
    for (stem, kind), parts in pieces.items():
        out[f"{stem}.{kind}"] = torch.cat([parts[p] for p in _FUSED[stem.rsplit(".", 1)[1]]])
    return out


def _head_table(cfg: ModelConfig) -> list[tuple[str, str]]:
    return _MLM if cfg.head == "mlm" else _TASK if cfg.head in TASK_HEADS else []


def _act(hf: dict, key: str) -> str:
    act = hf.get(key, "gelu")
    if act not in ACTS:
        raise InteropError(f"{key}={act!r} is not supported; expected one of {sorted(ACTS)}")
    return ACTS[act]


def _local_layers(hf: dict, n: int) -> list[int]:
    """The sliding-window layers: ``layer_types``, else all but every ``global_attn_every_n_layers``-th (from 0)."""
    every = hf.get("global_attn_every_n_layers", 3)
    types = hf.get("layer_types")
    if types is None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InteropError(f"global_attn_every_n_layers must be an integer >= 1, got {every!r}")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    if (not isinstance(types, list) or len(types) != n
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise InteropError(f"layer_types must name sliding_attention or full_attention for each of the {n} layers, "
                           f"got {types!r}")
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _thetas(hf: dict) -> tuple[float, float]:
    """(global, local) RoPE bases: transformers 5's ``rope_parameters`` per layer type, else the older
    ``global_rope_theta`` / ``local_rope_theta`` (a null local theta: the global one, as transformers 4 reads it)."""
    if hf.get("rope_scaling"):
        raise InteropError(f"rope_scaling={hf['rope_scaling']!r} is not supported (default RoPE only)")
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise InteropError(f"rope_parameters must be a mapping per layer type, got {params!r}")
    found = []
    for layer_type, old_key, default in _THETAS:
        p = params.get(layer_type) or {}
        if p.get("rope_type", "default") != "default":
            raise InteropError(f"rope_parameters[{layer_type!r}] has rope_type={p['rope_type']!r}; only default RoPE "
                               "is supported")
        theta = p.get("rope_theta", hf.get(old_key, default))
        found.append(theta)
    global_theta = float(found[0] if found[0] is not None else _THETAS[0][2])
    return global_theta, float(found[1]) if found[1] is not None else global_theta


def config_from_hf(hf: dict, keys: set[str]) -> ModelConfig:
    arch = task_arch(hf, sorted(set(_TASK_ARCHS.values())))
    if arch is None and any(k.startswith("classifier.") for k in keys):
        raise InteropError("classifier.* tensors but config.json's architectures names no ModernBERT task class "
                           f"({', '.join(sorted(set(_TASK_ARCHS.values())))})")
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise InteropError(f"attention_bias={hf.get('attention_bias')!r} with mlp_bias={hf.get('mlp_bias')!r} is not "
                           "supported (pretune's bias covers both)")
    if not hf.get("decoder_bias", True):
        raise InteropError("decoder_bias=False is not supported (the MLM decoder has a bias)")
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise InteropError(f"classifier_pooling={pooling!r} is not supported; expected 'cls' or 'mean'")
    n = hf.get("num_hidden_layers", 22)  # missing sizes: transformers' defaults (ModernBERT-base)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InteropError(f"num_hidden_layers must be an integer >= 1, got {n!r}")
    local = _local_layers(hf, n)
    window = hf.get("local_attention", 128)
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise InteropError(f"local_attention must be an integer >= 0, got {window!r}")
    global_theta, local_theta = _thetas(hf)
    dropout = float(hf.get("mlp_dropout", 0.0))
    if arch:
        task = task_fields(hf, arch)
        task["pooling"] = pooling
        if task["classifier_dropout"] == dropout:
            task["classifier_dropout"] = None  # ours defaults to dropout
    else:
        has_head = any(k.startswith(("head.", "decoder.")) for k in keys)
        task = {"head": "mlm" if has_head else "none", "pooling": "mean" if pooling == "mean" else None}
    return ModelConfig(
        arch="encoder", vocab_size=hf.get("vocab_size", 50368), dim=hf.get("hidden_size", 768), n_layers=n,
        n_heads=hf.get("num_attention_heads", 12), ffn_dim=hf.get("intermediate_size", 1152),
        max_seq_len=hf.get("max_position_embeddings", 8192), ffn=_GATED[_act(hf, "hidden_activation")],
        norm="layernorm", norm_eps=hf.get("norm_eps", 1e-5), norm_placement="pre", bias=bias,
        norm_bias=bool(hf.get("norm_bias", False)), embed_norm=True, first_attn_norm=False, dropout=dropout,
        attn_dropout=float(hf.get("attention_dropout", 0.0)), position="rope", rope_base=global_theta,
        rope_local_base=local_theta if local and local_theta != global_theta else None,
        **window_fields(window // 2 + 1, local, n), token_types=0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), head_act=_act(hf, "classifier_activation"),
        head_dense_bias=bool(hf.get("classifier_bias", False)), head_transform=True,
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else 0, **task,
    )


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tensors = _split(strip_prefix(tensors, "model."))
    ignore = [r"^decoder\.weight$"] if cfg.tie_embeddings else []  # the tied copy of the embeddings
    return rename(tensors, _BODY + _head_table(cfg), ignore=ignore)


def weights_to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = _merge(rename(ours, _BODY + _head_table(cfg), reverse=True))
    if cfg.head == "none":  # ModernBertModel: no model. prefix
        return hf
    return {(k if k.startswith(_TOP) else f"model.{k}"): v for k, v in hf.items()}


def _seq_pooling(cfg: ModelConfig) -> str:
    """transformers' classifier_pooling for this config's sentence vector (cls for one ModernBERT cannot make)."""
    return cfg.sentence_pooling if cfg.sentence_pooling in ("cls", "mean") else "cls"


def export_mismatch(cfg: ModelConfig) -> str | None:
    fixed = {k: v for k, v in PLAIN_OPTIONS.items() if k not in _OWN}
    why = mismatch(cfg, arch="encoder", norm="layernorm", norm_placement="pre", embed_norm=True, first_attn_norm=False,
                   head_transform=True, position="rope", rope_scaling="none", token_types=0, embed_dim=None,
                   share_layers=False, attn_scale=None, tied_logit_scale=False, pooler=False, **fixed)
    if why:
        return why
    if cfg.ffn not in _FFN_ACT:
        return f"needs a gated FFN (geglu, geglu_tanh, reglu, swiglu), got ffn={cfg.ffn!r}"
    if cfg.kv_heads != cfg.n_heads or cfg.dh * cfg.n_heads != cfg.dim:
        return "needs plain multi-head attention (no GQA, head_dim = dim / n_heads)"
    if cfg.head in TASK_HEADS:
        return task_mismatch(cfg, _TASK_ARCHS, _seq_pooling(cfg))
    if cfg.head not in ("mlm", "none"):
        return f"needs head 'mlm', 'none' or a task head, got head={cfg.head!r}"
    return None


def _every_n(types: list[str]) -> int | None:
    """global_attn_every_n_layers for transformers 4 when ``types`` follow its pattern (i global iff i % n == 0)."""
    for n in range(1, len(types) + 1):
        if all((t == "full_attention") == (i % n == 0) for i, t in enumerate(types)):
            return n
    return None


def config_to_hf(cfg: ModelConfig) -> dict:
    task = {"architectures": ["ModernBertForMaskedLM" if cfg.head == "mlm" else "ModernBertModel"]}
    if cfg.head in _TASK_ARCHS:
        task = task_config_to_hf(cfg, _TASK_ARCHS[cfg.head])
        task.setdefault("classifier_dropout", cfg.dropout)
    types = layer_types(cfg)
    local_theta = cfg.rope_local_base or cfg.rope_base
    every = _every_n(types)
    return {
        "architectures": task.pop("architectures"), "model_type": "modernbert", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "hidden_activation": _ACT_NAMES[_FFN_ACT[cfg.ffn]],
        "max_position_embeddings": cfg.max_seq_len, "norm_eps": cfg.norm_eps, "norm_bias": cfg.norm_bias,
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.attn_dropout,
        "embedding_dropout": cfg.dropout, "mlp_dropout": cfg.dropout, "layer_types": types,
        **({"global_attn_every_n_layers": every} if every else {}),  # transformers 4 reads this, not layer_types
        "local_attention": 2 * (cfg.sliding_window - 1) if cfg.sliding_window is not None else 128,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_base},
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "global_rope_theta": cfg.rope_base, "local_rope_theta": local_theta, "decoder_bias": True,
        "classifier_pooling": _seq_pooling(cfg), "classifier_bias": cfg.head_dense_bias,
        "classifier_activation": _ACT_NAMES[cfg.head_act], "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id, **task,
    }
