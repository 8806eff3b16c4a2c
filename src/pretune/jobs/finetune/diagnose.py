"""Did training take? After a finetuning run: its dev score against what a model that ignores its input scores (the
task's baseline, ``Task.baseline``: the majority class, the mean value, the most frequent tag, no answer), and its
train loss over the last steps against the first (the ``TrainLosses`` callback). A run that fails either check gets
a warning naming the numbers and what to try next, printed at the end of the run and kept in ``results.json``
(``"warnings"``) for sweeps and scripts.

    baseline, warnings = check_training(job, trainer, steps, dev=dev_final, test=test_metrics)
"""

from __future__ import annotations

import math

from .prepare import Prepared

MARGIN = 0.01  # a score within 1% of the baseline's (at least 0.01) is no better than it
LOSS_DROP = 0.01  # a train loss that fell by less than 1% from the first steps to the last did not fall
FRACTION = 0.1  # the share of the steps whose losses are averaged at either end


def check_training(job: Prepared, trainer, steps: int, *, dev: dict, test: dict) -> tuple[dict | None, list[dict]]:
    """The baseline as ``results.json`` keeps it (``{"what", "split", metric: value, ...}``; None when the task
    has none) and the warnings: each a dict with ``kind`` (``no_better_than_baseline``, ``loss_did_not_fall``),
    its numbers and ``message``; both carry ``next``, what to try. ``dev`` / ``test``: the run's final metrics
    (the dev metric is judged, the test one when there is no dev score)."""
    from ...train.callbacks import TrainLosses

    task, metric = job.task, job.metric
    split, scores = ("dev", dev) if metric in dev else ("test", test)
    warnings = []
    baseline = None
    base = task.baseline(job.records["train"], job.records[split]) if metric in scores else None
    if base is not None:
        baseline = {"what": base.what, "split": split, **base.metrics}
    if base is not None and metric in base.metrics:
        value, floor = float(scores[metric]), float(base.metrics[metric])
        tol = MARGIN * max(abs(floor), 1.0)
        if (value <= floor + tol) if task.higher_is_better(metric) else (value >= floor - tol):
            warnings.append({"kind": "no_better_than_baseline", "split": split, "metric": metric, "value": value,
                             "baseline": floor, "baseline_what": base.what,
                             "message": f"{split} {metric} {value:.4f} is no better than {base.what}, which scores "
                                        f"{floor:.4f}"})
    losses = next((cb for cb in trainer.callbacks if isinstance(cb, TrainLosses)), None)
    # an on-policy task's (grpo's) loss is a policy-gradient surrogate near 0 at every step, not a fit to data
    on_policy = getattr(task, "rollout", None) is not None
    trend = losses.trend(FRACTION) if losses is not None and not on_policy else None
    if trend is not None:
        first, last, k = trend
        if last > first * (1 - LOSS_DROP):
            n = len(losses.losses)
            warnings.append({"kind": "loss_did_not_fall", "first": first, "last": last, "steps_averaged": k,
                             "message": f"the train loss did not fall: {first:.4f} over the first {k} of {n} steps, "
                                        f"{last:.4f} over the last {k}"})
    if warnings:
        advice = next_step(job, steps, stopped_early=trainer.stopped_early)
        for w in warnings:
            w["next"] = advice
    return baseline, warnings


def next_step(job: Prepared, steps: int, *, stopped_early: bool = False) -> str:
    """What to try after a run that did not take: more epochs, a higher learning rate, the labels."""
    cfg, tr = job.cfg, job.cfg.train
    per_epoch = max(1, len(job.features["train"]) // tr.batch_size)  # as prepare derives train.steps
    epochs = steps / per_epoch
    ran = (f"this run took {steps} optimizer steps ({epochs:.3g} epochs of {per_epoch} step{'s' * (per_epoch > 1)} "
           f"of {tr.batch_size} examples) at lr {tr.lr:g}")
    if stopped_early:
        ran += f", stopped early (tune.patience={cfg.tune.patience})"
    default = job.method.default_lr
    higher = default if tr.lr < default / 3 else 3 * tr.lr
    tries = [f"--epochs {max(3, math.ceil(2 * epochs))}", f"a higher --lr (e.g. --lr {higher:g})"]
    if stopped_early:
        tries.append(f"a larger --patience than {cfg.tune.patience}")
    return f"{ran}; try {', '.join(tries)}, and check the labels in {cfg.data.train}"


def format_warnings(warnings: list[dict]) -> str:
    """The lines a run prints at its end: the findings, then what to try."""
    if not warnings:
        return ""
    return ("warning: training did not take: " + "; ".join(w["message"] for w in warnings) + ".\n  next: "
            + warnings[0]["next"] + ".")
