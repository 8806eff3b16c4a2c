"""``pretune experiment NAME``: the lectures' findings, re-run with one command each, built on ``pretune sweep``.

Each experiment is a module here with an :class:`Experiment` subclass: the lecture's claim (one sentence, with its
source), the sweep(s) it runs at each size (``fast`` for the test suite, ``default`` for <= 20 minutes on 2 CPU
cores, ``large`` for bigger machines) and the rule that turns the measured numbers into a verdict per claim:
"confirmed" when the claimed ordering holds beyond the seed-to-seed spread, "not confirmed at this scale"
otherwise, with the margin and the spread in words.

    from pretune.experiments import run_experiment
    result = run_experiment("pretrained-vs-scratch", size="fast", out="runs/x", jobs=2)
    result.verdict          # ("confirmed", "1 of 1 claims confirmed: ...")
    for f in result.findings:
        print(f.claim.key, f.label, f.explanation)

Adding one: a module with ``EXPERIMENT = MyExperiment()`` and one line in ``EXPERIMENTS`` below
(docs/experiments.md, "Adding an experiment").
"""

from __future__ import annotations

from . import (
    few_shot,
    ffn_variants,
    masking,
    mlm_vs_electra,
    peft_vs_data,
    positions,
    pretrained_vs_scratch,
    rlvr,
    t5_objectives,
    warmup_batch,
)
from .base import CONFIRMED, NOT_CONFIRMED, SIZES, Claim, Experiment, Finding, Results, Sweep
from .runner import ExperimentResult, get_experiment, run_experiment

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    pretrained_vs_scratch.EXPERIMENT,
    positions.EXPERIMENT,
    peft_vs_data.EXPERIMENT,
    mlm_vs_electra.EXPERIMENT,
    t5_objectives.EXPERIMENT,
    ffn_variants.EXPERIMENT,
    masking.EXPERIMENT,
    few_shot.EXPERIMENT,
    warmup_batch.EXPERIMENT,
    rlvr.EXPERIMENT,
)}

__all__ = ["EXPERIMENTS", "Experiment", "Claim", "Finding", "Results", "Sweep", "ExperimentResult", "run_experiment",
           "get_experiment", "SIZES", "CONFIRMED", "NOT_CONFIRMED"]
