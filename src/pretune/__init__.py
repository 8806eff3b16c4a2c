"""pretune: pretrain once, finetune many times — transformer language models end to end.

Public API::

    model = pretune.build_model("tiny-gpt2", dropout=0.0)   # preset name or ModelConfig
    out = model(input_ids, attention_mask=mask)              # .logits, .last_hidden_state
    pretune.save(model, "ckpt/"); model = pretune.load("ckpt/")
    model = pretune.from_hf("hf_folder/"); pretune.to_hf(model, "exported/")

    tok = pretune.train_tokenizer(["corpus.txt.gz"], kind="wordpiece", vocab_size=8000); tok.save("tok.json")
    cfg = pretune.load_run_config("configs/pretrain/bert-mlm.yaml", ["tokenizer=tok.json", "data.train=[c.txt]"])
    result = pretune.pretrain(cfg)                            # result.model_dir: the finetunable checkpoint
"""

from __future__ import annotations

from typing import Any

from .checkpoint import CheckpointError, load, save
from .config import ConfigError, ModelConfig
from .interop import InteropError, from_hf, to_hf
from .model import KVCache, ModelOutput, TransformerLM, count_parameters
from .presets import PRESETS, get_preset, preset_names
from .pretrain import pretrain
from .runconfig import RunConfig, load_run_config
from .tokenization import Tokenizer, load_tokenizer, train_tokenizer

__version__ = "0.1.0"


def build_model(config: "ModelConfig | str", **overrides: Any) -> TransformerLM:
    """A freshly initialised model from a preset name (``"bert-base"``, ``"tiny-llama"``, ...) or a
    ModelConfig, with optional field overrides (``dropout=0.0``). Unknown keys raise ConfigError."""
    if isinstance(config, str):
        cfg = get_preset(config, **overrides)
    elif isinstance(config, ModelConfig):
        cfg = config.replace(**overrides) if overrides else config
    else:
        raise TypeError(f"build_model expects a preset name or ModelConfig, got {type(config).__name__}")
    return TransformerLM(cfg)


__all__ = [
    "build_model", "load", "save", "from_hf", "to_hf", "ModelConfig", "ModelOutput", "TransformerLM",
    "KVCache", "count_parameters", "get_preset", "preset_names", "PRESETS", "ConfigError",
    "CheckpointError", "InteropError", "__version__", "pretrain", "RunConfig", "load_run_config", "Tokenizer",
    "load_tokenizer", "train_tokenizer",
]
