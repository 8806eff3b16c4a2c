"""Shared by the decoder-option property tests: a model with every tensor perturbed, and token ids."""

from __future__ import annotations

import torch

from pretune import ModelConfig, build_model

V = 100  # vocabulary of the tiny test configs


def perturbed(cfg: ModelConfig, seed: int = 0):
    """Norm weights start at 1 and biases at 0: perturb every tensor so each one takes part."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))
