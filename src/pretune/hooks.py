"""Late-bound calls: a function a lower layer calls and a higher layer supplies, so that the call needs no import
up the layers (docs/architecture.md). Imports nothing of pretune, no torch.

``HOOKS`` maps a name to the function:

- ``"generate"``: what ``TransformerLM.generate(input_ids, ...)`` (the model layer) calls, with the model first;
  ``pretune/__init__.py`` sets it to ``pretune.generate`` (the generation package, imported on the first call).
  Python runs ``pretune/__init__.py`` before any ``pretune.*`` module, so the hook is there however the model
  was imported (``import pretune`` or ``from pretune.model import build_model``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HOOKS: dict[str, Callable[..., Any]] = {}
