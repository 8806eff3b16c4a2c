"""Training compute of an objective: the floating-point operations of one training step, counted as it runs.

``step_flops(objective, model, batch)`` runs the objective's loss and its backward pass on ``batch`` under torch's
``FlopCounterMode`` and returns the counted operations. Counting the run rather than a formula covers whatever
the objective does: ELECTRA's generator (its forward, backward and the sampling pass), a head applied to the
masked positions only (masked LM), an encoder-decoder's two stacks and their target lengths (T5's objectives).
As in Kaplan et al. 2020 (6 N FLOPs per token) and Clark et al. 2020 (ELECTRA's "train FLOPs"), only matrix
products are counted (linear layers, attention scores and values, the heads); element-wise work (norms, softmax,
activations, the optimizer) is left out. A multiply-add is 2 operations.

Comparing objectives at equal compute (ELECTRA vs masked LM) is then a ratio of these counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class StepFlops:
    """Counted floating-point operations of one training step on one batch."""

    forward: int  # the loss's forward pass (with anything computed without gradient, e.g. ELECTRA's sampling)
    backward: int  # its backward pass

    @property
    def total(self) -> int:
        return self.forward + self.backward


def _cpu_attention_formulas() -> dict:
    """FlopCounterMode's attention formulas for the CPU flash kernel, which torch registers for the CUDA kernels
    only: without them the attention scores and values of an SDPA call on CPU would go uncounted."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    pairs = (("_scaled_dot_product_flash_attention_for_cpu", aten._scaled_dot_product_flash_attention),
             ("_scaled_dot_product_flash_attention_for_cpu_backward",
              aten._scaled_dot_product_flash_attention_backward))
    out = {}
    for name, cuda_op in pairs:
        formula = fc.flop_registry.get(cuda_op)  # already takes the tensors (shape-wrapped): pass it on as it is
        if hasattr(aten, name) and formula is not None:
            out[getattr(aten, name)] = _raw(formula)
    return out


def _raw(formula):
    def counted(*args, **kwargs):
        return formula(*args, **kwargs)

    counted._get_raw = True  # FlopCounterMode: do not wrap it again
    return counted


def step_flops(objective, model, batch: dict[str, torch.Tensor]) -> StepFlops:
    """The operations of one training step of ``objective`` on ``model`` for ``batch``: the loss (normalised by the
    batch's own target counts) and its backward pass, counted by torch's FlopCounterMode (matrix products only).

    Nothing of the caller's state changes: gradients already accumulated are put back, and torch's random state is
    restored (ELECTRA samples replacements).

    Args:
        objective: a pretune Objective (``objective.loss(model, batch, totals)``).
        model: the TransformerLM it trains.
        batch: a collated batch (``objective.collate(examples)``): (B, T) tensors.
    """
    params = [p for p in list(model.parameters()) + list(objective.parameters()) if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    totals = {k: float(max(v, 1)) for k, v in objective.counts(batch).items()}
    formulas = _cpu_attention_formulas()
    try:
        with torch.random.fork_rng(devices=[]):
            with FlopCounterMode(display=False, custom_mapping=formulas) as fwd:
                loss, _ = objective.loss(model, batch, totals)
            with FlopCounterMode(display=False, custom_mapping=formulas) as bwd:
                loss.backward()
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return StepFlops(forward=int(fwd.get_total_flops()), backward=int(bwd.get_total_flops()))
