"""One way in: any model folder -> the model, its tokenizer and its task metadata.

    loaded = pretune.load_pretrained("runs/finetune/model")   # a pretune checkpoint, a transformers folder
    loaded.model, loaded.tokenizer, loaded.task, loaded.kind    # or an adapter folder (LoRA, prefix, ...)
    model = pretune.load("hf_folder/")                          # the model alone

Three kinds of folder, told apart by :func:`folder_kind` (the only place that answers the question):

* ``pretune``: ``config.json`` (pretune's keys) + ``model.safetensors`` [+ ``tokenizer.json``, ``task.json``];
* ``transformers``: a Hugging Face folder, its ``config.json`` names a ``model_type`` (converted on load);
* ``gguf``: a GGUF file (llama.cpp's format) of an architecture ``pretune.interop.gguf`` reads, its tokenizer
  inside (de-quantised to fp32 when its tensors are quantised);
* ``adapter``: ``adapter_model.safetensors`` + ``pretune_adapter.json`` or peft's ``adapter_config.json``;
  its base model comes from ``base=`` or from the path the adapter recorded, is loaded the same way
  (any kind; an adapter folder as the base is merged into its own base, as training from it merged it), gets the
  adapter's task head, and the adapter is loaded into it and made active.

Every command and job loads through here (finetune, evaluate, predict, embed, generate, prompt, convert,
peft merge, ``model.init`` of pretraining, the quickstart, the benchmarks), so an adapter folder works
wherever a model folder does. Training jobs that start *from* an adapter ask for ``merge=True``: the adapter
is folded into the base weights (LoRA, (IA)3, embeddings, BitFit), so they train a plain model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .config import ConfigError
from .io.checkpoint import CONFIG_NAME, TASK_FILE, CheckpointError

FolderKind = Literal["pretune", "transformers", "adapter", "gguf"]

__all__ = ["Pretrained", "folder_kind", "load_pretrained", "load", "read_task", "build_run_model", "TASK_FILE"]


@dataclass
class Pretrained:
    """What :func:`load_pretrained` returns."""

    model: torch.nn.Module  # a TransformerLM in eval mode (an adapter folder: its base with the adapter active)
    tokenizer: object | None  # pretune.io.tokenization.Tokenizer, or None when not asked for and not found
    task: dict | None  # the folder's task.json (a finetuned model or adapter), None when it has none
    kind: FolderKind  # what the folder was
    path: Path  # the folder itself
    base: Path | None = None  # adapter folders: the base model's folder
    folders: tuple[Path, ...] = ()  # where the tokenizer and its side files (chat template) are looked for, in order


def folder_kind(path: str | os.PathLike) -> FolderKind:
    """Whether ``path`` is a pretune checkpoint, a transformers folder, an adapter folder or a GGUF file; an error
    naming the folder and what it lacks otherwise."""
    from .interop.gguf import is_gguf
    from .peft.files import is_adapter_folder

    p = Path(path)
    expected = "expected a pretune checkpoint, a Hugging Face model folder, an adapter folder or a GGUF file"
    if not p.exists():
        raise CheckpointError(f"{p}: not a checkpoint folder: it does not exist ({expected})")
    if is_gguf(p):
        return "gguf"
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a checkpoint folder but a file ({expected})")
    if is_adapter_folder(p):
        return "adapter"
    config = p / CONFIG_NAME
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config}: not valid JSON ({e})") from None
        return "transformers" if isinstance(data, dict) and "model_type" in data else "pretune"
    raise CheckpointError(f"{p}: not a model folder: missing {CONFIG_NAME} (a pretune checkpoint or Hugging Face "
                          "model) and no adapter_model.safetensors (an adapter)")


def read_task(path: str | os.PathLike) -> dict | None:
    """The ``task.json`` of a folder (None when it has none)."""
    file = Path(path) / TASK_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a mapping of task settings, got {type(data).__name__}")
    return data


def _model(path: Path, kind: FolderKind):
    if kind == "transformers":
        from .interop import from_hf

        return from_hf(path)
    from .io.checkpoint import load as load_checkpoint

    return load_checkpoint(path)


def _tokenizer(sources: list[Path | str], required: bool, what: Path):
    from .io.tokenization import Tokenizer, TokenizerError

    errors = []
    for src in sources:
        try:
            return Tokenizer.load(src)
        except (TokenizerError, OSError, ValueError) as e:
            errors.append(str(e))
    if required:
        raise ConfigError(f"no usable tokenizer for {what} ({'; '.join(errors) or 'none found'}); pass "
                          "tokenizer=PATH (--tokenizer)")
    return None


def _check_same_vocab(tok, own, *, given, path: Path) -> None:
    """A tokenizer given for a model that has its own must map every token to the same id: otherwise the model reads
    other words than it was trained on (a same-size vocabulary would pass unnoticed)."""
    mine, theirs = tok.tk.get_vocab(with_added_tokens=True), own.tk.get_vocab(with_added_tokens=True)
    differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
    if differ:
        t = differ[0]
        raise ConfigError(f"{given}: the tokenizer maps {len(differ)} of {len(theirs)} tokens to other ids than the "
                          f"tokenizer saved with {path} (e.g. {t!r}: {mine.get(t)} here, {theirs.get(t)} there), so "
                          "the model would read other words than it was trained on; leave --tokenizer out to use "
                          "the model's own")


def _adapter_base(path: Path, base: str | os.PathLike | None) -> Path:
    from .peft import read_meta
    from .peft.inject import PeftError

    meta = read_meta(path) or {}
    recorded = (meta.get("base") or {}).get("model")
    chosen = base or recorded
    if not chosen:
        raise PeftError(f"{path}: the adapter does not record its base model; pass base=PATH (--base)")
    if not Path(chosen).exists():
        how = "the base model it recorded" if not base else "the base model given"
        raise PeftError(f"{path}: {how}, {chosen} does not exist; pass base=PATH (--base)")
    return Path(chosen)


def load_pretrained(path: str | os.PathLike, *, base: str | os.PathLike | None = None,
                    tokenizer: str | os.PathLike | None = None, need_tokenizer: bool = True, merge: bool = False,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Pretrained:
    """Load any model folder (see the module docstring).

    Args:
        path: a pretune checkpoint, a Hugging Face ``transformers`` folder, an adapter folder or a GGUF file.
        base: an adapter folder's base model (default: the path the adapter recorded).
        tokenizer: a tokenizer.json (or folder holding one) to use instead of the folder's own.
        need_tokenizer: raise when no tokenizer is found (False: ``tokenizer`` is then None).
        merge: adapter folders: fold the adapter into the base weights and return a plain model (what training
            from an adapter needs); only LoRA, (IA)3, embeddings and BitFit adapters fold in.
        device, dtype: where the model goes and its parameter dtype (default: fp32).
    """
    path = Path(path).expanduser()
    kind = folder_kind(path)
    base_dir, bases = None, []  # bases: the base's folders, where a tokenizer and its side files are looked for too
    if kind == "adapter":
        from .peft import load_adapter, merged_model, read_meta

        base_dir = _adapter_base(path, base)
        # a base that is itself an adapter folder (an adapter trained from one: SFT, then GRPO from the SFT model) is
        # folded in, as build_run_model folded it when the run started: the adapter was trained on those weights
        inner = load_pretrained(base_dir, need_tokenizer=False, merge=True)
        model, bases = inner.model, list(inner.folders)
        head = (read_meta(path) or {}).get("head")
        if head and head.get("head") is not None and head.get("head") != "lm":
            model = model.with_head(**{k: head[k] for k in ("head", "num_labels", "labels", "pooling",
                                                            "classifier_dropout", "multi_label") if k in head})
        name = load_adapter(model, path)
        if merge:
            model = merged_model(model, name)
        tok_sources = [tokenizer] if tokenizer else [path, *bases]
        task = read_task(path) or inner.task
    elif kind == "gguf":  # the tokenizer is inside the file
        from .interop.gguf import read_gguf

        model, own_tok = read_gguf(path, tokenizer=need_tokenizer and not tokenizer)
        tok_sources, task = [tokenizer] if tokenizer else [], None
    else:
        model = _model(path, kind)
        tok_sources = [tokenizer] if tokenizer else [path]
        task = read_task(path)
    if kind == "gguf" and not tokenizer:
        tok = own_tok
    else:
        tok = _tokenizer([s for s in tok_sources if s], need_tokenizer or tokenizer is not None, path)
    if tokenizer and tok is not None:
        own = _tokenizer([path, *bases], False, path)
        if own is not None:
            _check_same_vocab(tok, own, given=tokenizer, path=path)
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise ConfigError(f"the tokenizer of {path} has {tok.vocab_size} tokens but the model's vocabulary has "
                          f"{model.config.vocab_size}: is it the model's own tokenizer?")
    model.to(device=device, dtype=dtype)
    own_folders = [path]
    if kind == "gguf" and tok is not None and not tokenizer:  # its chat template is read where a folder's would be
        from .io.gguf_tokenizer import tokenizer_folder

        own_folders = [tokenizer_folder(tok)]
    folders = tuple(Path(f) for f in ([tokenizer] if tokenizer else []) + [*own_folders, *bases])
    return Pretrained(model=model.eval(), tokenizer=tok, task=task, kind=kind, path=path, base=base_dir,
                      folders=folders)


def load(path: str | os.PathLike, *, base: str | os.PathLike | None = None, merge: bool = False,
         device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """The model of any model folder (see :func:`load_pretrained`), in eval mode."""
    return load_pretrained(path, base=base, need_tokenizer=False, merge=merge, device=device, dtype=dtype).model


def build_run_model(spec: dict, *, tokenizer: str | os.PathLike = "", head: dict | None = None,
                    from_scratch: bool = False, seed: int = 0, log=print):
    """(model, tokenizer) a training run starts from: pretraining, distillation and finetuning build it here.

    Args:
        spec: the run config's ``model`` section. With ``init`` (any model folder; an adapter is folded into its
            base): that model, its config changed by the other keys where they differ from it (``dropout``, say;
            ``preset`` is not read, and a key that would change a weight's shape is refused). Without: a new model,
            ``preset`` with the other keys as overrides, and from the tokenizer what they leave out of
            ``vocab_size``, ``pad_token_id`` (its pad, else 0) and ``decoder_start_token_id`` (its pad, else its
            bos, else 0).
        tokenizer: a tokenizer.json or a folder holding one; a new model needs it; with ``init`` it replaces the
            folder's own, which must then map every token to the same id.
        head: the head the run trains (``TransformerLM.with_head`` fields): a new model is built with it, a model
            from ``init`` with another head gets a freshly initialised one (logged); None: the model's own.
        from_scratch: with ``init``: its architecture (the overrides applied) with random weights.
        seed: torch's seed, set before any weight is drawn.
        log: where the changes to a model from ``init`` are reported.
    """
    from .io.tokenization import Tokenizer
    from .model import TransformerLM
    from .runconfig import RunConfig

    init = spec.get("init")
    if not init and not spec.get("preset"):
        raise ConfigError("no model: set model.init=CHECKPOINT (a pretune or Hugging Face folder) or "
                          "model.preset=NAME with tokenizer=PATH to train from scratch")
    torch.manual_seed(seed)
    if init:
        loaded = load_pretrained(init, tokenizer=tokenizer or None, merge=True)
        model, tok = loaded.model, loaded.tokenizer  # load_pretrained checked the vocabulary
        overrides = {k: v for k, v in spec.items() if k not in ("init", "preset")}
        if from_scratch:
            model = TransformerLM(model.config.replace(**overrides))
            log(f"from scratch: {init}'s architecture with random weights")
        else:
            model = _with_overrides(model, overrides, init)
        if head is not None:
            if head["head"] in ("classification", "tagging") and head["head"] == model.config.head:
                head = {**head, "num_labels": model.config.num_labels, "labels": model.config.labels}  # its label map
            if head["head"] != model.config.head:
                log(f"model.init {init} has head={model.config.head!r}; adding a freshly initialised "
                    f"{head['head']} head")
            model = model.with_head(**head)
    else:
        if not tokenizer:
            raise ConfigError(f"model.preset={spec['preset']} builds a new model and needs tokenizer=PATH")
        tok = Tokenizer.load(tokenizer)
        start = tok.pad_id if tok.pad_id is not None else tok.bos_id  # T5: decoding starts from the pad token
        ids = {"pad_token_id": tok.pad_id if tok.pad_id is not None else 0,
               "decoder_start_token_id": start if start is not None else 0}
        fields = {**{k: v for k, v in ids.items() if k not in spec}, **(head or {})}
        config = RunConfig(model=dict(spec)).model_config(vocab_size=tok.vocab_size, **fields)
        if config.vocab_size < tok.vocab_size:
            raise ConfigError(f"model.vocab_size ({config.vocab_size}) is smaller than the tokenizer's vocabulary "
                              f"({tok.vocab_size} tokens)")
        model = TransformerLM(config)
    return model, tok


def _with_overrides(model, overrides: dict, init) -> torch.nn.Module:
    """``model`` with the config fields of ``overrides`` that differ from its own, its weights kept (or itself)."""
    from .io.checkpoint import empty_parameters, load_state, unique_state
    from .model import TransformerLM

    def shapes(config) -> dict:
        with empty_parameters():  # on the meta device: no memory, no initialisation
            return {k: t.shape for k, t in unique_state(TransformerLM(config)).items()}

    changed = {k: v for k, v in overrides.items() if getattr(model.config, k, object()) != v}
    if not changed:
        return model
    config = model.config.replace(**changed)  # an unknown key is refused here, naming the nearest
    own = {k: t.shape for k, t in unique_state(model).items()}
    reshaping = [k for k in changed if shapes(model.config.replace(**{k: changed[k]})) != own]
    if reshaping:
        given = ", ".join(f"model.{k}={changed[k]!r} (it has {getattr(model.config, k)!r})" for k in reshaping)
        raise ConfigError(f"model.init {init}: {given} would change the shapes of the weights it holds; leave "
                          f"{'it' if len(reshaping) == 1 else 'them'} out (a new architecture starts from "
                          "model.preset)")
    with empty_parameters():
        new = TransformerLM(config)
    load_state(new, unique_state(model), source=f"model.init {init} with {', '.join(changed)} changed")
    return new
