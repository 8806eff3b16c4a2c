"""Finetuning settings chosen from the data: the batch size and the number of epochs (hence the optimizer steps) from
the number of training examples, the learning rate from the method, the warmup from the steps — what a careful
practitioner picks for a dataset of that size, so that ``pretune finetune --train my.jsonl`` learns with no other
flag. Anything the user sets wins; only what is left to choose (``train.batch_size=0``, ``tune.epochs=auto``,
``train.lr=0``) is chosen here, and :func:`choose` says why in words the run prints and run.yaml keeps.

The rule (measured on the bundled tasks at 100 to 3,000 rows against a grid of fixed settings:
docs/finetune.md, "Defaults chosen by the data"):

* **batch size**: 8 below 500 examples, 16 below 2,000, 32 from there — small data needs many small updates more
  than it needs a smooth gradient (transformers' Trainer uses 8; BERT's paper searched 16 and 32 on GLUE's
  thousands of examples);
* **epochs**: as many as give at least ``MIN_STEPS`` optimizer steps, between ``MIN_EPOCHS`` and ``MAX_EPOCHS``:
  300 examples in batches of 8 are 37 steps an epoch, so 7 epochs; 3,000 in batches of 32 are 93, so the 3 epochs
  every size gets anyway. Keep-best on the dev set takes the best epoch, so a few epochs too many cost time, not
  accuracy;
* **learning rate**: the method's (full finetuning 5e-5, each PEFT method its own, a linear probe 1e-2);
* **warmup**: ``tune.warmup_ratio`` of the steps (10%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AUTO = "auto"  # tune.epochs=auto: chosen from the data
MIN_STEPS = 250  # optimizer steps a run on small data gets at least (through its number of epochs)
MIN_EPOCHS, MAX_EPOCHS = 3, 20
BATCH_SIZES = ((500, 8), (2000, 16))  # (fewer examples than this, batch size); from 2,000 on: LARGE_BATCH
LARGE_BATCH = 32


def batch_size_for(n_examples: int) -> int:
    """The batch size for ``n_examples`` training examples (rows after packing)."""
    return next((bs for below, bs in BATCH_SIZES if n_examples < below), LARGE_BATCH)


def epochs_for(steps_per_epoch: int) -> int:
    """Epochs that give at least MIN_STEPS optimizer steps, within [MIN_EPOCHS, MAX_EPOCHS]."""
    return min(MAX_EPOCHS, max(MIN_EPOCHS, math.ceil(MIN_STEPS / max(1, steps_per_epoch))))


@dataclass
class Choice:
    """What :func:`choose` chose (None: the user set it) and, per config key, why."""

    batch_size: int | None = None
    epochs: float | None = None
    why: dict[str, str] = field(default_factory=dict)  # config key -> the reason, for run.yaml and --print-config

    def line(self, n_examples: int, *, steps: int, lr: str = "", warmup: str = "") -> str:
        """The run's first line on what was chosen (``lr``, ``warmup``: the learning rate's and warmup's words when
        they were chosen too), or "" when the user set all of it."""
        parts = []
        if self.batch_size is not None:
            parts.append(f"batch {self.batch_size} (8 below 500 examples, 16 below 2,000, 32 from there)")
        if self.epochs is not None:
            parts.append(f"{self.epochs:g} epochs = {steps} optimizer steps (at least {MIN_STEPS}, in {MIN_EPOCHS} to "
                         f"{MAX_EPOCHS} epochs; keep-best takes the best epoch on dev)")
        parts += [p for p in (lr, warmup) if p]
        if not parts:
            return ""
        return (f"defaults for {n_examples:,} training examples: {', '.join(parts)}; --batch-size, --epochs and --lr "
                "set them yourself")


def choose(n_examples: int, *, batch_size: int, epochs: float | str, steps: int, grad_accum: int = 1) -> Choice:
    """Batch size and epochs for ``n_examples`` training examples, where the user left them to choose
    (``batch_size`` 0, ``epochs`` "auto" — unless ``steps`` was set, which then decides the length)."""
    out = Choice()
    if not batch_size:
        bs = min(batch_size_for(n_examples), max(1, n_examples))
        bs = max(grad_accum, bs - bs % grad_accum)  # divisible by the accumulation micro-batches
        out.batch_size = bs
        out.why["train.batch_size"] = (f"chosen for {n_examples:,} training examples: 8 below 500, 16 below 2,000, "
                                       "32 from there")
    if epochs == AUTO and not steps:
        per_epoch = max(1, n_examples // (out.batch_size or batch_size))
        out.epochs = float(epochs_for(per_epoch))
        out.why["tune.epochs"] = (f"chosen: at least {MIN_STEPS} optimizer steps ({per_epoch} per epoch), "
                                  f"{MIN_EPOCHS} to {MAX_EPOCHS} epochs")
    return out
