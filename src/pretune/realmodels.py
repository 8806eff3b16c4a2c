"""Where users import the offline real checkpoints from (``from pretune.realmodels import minilm_dir``); they
live in :mod:`pretune.io.realmodels`."""

from .io.realmodels import SMOLLM2_GGUF, minilm_dir, smollm2_dir, smollm2_gguf

__all__ = ["minilm_dir", "smollm2_dir", "smollm2_gguf", "SMOLLM2_GGUF"]
