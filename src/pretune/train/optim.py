"""AdamW with decay/no-decay parameter groups, and learning-rate schedules with warmup.

The update rule is the AdamW of the seeds (PyTorch's documented pseudo-code): decoupled weight decay
``θ ← θ − γλθ``, bias-corrected moments, optional AMSGrad. ``torch.optim.AdamW`` runs it for
``amsgrad=False``; for ``amsgrad=True`` PyTorch takes the maximum of the *raw* second moment and
bias-corrects afterwards, whereas the seeds take the maximum of the *bias-corrected* one
(pytorch/pytorch#142323: PyTorch changed its docs, the seeds keep the old rule), so
:class:`SeedsAMSGradAdamW` runs that branch.

Schedules are multipliers of the base lr, one per optimizer step, for ``LambdaLR``::

    opt = build_optimizer(model, lr=3e-4, weight_decay=0.1)
    sched = build_scheduler(opt, "cosine", warmup_steps=100, total_steps=10_000, min_lr_ratio=0.1)
    for batch in data: loss(batch).backward(); opt.step(); sched.step(); opt.zero_grad()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

SCHEDULES = ("linear", "cosine", "constant", "inverse_sqrt")


def _is_norm(module: nn.Module) -> bool:
    # LayerNorm, RMSNorm (torch's and pretune's), BatchNorm*, GroupNorm, InstanceNorm*
    return "norm" in type(module).__name__.lower()


def param_groups(modules: nn.Module | Sequence[nn.Module], weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices, none on biases and norm scales.

    A trainable parameter is decayed when it has ``ndim >= 2`` and does not belong to a norm module;
    biases, LayerNorm/RMSNorm weights and every other 1-D parameter get ``weight_decay=0``. Token and
    position embeddings are matrices and are decayed, as in GPT-2/nanoGPT and the Hugging Face
    Trainer (which exclude only biases and norm weights); BERT's original code decays them as well.

    Args:
        modules: one module, or several (e.g. model and head) whose parameters are pooled. A parameter
            shared between them (tied embeddings) is listed once, under its first name.
        weight_decay: λ of the decayed group (>= 0).

    Returns:
        Up to two groups, ``{"params", "weight_decay", "names"}``, decayed group first; empty groups
        are left out. ``names`` are ``named_parameters`` names (prefixed ``"{i}."`` when a sequence of
        modules is given), for debugging and for checking which tensors decay.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay ({weight_decay}) must be >= 0")
    mods = [modules] if isinstance(modules, nn.Module) else list(modules)
    decay: dict[str, list] = {"params": [], "names": []}
    no_decay: dict[str, list] = {"params": [], "names": []}
    seen: set[int] = set()
    for i, root in enumerate(mods):
        if not isinstance(root, nn.Module):
            raise TypeError(f"param_groups expects nn.Module(s), got {type(root).__name__}")
        prefix = f"{i}." if len(mods) > 1 or not isinstance(modules, nn.Module) else ""
        for mod_name, mod in root.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                group = decay if p.ndim >= 2 and not _is_norm(mod) else no_decay
                group["params"].append(p)
                group["names"].append(prefix + (f"{mod_name}.{p_name}" if mod_name else p_name))
    if not seen:
        raise ValueError("no trainable parameters (requires_grad=True) in the given module(s)")
    groups = [{**decay, "weight_decay": weight_decay}, {**no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class SeedsAMSGradAdamW(torch.optim.AdamW):
    """AdamW whose AMSGrad branch keeps the maximum of the bias-corrected second moment, as the seeds:
    ``v̂ₜᵐᵃˣ = max(v̂ₜ₋₁ᵐᵃˣ, vₜ/(1−β₂ᵗ))``; ``torch.optim.AdamW`` keeps ``max(vₜ)`` and divides by
    ``1−β₂ᵗ`` afterwards, which is smaller after a large early gradient. Groups with
    ``amsgrad=False`` follow the same loop and equal ``torch.optim.AdamW``. A plain per-parameter loop:
    no fused/foreach kernels, no sparse or complex parameters."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or p.is_complex():
                    raise RuntimeError("SeedsAMSGradAdamW supports dense real parameters only")
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq_hat"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * wd)  # θ ← θ − γλθ (decoupled decay)
                m.lerp_(g, 1 - beta1)  # m ← β₁m + (1−β₁)g
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v ← β₂v + (1−β₂)g²
                v_hat = v / (1 - beta2**t)
                if group["amsgrad"]:
                    v_hat = torch.maximum(state["max_exp_avg_sq_hat"], v_hat, out=state["max_exp_avg_sq_hat"])
                denom = v_hat.sqrt().add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))  # θ ← θ − γ m̂/(√v̂ + ε), m̂ = m/(1−β₁ᵗ)
        return loss


def build_optimizer(
    modules: nn.Module | Sequence[nn.Module],
    *,
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    amsgrad: bool = False,
    fused: bool | None = None,
    param_lr: dict[int, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups` of ``modules``.

    Args:
        modules: model (or models) whose trainable parameters are optimised.
        lr: base (peak) learning rate γ; a scheduler multiplies it.
        weight_decay: decoupled decay λ for matrices; biases and norms get 0.
        betas, eps: moment decay rates (β₁, β₂) and the denominator's ε.
        amsgrad: keep the running maximum of the bias-corrected second moment (seeds' AMSGrad,
            :class:`SeedsAMSGradAdamW`; no fused kernel).
        fused: ``torch.optim.AdamW``'s fused kernel (CUDA/CPU); None lets torch choose.
        param_lr: ``id(parameter) -> learning rate`` for parameters that learn at their own rate (e.g. a task
            head, ``tune.head_lr``); they get groups of their own, which a scheduler scales like the others.

    Returns:
        ``torch.optim.AdamW`` (or its :class:`SeedsAMSGradAdamW` subclass when ``amsgrad``).
    """
    groups = param_groups(modules, weight_decay)
    if param_lr:
        groups = _split_by_lr(groups, param_lr)
    if amsgrad:
        if fused:
            raise ValueError("fused=True is not available with amsgrad=True (the seeds' AMSGrad runs a plain loop)")
        return SeedsAMSGradAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=True)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)
    if fused:
        optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer, args, kwargs) -> None:
    """After a fused step: the fused kernel writes the parameters without bumping their version counters, which the
    fast wing's caches read to see a change (the LM head cast to bf16 once, stacked weights for sampling)."""
    torch.autograd.graph.increment_version([p for group in optimizer.param_groups for p in group["params"]])


def _split_by_lr(groups: list[dict], param_lr: dict[int, float]) -> list[dict]:
    """Each group split into its parameters at the base rate and one group per rate of ``param_lr``."""
    out = []
    for g in groups:
        by_lr: dict[float | None, dict] = {}
        for p, name in zip(g["params"], g["names"]):
            lr = param_lr.get(id(p))
            sub = by_lr.setdefault(lr, {"params": [], "names": [], "weight_decay": g["weight_decay"]})
            sub["params"].append(p)
            sub["names"].append(name)
        for lr, sub in by_lr.items():
            out.append(sub if lr is None else {**sub, "lr": lr})
    return out


def lr_lambda(
    name: str, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """Multiplier of the base lr for the update made after ``step`` updates (``step`` = 0, 1, ...).

    With warmup k = ``warmup_steps``, total T = ``total_steps`` and r = ``min_lr_ratio``:

    - ``linear``: ``step/k`` while ``step < k``, then ``r + (1−r)·(T−step)/(T−k)``, r from T on.
    - ``cosine``: the same warmup, then ``r + (1−r)·½(1 + cos(π·(step−k)/(T−k)))``, r from T on.
    - ``constant``: the same warmup, then 1.
    - ``inverse_sqrt`` (T5, Raffel et al. 2019 §3.1.2): ``lr(n) = lr_base·√k / √max(n, k)``, i.e. the
      multiplier ``√(k / max(n, k))``: 1 for the first k steps (T5 holds the lr *constant* during
      "warmup", there is no ramp), then decaying as 1/√n; floored at r. T5's absolute rule
      ``1/√max(n, k)`` (0.01 for k = 10⁴) is this with ``lr_base = 1/√k``. k = 0 is read as k = 1.

    The warmup ramp follows ``transformers.get_*_schedule_with_warmup``: the first update has lr 0
    (it still fills Adam's moment estimates) and the k-th update the full lr. ``min_lr_ratio`` is
    unused by ``constant``.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be >= 0")
    if total_steps < 1:
        raise ValueError(f"total_steps ({total_steps}) must be >= 1")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio ({min_lr_ratio}) must be in [0, 1]")
    if name in ("linear", "cosine") and warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps}) for {name!r}")
    k, total, r = warmup_steps, total_steps, min_lr_ratio

    def decay_progress(step: int) -> float:  # 0 at the end of warmup, 1 at total_steps and after
        return 1.0 if step >= total else (step - k) / (total - k)

    if name == "inverse_sqrt":
        k_eff = max(k, 1)

        def inverse_sqrt(step: int) -> float:
            return max(r, math.sqrt(k_eff / max(step, k_eff)))  # T5: 1/sqrt(max(n, k)) · sqrt(k)

        return inverse_sqrt

    def warmup_then(after: Callable[[int], float]) -> Callable[[int], float]:
        def schedule(step: int) -> float:
            return step / k if step < k else after(step)

        return schedule

    if name == "linear":
        return warmup_then(lambda step: r + (1.0 - r) * (1.0 - decay_progress(step)))
    if name == "cosine":
        return warmup_then(lambda step: r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * decay_progress(step))))
    return warmup_then(lambda step: 1.0)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    name: str,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` applying :func:`lr_lambda` to every group; call ``step()`` after each
    ``optimizer.step()``.

    The schedule is a closure, so ``state_dict()`` stores only the position (``last_epoch``) and base
    lrs: a resumed run may change ``total_steps``. To resume, build the optimizer and this scheduler
    first, then ``optimizer.load_state_dict(...)`` and ``scheduler.load_state_dict(...)`` — building
    the scheduler after loading the optimizer resets the groups' lr to the step-0 value until the
    next ``scheduler.step()``.
    """
    fn = lr_lambda(name, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


__all__ = [
    "SCHEDULES", "SeedsAMSGradAdamW", "build_optimizer", "build_scheduler", "lr_lambda", "param_groups",
]
