"""sentence-transformers folders, both ways: what a folder's modules say (pooling, Normalize, max length), and a
trained embedding model written as one (``SentenceTransformer(folder)`` loads it and gives pretune's embeddings).

A sentence-transformers folder is a Hugging Face model folder (config.json, weights, tokenizer files) plus
``modules.json`` naming its modules in order, each in its own sub-folder: Transformer (path ""; its
``sentence_bert_config.json`` holds ``max_seq_length``), Pooling (``1_Pooling/config.json``: one ``pooling_mode_*``
flag set), Normalize (``2_Normalize``, no files)::

    read_st_modules(minilm_dir())   # STModules(pooling="mean", normalize=True, max_seq_length=256)
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

__all__ = ["STModules", "read_st_modules", "write_st_folder", "write_hf_in_place"]

# sentence-transformers' Pooling flags <-> pretune's poolings ("lasttoken" is ST's name for the last real token)
_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
_ALL_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
              "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
_KNOWN = ("Transformer", "Pooling", "Normalize")  # the modules pretune computes; any other is refused by name


@dataclass(frozen=True)
class STModules:
    """What a sentence-transformers folder's modules do after the transformer."""

    pooling: str  # mean, cls or last
    normalize: bool  # a Normalize module: unit-length vectors
    max_seq_length: int | None  # tokens per text (sentence_bert_config.json); None: the model's positions


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None


def read_st_modules(path: str | os.PathLike) -> STModules | None:
    """The modules of the sentence-transformers folder ``path`` (None: no ``modules.json``, not such a folder).

    Raises ConfigError naming the folder when a module is one pretune does not compute (Dense, a max or weighted-mean
    pooling, ...): its embeddings would not be the folder's."""
    path = Path(path)
    if not (path / "modules.json").is_file():
        return None
    modules = _read_json(path / "modules.json")
    if not isinstance(modules, list):
        raise ConfigError(f"{path / 'modules.json'}: expected a list of modules")
    pooling, normalize, max_len = None, False, None
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else ""
        if kind not in _KNOWN:
            raise ConfigError(f"{path}: module {m.get('type') if isinstance(m, dict) else m!r} of modules.json is not "
                              f"one pretune computes ({', '.join(_KNOWN)}); its embeddings would differ")
        sub = path / m.get("path", "")
        if kind == "Transformer" and (sub / "sentence_bert_config.json").is_file():
            max_len = _read_json(sub / "sentence_bert_config.json").get("max_seq_length")
        elif kind == "Pooling":
            cfg = _read_json(sub / "config.json")
            on = [k for k in _ALL_MODES if cfg.get(k)]
            pooling = next((p for p, flag in _MODES.items() if on == [flag]), None)
            if pooling is None:
                raise ConfigError(f"{sub / 'config.json'}: pooling {', '.join(on) or 'none'}; pretune pools by one of "
                                  f"{', '.join(_MODES.values())}")
        elif kind == "Normalize":
            normalize = True
    if pooling is None:
        raise ConfigError(f"{path / 'modules.json'}: no Pooling module")
    return STModules(pooling=pooling, normalize=normalize, max_seq_length=max_len)


def write_st_folder(model, tokenizer, folder: str | os.PathLike, *, pooling: str, normalize: bool,
                    max_seq_length: int) -> list[str]:
    """Make ``folder`` (a pretune checkpoint of ``model``, written by the run) a sentence-transformers folder: the
    model's Hugging Face config and weights replace pretune's, and the modules files go beside them. Returns the
    top-level entries written (for the folder's marker).

    Args:
        model: the TransformerLM (its body: the head is not exported).
        tokenizer: its :class:`~pretune.io.tokenization.Tokenizer` (its special tokens go to tokenizer_config.json).
        pooling: mean, cls or last; normalize: a Normalize module; max_seq_length: tokens per text.
    """
    folder = Path(folder)
    written = write_hf_in_place(model, tokenizer, folder, max_seq_length=max_seq_length)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {k: False for k in _ALL_MODES}
    flags[_MODES[pooling]] = True
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": model.config.dim, **flags, "include_prompt": True}, indent=2) + "\n")
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}, indent=2) + "\n")
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"model_type": "SentenceTransformer", "prompts": {}, "default_prompt_name": None,
                    "similarity_fn_name": "cosine"}, indent=2) + "\n")
    return written + ["modules.json", "1_Pooling", "sentence_bert_config.json",
                      "config_sentence_transformers.json"] + (["2_Normalize"] if normalize else [])


def write_hf_in_place(model, tokenizer, folder: str | os.PathLike, *, max_seq_length: int) -> list[str]:
    """Replace the pretune checkpoint files of ``folder`` (written by a run) with ``model``'s Hugging Face config and
    weights (``interop.to_hf``: a task head becomes its ``*ForSequenceClassification``), and write a
    ``tokenizer_config.json`` for ``tokenizer.json``, so ``transformers.AutoTokenizer`` and ``AutoModel*`` load the
    folder; the folder's other files (task.json, run.yaml) stay. Returns the top-level entries written."""
    from . import to_hf

    folder = Path(folder)
    tmp = folder.parent / f".{folder.name}.hf-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        to_hf(model, tmp)
        written = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
        for name in written:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    roles = getattr(tokenizer, "roles", None) or {}
    types = ["token_type_ids"] if model.config.token_types >= 2 else []  # BERT's segment ids reach the model
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_length,
               "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", *types, "attention_mask"],
               **{f"{role}_token": text for role, text in roles.items()
                  if role in ("cls", "sep", "pad", "unk", "mask", "bos", "eos")}}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return written + ["tokenizer_config.json"]
