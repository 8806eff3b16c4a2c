"""Parameter-efficient finetuning: LoRA, Houlsby adapters, prefix tuning, prompt tuning, (IA)3, BitFit and
embeddings-only training, alone or combined, several adapters in one model and one batch.

    from pretune import peft
    summary = peft.inject(model, peft.PeftConfig(method="lora", r=8, alpha=16))  # base frozen in place
    ...train...
    peft.save_adapter(model, "adapter/", base="minilm/")     # peft's layout for LoRA: loads in `peft` too
    model2 = pretune.load("minilm/"); peft.load_adapter(model2, "adapter/", name="spam")
    model3 = pretune.load("adapter/")                        # or: the base it recorded, with the adapter active
    with peft.route(model2, ["spam", None, "spam"]):         # a different adapter (or none) per example
        out = model2(ids, attention_mask=mask)
    merged = peft.merged_model(model2, "spam")                # a plain model with LoRA folded into W0
    peft.inject(model, peft.PeftConfig(method="lora", base_dtype="bf16"))  # frozen linear weights stored in bf16

Each method is one module of ``pretune.peft.methods`` (registry ``METHODS``); a method wraps the layers it
changes, the model code names none of them.
"""

from .config import PeftConfig
from .core import PeftError, adapter_names, adapter_parameters, base_state, peft_state
from .files import adapter_size, hf_places, is_adapter_folder, load_adapter, read_meta, save_adapter
from .inject import (
    base_matmul_weights,
    cast_base,
    format_summary,
    freeze_for,
    inject,
    merge,
    merged_model,
    route,
    set_active,
    strip_peft,
    trainable_summary,
    unmerge,
)
from .layers import PeftLinear, PeftState
from .methods import METHOD_HELP, METHODS

__all__ = [
    "METHODS", "METHOD_HELP", "PeftConfig", "PeftError", "PeftLinear", "PeftState", "inject", "route", "set_active",
    "merge", "unmerge", "merged_model", "strip_peft", "freeze_for", "trainable_summary", "format_summary",
    "adapter_names", "adapter_parameters", "save_adapter", "load_adapter", "hf_places", "is_adapter_folder",
    "read_meta", "base_state", "peft_state", "adapter_size", "cast_base", "base_matmul_weights",
]
