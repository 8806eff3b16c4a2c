"""The PEFT methods, one module each: ``NAME``, ``Settings`` (its fields of the ``peft`` section, a subclass of
``PeftConfig``), ``PARTS`` (the parameter-name parts of its modules), ``MERGEABLE``, ``DEFAULT_LR``,
``validate(cfg)``, ``inject(model, cfg, name, ctx)`` and, when it puts modules into the model, ``strip(model)``. A
new method is one new module here plus one line in ``METHODS`` (and its line of help in ``pretune.catalog``)."""

from __future__ import annotations

from types import ModuleType

from ...catalog import PEFT_METHODS
from . import adapter, bitfit, embeddings, ia3, lora, prefix, prompt

METHODS: dict[str, ModuleType] = {m.NAME: m for m in (lora, adapter, prefix, prompt, ia3, embeddings, bitfit)}
METHOD_HELP = {name: PEFT_METHODS.get(name, "") for name in METHODS}  # the catalog's help (a test: all of them)

__all__ = ["METHODS", "METHOD_HELP"]
