"""Generation and prompting: decoding strategies (decode.py) and prompting without training (prompt.py).

``generate`` and ``GenerationError`` are imported on first use, so ``pretune.generation.prompt`` (templates, chat
templates; what the command line's parser reads) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["generate", "GenerationError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".decode", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from .decode import GenerationError, generate
