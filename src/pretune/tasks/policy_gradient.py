"""Group-relative policy-gradient losses (GRPO and its DAPO and Dr. GRPO variants), as TRL 1.16's GRPOTrainer
computes them; the sampling loop that feeds them is tasks/grpo.py.

Each prompt is answered G times (a group: G consecutive rows); a program scores each completion (reward r). The
advantage of completion i is its reward against its group's (``scale``):

    group   A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4)      GRPO (Shao et al. 2024), TRL's default
    batch   A_i = (r_i - mean_group(r)) / (std_batch(r) + 1e-4)      PPO-Lite (Liu et al. 2025)
    none    A_i =  r_i - mean_group(r)                               Dr. GRPO (Liu et al. 2025): no difficulty bias

(std with Bessel's correction; a NaN reward, "no reward function applied", is left out of the means and gets A 0).
Every completion token t then carries the clipped surrogate of PPO with the ratio to the policy that sampled it
(``old``; the current policy detached when each batch is used for one step), and optionally a KL penalty to a
reference policy:

    rho_t  = exp(logp_t - logp_old_t)
    loss_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)  +  beta rho_t k3_t
    k3_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1              Schulman's k3 estimator of KL(pi || ref)

(``rho_t k3_t``: TRL's ``use_bias_correction_kl``, its default; without it ``k3_t`` alone). The step's loss is a
normalised sum over completion tokens (``loss_type``; :func:`reduce_loss`):

    dapo     sum_{i,t} loss_t / (completion tokens of the step)       DAPO (Yu et al. 2025), TRL's default
    grpo     sum_i mean_t loss_t / (sequences of the step)            GRPO: a short completion's tokens weigh more
    dr_grpo  sum_{i,t} loss_t / (sequences x max_completion_length)   Dr. GRPO: a constant, no length bias
    bnpo     mean over micro-batches of each one's token mean         TRL's bnpo (local token normalisation)

The functions are pure (tensors in, tensors out) so that the trainer decides what a batch is: :func:`reduce_loss`
returns a numerator and the name of the unit it is to be divided by, totalled over the whole optimizer step.
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")  # group_advantages(scale=...)
LOSS_UNITS = {"dapo": "tokens", "grpo": "sequences", "dr_grpo": "sequences", "bnpo": "micro_batches"}  # loss type ->
# the unit its numerator is divided by, totalled over the optimizer step (reduce_loss)
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4); a zero-std group gets advantages 0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, dict]:
    """Group-relative advantages of a batch of scored completions, and the reward statistics TRL logs.

    The sum_then_normalize path of TRL's ``GRPOTrainer._generate_and_score_completions`` (its default
    ``multi_objective_aggregation``), formulas in the module docstring.

    Args:
        rewards: (N,) the weighted total reward of each completion: as TRL builds it, the weighted sum over the
            reward functions with a None (not applicable) counting 0, and NaN where every function returned None
            (such a row is left out of its group's mean and std and of the statistics, and its advantage is 0).
            Rows come in groups: rows ``k*G .. k*G + G-1`` are the G completions of prompt k.
        group_size: G, the completions per prompt; must divide N.
        scale: "group" (divide by the group's std), "batch" (by the std of all N rewards) or "none" (no division).
    Returns:
        (advantages (N,), stats) with stats, as Python floats under TRL's names:
            "reward": the mean of the N rewards (over the rows with a reward, NaN rows left out);
            "reward_std": their standard deviation (Bessel's correction) over all N rows, not per group; NaN when
                fewer than two rows have a reward;
            "frac_reward_zero_std": the fraction of the N rows (a mean over rows, not groups) whose std, the one
                ``scale`` uses ("none": the group's), is zero (to ``torch.isclose``); with "batch" it is 0 or 1.
    Across processes: TRL gathers every process's rewards before this computation, so the exact equivalent is to
    all-gather the (N,) rewards of the global batch (a few floats) and call this once on them, each process keeping
    its own rows of the advantages. With whole groups on each process, "group" and "none" advantages are the same
    computed locally; "batch" advantages and the three statistics are not: "reward" and "frac_reward_zero_std" are
    means over rows (reduce weighted by the count of rows with a reward, resp. of rows), "reward_std" is not a mean
    (combine counts, means and variances), "batch" needs the global std.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected (N,), one total per completion")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of rewards ({rewards.numel()})")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {', '.join(SCALES)}")
    grouped = rewards.view(-1, group_size)  # (N/G, G): one row per prompt
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)  # (N,)
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:  # "none" computes the group std only to count zero-std groups, as TRL does
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)  # TRL: rows with no reward carry no signal
    stats = {"reward": torch.nanmean(rewards).item(), "reward_std": _nanstd(rewards).item(),
             "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    return advantages, stats


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the std of the non-NaN values with Bessel's correction, NaN for fewer than two."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def token_losses(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
                 *, epsilon_low: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                 ref_logps: torch.Tensor | None = None, kl_ratio: bool = True) -> dict:
    """Per-token clipped-surrogate losses (and KL penalty) of a batch of completions, as TRL's
    ``GRPOTrainer._compute_loss`` computes ``per_token_loss`` for loss types grpo, bnpo, dr_grpo and dapo
    (``importance_sampling_level="token"``, no ``delta``, no entropy mask or bonus, no vLLM correction).

    Args:
        logps: (N, T) log-probabilities of the completion tokens under the policy being trained (with gradient);
            T the longest completion, positions past a completion's end finite (e.g. 0) and masked out.
        old_logps: (N, T) the same under the policy that sampled them (TRL's ``old_per_token_logps``: kept from
            generation when a batch serves several optimizer steps, ``num_iterations`` > 1); None: ``logps``
            detached, the ratio 1 with the gradient of ``logps`` (TRL with ``num_iterations=1``).
        advantages: (N,) one per completion (:func:`group_advantages`), or (N, T) one per token.
        mask: (N, T) 1 for completion tokens, 0 for padding (bool, int or float).
        epsilon_low, epsilon_high: the ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] (TRL's ``epsilon``,
            ``epsilon_high``); epsilon_high None: epsilon_low (TRL). DAPO's clip-higher uses 0.28.
        beta: the weight of the KL penalty to the reference (0: none, ref_logps unused; TRL's default).
        ref_logps: (N, T) log-probabilities under the reference policy; needed when beta != 0.
        kl_ratio: the KL term is weighted by the (differentiable) ratio rho_t (TRL's ``use_bias_correction_kl``,
            default True: the unbiased reverse-KL gradient off-policy, DeepSeek-V3.2); False: k3_t alone.
    Returns:
        A dict of (N, T) tensors, zero at padding:
            "loss": loss_t of the module docstring, with gradient (the KL term included when beta != 0);
            "ratio": rho_t, detached;
            "clip_low": 1 where rho_t < 1 - epsilon_low and A < 0 (TRL's ``is_low_clipped``), detached;
            "clip_high": 1 where rho_t > 1 + epsilon_high and A > 0 (``is_high_clipped``);
            "clip_region": clip_low or clip_high (``is_region_clipped``);
            "kl" (only when beta != 0): the KL term without beta (``per_token_kl``: rho_t k3_t, or k3_t), detached.
        TRL's metrics from them, each a token mean over the micro-batch's completion tokens on all processes (sum
        the (N, T) values and the mask, reduce both, divide): ``kl``, ``clip_ratio/low_mean``,
        ``clip_ratio/high_mean``, ``clip_ratio/region_mean``; and per sequence (x.sum(-1) / mask.sum(-1), gathered
        over processes, NaN for an empty completion left out): ``clip_ratio/low_min`` the min of clip_low's,
        ``clip_ratio/high_max`` the max of clip_high's. TRL appends one value per micro-batch and logs their mean.
    """
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError(f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must both be (N, T)")
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None and x.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected logps' {tuple(logps.shape)}")
    if advantages.shape not in (logps.shape[:1], logps.shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({logps.shape[0]},) or "
                         f"{tuple(logps.shape)}")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low={epsilon_low} and epsilon_high={epsilon_high} must be >= 0")
    if beta < 0:
        raise ValueError(f"beta={beta} must be >= 0 (0: no KL penalty)")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps, the reference policy's log-probabilities")
    old_logps = logps.detach() if old_logps is None else old_logps
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (N, 1) or (N, T)
    m = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)  # (N, T) rho_t
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)  # PPO's pessimistic surrogate (Schulman et al. 2017)
    out = {}
    if beta != 0:
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1  # k3 (Schulman 2020, "Approximating KL divergence"), >= 0
        if kl_ratio:
            kl = kl * ratio  # TRL's use_bias_correction_kl (DeepSeek-V3.2 eq. 8)
        loss = loss + beta * kl
        out["kl"] = (kl * m).detach()
    low = (ratio < 1 - epsilon_low) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    out.update({"loss": loss * m, "ratio": (ratio * m).detach(), "clip_low": low.to(m.dtype) * m,
                "clip_high": high.to(m.dtype) * m, "clip_region": (low | high).to(m.dtype) * m})
    return out


def reduce_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, *,
                max_completion_length: int | None = None) -> tuple[torch.Tensor, str]:
    """One micro-batch's share of the step's loss: a numerator, and the unit the caller divides it by once totalled
    over the whole optimizer step (every micro-batch of gradient accumulation, every process).

    Args:
        per_token_loss: (N, T) :func:`token_losses`'s "loss".
        mask: (N, T) 1 for completion tokens, 0 for padding.
        loss_type: "dapo", "grpo", "dr_grpo" or "bnpo" (TRL's ``loss_type``).
        max_completion_length: the sampler's limit on new tokens (dr_grpo's constant; unused by the others).
    Returns:
        (numerator: a scalar with gradient, unit: ``LOSS_UNITS[loss_type]``):
            dapo     sum_{i,t} loss_t                          "tokens": completion tokens (mask.sum())
            grpo     sum_i (sum_t loss_t / n_i)                "sequences": completions (N), n_i = max(1, mask_i.sum())
            dr_grpo  sum_{i,t} loss_t / max_completion_length  "sequences"
            bnpo     sum_{i,t} loss_t / max(1, mask.sum())     "micro_batches": 1 per micro-batch
        The step's loss is sum(numerators) / total(unit); with a loop that averages gradients over P processes
        (DDP), each process backpropagates P * numerator / total (TRL: ``num_items_in_batch / num_processes``).
    Equal to TRL's: with TRL's equal-sized micro-batches and its ``steps_per_generation`` equal to the gradient
    accumulation (its default), grpo and dr_grpo are TRL's per-micro-batch means divided by the accumulation steps,
    and dapo is TRL's ``num_items_in_batch`` normalisation. (TRL with ``steps_per_generation`` > accumulation
    divides dapo by the generation batch's tokens per optimizer step on average, not the step's own; pass that
    total to reproduce it.) bnpo normalises by each micro-batch's own tokens in TRL, which no step-wide token total
    reproduces; as the mean over micro-batches of their token means it is TRL's for every accumulation and process
    count (one micro-batch of one process: the numerator itself), and it depends on how the step is split, as
    TRL's does.
    """
    if per_token_loss.shape != mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} must both be "
                         "(N, T)")
    if loss_type not in LOSS_UNITS:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(LOSS_UNITS)}")
    m = mask.to(per_token_loss.dtype)
    summed = per_token_loss * m  # (N, T)
    if loss_type == "dapo":
        numerator = summed.sum()
    elif loss_type == "grpo":
        numerator = (summed.sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    elif loss_type == "dr_grpo":
        if not max_completion_length or max_completion_length < 1:
            raise ValueError(f"loss_type='dr_grpo' needs max_completion_length >= 1, got {max_completion_length!r}")
        numerator = summed.sum() / max_completion_length
    else:  # bnpo
        numerator = summed.sum() / m.sum().clamp(min=1.0)
    return numerator, LOSS_UNITS[loss_type]
