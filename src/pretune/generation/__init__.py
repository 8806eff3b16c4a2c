"""Generation and prompting: decoding strategies (decode.py) and prompting without training (prompt.py)."""

from .decode import GenerationError, generate

__all__ = ["generate", "GenerationError"]
