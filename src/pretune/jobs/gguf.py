"""GGUF export (``pretune convert --to-gguf``) and import (``--from-gguf``): any model the loader takes -> one file
llama.cpp runs; a LoRA adapter folder -> a GGUF LoRA that llama.cpp applies to its base's file (``--lora``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..interop.gguf import GGUFError, check_out, read_gguf, write_gguf, write_lora_gguf
from ..io.gguf_tokenizer import GGUFTokenizerError
from ..loading import folder_kind, load_pretrained

__all__ = ["export_gguf", "import_gguf", "lora_factors"]


def lora_factors(model, *, source: str | os.PathLike = "the adapter") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The active LoRA adapter of ``model`` as (A (r, in), scaling * B (out, r)) per adapted module (our names).
    An adapter that holds anything else (DoRA magnitudes, (IA)3 vectors, prompts, trained biases or embeddings, a
    task head) raises GGUFError naming it: a GGUF LoRA carries the two factors only."""
    from ..peft.core import adapter_names, adapter_parameters, linear_modules, peft_state
    from ..peft.layers import PeftLinear

    names = adapter_names(model)
    if len(names) != 1:
        raise GGUFError(f"{source}: expected one adapter, found {len(names)} ({', '.join(names) or 'none'})")
    (name,) = names
    other = [p for p in adapter_parameters(model, name) if not re.search(r"(^|\.)lora_[AB]\.", p)]
    owned = sorted(k for k, owner in peft_state(model).owners.items() if owner == name)
    if other or owned:
        what = (other or owned)[0]
        raise GGUFError(f"{source}: the adapter trains {what} besides LoRA's A and B, which a GGUF LoRA cannot hold; "
                        "export the model with the adapter folded in instead (--merged)")
    factors = {}
    for module, layer in linear_modules(model).items():
        if isinstance(layer, PeftLinear) and name in layer.lora_A:
            a = layer.lora_A[name].weight.detach()
            b = layer.lora_B[name].weight.detach() * layer.lora_scaling[name]
            factors[module] = (a, b)
    if not factors:
        raise GGUFError(f"{source}: a {peft_state(model).configs[name].method} adapter, not LoRA; export the model "
                        "with the adapter folded in instead (--merged)")
    return factors


def export_gguf(src: str | os.PathLike, out: str | os.PathLike, *, type: str = "f32",
                base: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
                merged: bool = False, overwrite: bool = False) -> tuple[Path, str]:
    """Write ``src`` (any model the loader takes) as the GGUF file ``out``; returns (out, what was written).

    Args:
        src: a pretune checkpoint or run's model folder, a Hugging Face folder, a GGUF file, or an adapter folder.
            An adapter folder writes a GGUF LoRA (its base is written apart, from ``base`` or the recorded path),
            unless ``merged``: then the base with the adapter folded in, as one model.
        out: the .gguf file; an existing one is refused unless ``overwrite``.
        type: f32, f16, bf16, q8_0, q4_0 or q4_1 (llama.cpp's names; a LoRA: f32, f16 or bf16).
        tokenizer: a tokenizer to write instead of the model's own.
    """
    out = check_out(out, overwrite)  # before the (possibly slow) load
    kind = folder_kind(src)
    if kind == "adapter" and not merged:
        loaded = load_pretrained(src, base=base, need_tokenizer=False)
        path = write_lora_gguf(loaded.model, lora_factors(loaded.model, source=src), out, type=type,
                               overwrite=overwrite)
        return path, f"a GGUF LoRA for {loaded.base} (llama.cpp: --lora {path})"
    loaded = load_pretrained(src, base=base, tokenizer=tokenizer, merge=True)
    try:
        path = write_gguf(loaded.model, out, tokenizer=loaded.tokenizer, type=type, overwrite=overwrite)
    except GGUFTokenizerError as e:  # name the tokenizer: the model's own, or the one --tokenizer gave
        raise GGUFTokenizerError(f"{tokenizer or src}: {e}") from None
    return path, f"a {type} GGUF model ({loaded.model.num_parameters():,} parameters)"


def import_gguf(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Read a GGUF file (see ``pretune.interop.gguf.read_gguf``) and save it as a pretune checkpoint folder."""
    from ..io.checkpoint import save

    model, tok = read_gguf(src)
    save(model, out, tokenizer=tok)
    return Path(out)
