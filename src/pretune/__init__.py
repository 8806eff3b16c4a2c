"""pretune: pretrain once, finetune many times — transformer language models end to end.

Public API::

    model = pretune.build_model("tiny-gpt2", dropout=0.0)   # preset name or ModelConfig
    out = model(input_ids, attention_mask=mask)              # .logits, .last_hidden_state
    pretune.save(model, "ckpt/"); model = pretune.load("ckpt/")  # load: any model folder (pretune, HF, adapter)
    loaded = pretune.load_pretrained("runs/ft/model")        # .model, .tokenizer, .task, .kind
    model = pretune.from_hf("hf_folder/"); pretune.to_hf(model, "exported/")
    ids = pretune.generate(model, prompt_ids, max_new_tokens=20)
    model = pretune.quantize(model, "int8")                  # int8 / int4 weights for CPU decoding (in place)

    tok = pretune.train_tokenizer(["corpus.txt.gz"], kind="wordpiece", vocab_size=8000); tok.save("tok.json")
    cfg = pretune.load_run_config("configs/pretrain/bert-mlm.yaml", ["tokenizer=tok.json", "data.train=[c.txt]"])
    result = pretune.pretrain(cfg)                            # result.model_dir: the finetunable checkpoint

Names are imported on first use, so ``import pretune`` (and ``pretune --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import hooks as _hooks

__version__ = "0.1.0"

_EXPORTS = {  # public name -> the module that defines it
    "build_model": "pretune.model", "TransformerLM": "pretune.model", "ModelOutput": "pretune.model",
    "KVCache": "pretune.model", "count_parameters": "pretune.model", "quantize": "pretune.model",
    "load": "pretune.loading", "load_pretrained": "pretune.loading", "Pretrained": "pretune.loading",
    "save": "pretune.io.checkpoint", "CheckpointError": "pretune.io.checkpoint",
    "ConfigError": "pretune.config", "ModelConfig": "pretune.config",
    "from_hf": "pretune.interop", "to_hf": "pretune.interop", "InteropError": "pretune.interop",
    "PRESETS": "pretune.presets", "get_preset": "pretune.presets", "preset_names": "pretune.presets",
    "pretrain": "pretune.jobs.pretrain", "load_run_config": "pretune.jobs.pretrain", "RunConfig": "pretune.runconfig",
    "Tokenizer": "pretune.io.tokenization", "load_tokenizer": "pretune.io.tokenization",
    "train_tokenizer": "pretune.io.tokenization", "generate": "pretune.generation",
}

__all__ = ["__version__", *_EXPORTS]


def _generate(model, *args, **kwargs):
    """``model.generate(...)``: ``pretune.generate(model, ...)``; the model layer may not import generation, so
    ``TransformerLM.generate`` calls this through ``pretune.hooks`` (torch is imported on the first call)."""
    from .generation import generate

    return generate(model, *args, **kwargs)


_hooks.HOOKS["generate"] = _generate


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pretune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from .config import ConfigError, ModelConfig
    from .generation import generate
    from .interop import InteropError, from_hf, to_hf
    from .io.checkpoint import CheckpointError, save
    from .io.tokenization import Tokenizer, load_tokenizer, train_tokenizer
    from .jobs.pretrain import load_run_config, pretrain
    from .loading import Pretrained, load, load_pretrained
    from .model import KVCache, ModelOutput, TransformerLM, build_model, count_parameters, quantize
    from .presets import PRESETS, get_preset, preset_names
    from .runconfig import RunConfig
