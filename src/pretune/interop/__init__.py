"""Import from / export to Hugging Face ``transformers`` folders.

One file per family holds everything family-specific: how its config maps to ModelConfig and a
template table mapping its weight names to ours (``"h.{}.ln_1" <-> "transformer.decoder.layers.{}.attn_norm"``).
This file holds the engine: read/write folders, apply a table in either direction, refuse
anything unmapped instead of silently dropping it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save_file

from ..config import TASK_HEADS, ModelConfig
from ..io.checkpoint import (
    CheckpointError,
    atomic_folder,
    empty_parameters,
    load_state,
    owned,
    read_weights,
    unique_state,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "spiece.model", "spm.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")  # the template too: transformers reads it beside them


class InteropError(ValueError):
    """A Hugging Face folder cannot be converted; the message names the file, key or tensor."""


# ---------------------------------------------------------------------------------------------
# template tables
# ---------------------------------------------------------------------------------------------
Table = list[tuple[str, str]]  # (hf_template, ours_template); "{}" stands for a layer index


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{\}", r"(\d+)")
    if template.endswith((".weight", ".bias")):
        return re.compile(pattern + "$")
    return re.compile(pattern + r"\.(weight|bias)$")  # a module prefix: both of its tensors


def rename(tensors: dict[str, torch.Tensor], table: Table, *, reverse: bool = False,
           ignore: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Rename every tensor through ``table`` (hf -> ours, or ours -> hf when ``reverse``).

    Names matching an ``ignore`` regex are dropped (documented redundancies such as tied copies);
    any other name no template matches raises InteropError naming it.
    """
    pairs = [(b, a) if reverse else (a, b) for a, b in table]
    compiled = [(_compile(src), src, dst) for src, dst in pairs]
    ignored = [re.compile(p) for p in ignore]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if any(rx.search(name) for rx in ignored):
            continue
        for rx, src, dst in compiled:
            m = rx.match(name)
            if m is None:
                continue
            groups = list(m.groups())
            suffix = "" if src.endswith((".weight", ".bias")) else "." + groups.pop()
            new = dst
            for g in groups:
                new = new.replace("{}", g, 1)
            out[new + suffix] = t
            break
        else:
            raise InteropError(f"no mapping for tensor {name!r}")
    return out


# transformers' activation names (hidden_act, ...) -> ours, and ours -> the name an export writes (most families)
HF_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "swish",
           "swish": "swish"}
HF_ACT_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "swish": "silu"}

# model-core options that only some families have, at their "off" values: a family's export_mismatch asks for these
# unless it has the option (a GPT-2 config with a sliding window is not GPT-2)
PLAIN_OPTIONS = {"qkv_bias": False, "qk_norm": False, "scale_embeddings": False, "sliding_window": None,
                 "sliding_layers": None, "attn_softcap": None, "logit_softcap": None, "rope_local_base": None,
                 "first_attn_norm": True, "head_transform": False, "head_dense_bias": True,
                 "cls_act": "tanh", "pair_head": False, "logit_bias": False, "task_stack": "encoder"}


def mismatch(cfg: ModelConfig, **expected) -> str | None:
    """The first config field whose value differs from ``expected``, as a sentence (or None)."""
    for key, value in expected.items():
        if getattr(cfg, key) != value:
            return f"needs {key}={value!r}, got {getattr(cfg, key)!r}"
    return None


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# task heads (the *ForSequenceClassification / *ForTokenClassification / *ForQuestionAnswering classes)
# ---------------------------------------------------------------------------------------------
TASK_SUFFIXES = {"ForSequenceClassification": "sequence", "ForTokenClassification": "tagging",
                 "ForQuestionAnswering": "qa", "ForMultipleChoice": None}  # None: never supported


def task_arch(hf: dict, supported: Iterable[str], guess: str | None = None) -> str | None:
    """The task-head class named in ``architectures`` (or ``guess``, made from the tensor names, when
    config.json names no class), or None for a body / LM checkpoint. A task class this family does not
    support raises InteropError naming it."""
    supported = list(supported)
    archs = hf.get("architectures") or ([guess] if guess else [])
    for arch in archs:
        if not arch.endswith(tuple(TASK_SUFFIXES)):
            continue
        if arch not in supported:
            raise InteropError(f"architectures={arch!r} is not supported; task heads of this family: "
                               f"{', '.join(supported) or 'none'}")
        return arch
    return None


def task_fields(hf: dict, arch: str) -> dict:
    """ModelConfig fields (head, num_labels, labels, classifier_dropout) of an HF task-head config.

    ``labels`` are the ``id2label`` names in index order, or None when they are HF's defaults
    ("LABEL_0", "LABEL_1", ...); a sequence head is regression when problem_type says so or it has one output.
    """
    kind = next(v for k, v in TASK_SUFFIXES.items() if arch.endswith(k))
    id2label = hf.get("id2label")
    if id2label:
        try:
            ids = sorted(int(i) for i in id2label)
        except (TypeError, ValueError):
            raise InteropError(f"id2label keys must be integers, got {sorted(id2label)!r}") from None
        if ids != list(range(len(ids))):
            raise InteropError(f"id2label must number its labels 0..{len(ids) - 1}, got ids {ids}")
        names = [str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in ids]
        num_labels = len(names)
    else:
        names = None
        num_labels = int(hf.get("num_labels") or 2)  # HF's default: 2 labels, id2label not written
    if hf.get("num_labels") is not None and int(hf["num_labels"]) != num_labels:
        raise InteropError(f"num_labels={hf['num_labels']} disagrees with id2label ({num_labels} labels)")
    labels = None
    if names is not None and names != [f"LABEL_{i}" for i in range(num_labels)]:
        if len(set(names)) != len(names):
            raise InteropError(f"id2label has repeated label names: {names!r}")
        labels = names
    problem = hf.get("problem_type")
    multi = False
    if kind == "sequence":
        multi = problem == "multi_label_classification"  # one sigmoid per label (tasks/multilabel.py)
        head = "regression" if not multi and (problem == "regression" or num_labels == 1) else "classification"
        if head == "regression" and num_labels != 1:
            raise InteropError(f"problem_type='regression' with {num_labels} outputs is not supported "
                               "(pretune's regression head has one)")
    elif kind == "qa":
        head = "qa"
        if num_labels != 2:
            raise InteropError(f"question answering needs 2 outputs (start, end), got num_labels={num_labels}")
    else:
        head = "tagging"
    return {"head": head, "num_labels": num_labels, "labels": labels,
            "classifier_dropout": hf.get("classifier_dropout"), "multi_label": multi}


def task_mismatch(cfg: ModelConfig, archs: dict[str, str | None], pooling: str | None) -> str | None:
    """Why ``cfg``'s task head has no equivalent among ``archs`` (head -> HF class, None: no such class),
    given the sentence pooling the family's sequence-classification class uses; None when it has one."""
    arch = archs.get(cfg.head)
    if arch is None:
        return f"head={cfg.head!r} has no Hugging Face class in this family"
    if cfg.head in ("classification", "regression"):
        if cfg.sentence_pooling != pooling:
            how = {"pooler": "the BERT pooler output (pooler=True, pooling='pooler')",
                   "cls": "dense + tanh on the first token (pooling='cls')",
                   "last": "the last real token (pooling='last')",
                   "eos": "dense + tanh on the decoder's state at each row's last EOS (pooling='eos')"}[pooling]
            return (f"{arch} classifies {how}, got pooling={cfg.sentence_pooling!r} (a model finetuned with "
                    f"task.pooling={pooling} exports)")
        if cfg.head == "classification" and cfg.num_labels < 2 and not cfg.multi_label:
            return f"{arch} reads num_labels=1 as regression; use head='regression'"
    return None


def task_config_to_hf(cfg: ModelConfig, arch: str) -> dict:
    """The config.json keys of a task head: architectures, the label map and problem_type."""
    names = cfg.labels or [f"LABEL_{i}" for i in range(cfg.num_labels)]
    out = {"architectures": [arch], "num_labels": cfg.num_labels,
           "id2label": {str(i): n for i, n in enumerate(names)}, "label2id": {n: i for i, n in enumerate(names)}}
    if cfg.head in ("classification", "regression"):
        out["problem_type"] = ("regression" if cfg.head == "regression" else
                               "multi_label_classification" if cfg.multi_label else "single_label_classification")
    if cfg.classifier_dropout is not None:
        out["classifier_dropout"] = cfg.classifier_dropout
    return out


# ---------------------------------------------------------------------------------------------
# families
# ---------------------------------------------------------------------------------------------
def _families() -> dict[str, ModuleType]:
    from . import (
        albert,
        bart,
        bert,
        deberta_v2,
        distilbert,
        electra,
        gemma,
        gemma2,
        gpt2,
        llama,
        mistral,
        modernbert,
        openai_gpt,
        qwen2,
        qwen3,
        t5,
    )

    out = {}
    for mod in (bert, electra, distilbert, gpt2, openai_gpt, t5, bart, llama, qwen2, qwen3, mistral, gemma, gemma2,
                modernbert, deberta_v2, albert):
        for model_type in mod.MODEL_TYPES:
            out[model_type] = mod
    return out


def family_of(model_type: str) -> ModuleType:
    fams = _families()
    if model_type not in fams:
        raise InteropError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(fams))}")
    return fams[model_type]


def read_hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise InteropError(f"{path}: no config.json (is this a Hugging Face model folder?)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise InteropError(f"{file}: not valid JSON (line {e.lineno}: {e.msg})") from None


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder: model.safetensors, a sharded index, or pytorch_model.bin
    (read with ``torch.load(weights_only=True)``: tensors only, nothing unpickled beyond that)."""
    if (path / "model.safetensors").is_file():
        return read_weights(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(read_weights(path / shard))
        return tensors
    if (path / "pytorch_model.bin").is_file():
        try:
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - report any unpickling refusal with the file name
            raise CheckpointError(f"{path / 'pytorch_model.bin'}: cannot be read safely ({e})") from None
    raise InteropError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def sentence_pooling(path: str | os.PathLike) -> str | None:
    """The pooling a sentence-transformers folder (``modules.json`` with a Pooling module) was trained with:
    "mean" for mean pooling over tokens (all-MiniLM-L6-v2 and most such models), "cls" for the first token;
    None when the folder records none (or another mode). Unreadable files count as none."""
    path = Path(path)
    try:
        modules = json.loads((path / "modules.json").read_text())
        folder = next(m.get("path", "") for m in modules if str(m.get("type", "")).endswith("models.Pooling"))
        mode = json.loads((path / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    if mode.get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls" if mode.get("pooling_mode_cls_token") else None


def from_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None):
    """Import a Hugging Face ``transformers`` folder (BERT, RoBERTa, DistilBERT, GPT-2, T5 v1.0/v1.1, Llama (with Llama
    3.x RoPE scaling), Qwen2/Qwen2.5, Qwen3, Mistral, Gemma, Gemma 2, ELECTRA (discriminator and generator),
    DeBERTa-v2/v3, ALBERT (with its sentence-order head), BART), with its task head when ``architectures`` names one
    (*ForSequenceClassification, *ForTokenClassification, *ForQuestionAnswering of BERT, RoBERTa, DistilBERT, ELECTRA,
    DeBERTa-v2, ALBERT, GPT-2, Llama, Qwen and Mistral; Gemma's have no QA class, BART no token class; labels come from
    ``id2label``). A
    base model that is a sentence-transformers model trained with mean pooling (``modules.json``) gets
    ``pooling="mean"``, so a classification head added to it reads the sentence vector it was trained to make (not
    the BERT pooler).

    Args:
        path: folder with config.json and model.safetensors (or a sharded index, or pytorch_model.bin).
        dtype: parameter dtype of the returned model (default fp32, whatever the file stores).
    Returns a TransformerLM in eval mode whose outputs equal the transformers model's.
    """
    from ..model import TransformerLM

    path = Path(path)
    hf_config = read_hf_config(path)
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise InteropError(f"{path / 'config.json'}: no 'model_type' key")
    fam = family_of(model_type)
    tensors = read_hf_weights(path)  # any float dtype: load_state converts each to fp32
    try:
        config = fam.config_from_hf(hf_config, set(tensors))
        eos = hf_config.get("eos_token_id")  # where generation ends; a list (Llama 3): its first id
        if config.arch != "encoder" and config.eos_token_id is None and eos not in (None, []):
            config = config.replace(eos_token_id=eos[0] if isinstance(eos, list) else eos)
        ours = fam.weights_from_hf(tensors, config)
    except InteropError as e:
        raise InteropError(f"{path}: {e}") from None
    if config.head not in TASK_HEADS and config.pooling is None and sentence_pooling(path) == "mean":
        config = config.replace(pooling="mean")  # a task head added later reads what the checkpoint was trained on
    with empty_parameters():  # the file's tensors become the parameters: the weights are held once
        model = TransformerLM(config)
    del tensors
    load_state(model, ours, source=f"{path} (converted from {model_type})")
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def to_hf(model, path: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None,
          dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9) -> Path:
    """Export a TransformerLM to a folder ``transformers.AutoModel*.from_pretrained`` loads.

    The family is chosen from the config (which must match one HF supports exactly); a task head
    becomes the family's *ForSequenceClassification / *ForTokenClassification / *ForQuestionAnswering
    with its label map; tokenizer files are copied from ``tokenizer_dir`` when given. ``dtype``: the weights'
    dtype in the files (e.g. bf16 for a large model; recorded as the config's ``torch_dtype``); weights larger than
    ``max_shard_bytes`` are split into ``model-0000K-of-0000N.safetensors`` files with transformers' index file.
    """
    cfg: ModelConfig = model.config
    fam = _family_for_config(cfg)
    hf_config = fam.config_to_hf(cfg)
    if cfg.eos_token_id is not None:
        hf_config["eos_token_id"] = cfg.eos_token_id
    ours = unique_state(model)
    hf_tensors = fam.weights_to_hf(ours, cfg)
    path = Path(path)
    if dtype is not None:
        hf_tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_tensors.items()}
        hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with atomic_folder(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        write_safetensors(tmp, hf_tensors, max_shard_bytes)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
    return path


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or, when the tensors are larger than ``max_shard_bytes``, consecutive shards
    ``model-00001-of-0000N.safetensors`` (each at most that size unless one tensor is larger) and
    ``model.safetensors.index.json`` (``metadata.total_size`` and the ``weight_map``) as transformers writes them."""
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    shards: list[list[str]] = [[]]
    used = 0
    for k in tensors:
        if shards[-1] and used + sizes[k] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    if len(shards) == 1:
        save_file({k: owned(v) for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, keys in zip(names, shards):
        save_file({k: owned(tensors[k]) for k in keys}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _family_for_config(cfg: ModelConfig) -> ModuleType:
    reasons = []
    seen = set()
    for fam in _families().values():
        if fam in seen:
            continue
        seen.add(fam)
        why = fam.export_mismatch(cfg)
        if why is None:
            return fam
        reasons.append(f"{fam.__name__.rsplit('.', 1)[-1]}: {why}")
    raise InteropError("this config has no Hugging Face equivalent; " + "; ".join(reasons))


__all__ = ["from_hf", "to_hf", "InteropError", "rename"]
