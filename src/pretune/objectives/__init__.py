"""Pretraining objectives: data collators and the losses that turn hidden states into training signal."""

from .losses import causal_lm_loss, masked_lm_loss

__all__ = ["causal_lm_loss", "masked_lm_loss"]
