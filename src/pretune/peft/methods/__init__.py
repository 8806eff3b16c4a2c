"""The PEFT methods, one module each: ``NAME``, ``HELP``, ``PARTS`` (the parameter-name parts of its modules),
``MERGEABLE``, ``DEFAULT_LR``, ``validate(cfg)``, ``inject(model, cfg, name, ctx)`` and, when it puts modules
into the model, ``strip(model)``. A new method is one new module here plus one line in ``METHODS``."""

from __future__ import annotations

from types import ModuleType

from . import adapter, bitfit, embeddings, ia3, lora, prefix, prompt

METHODS: dict[str, ModuleType] = {m.NAME: m for m in (lora, adapter, prefix, prompt, ia3, embeddings, bitfit)}
METHOD_HELP = {name: m.HELP for name, m in METHODS.items()}

__all__ = ["METHODS", "METHOD_HELP"]
