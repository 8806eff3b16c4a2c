"""``pretune sweep``: one base run, a grid (and random search) over its config keys, several seeds; every trial an
ordinary pretune run in its own folder, the results aggregated over seeds into tables and plots.

    from pretune.sweep import run_sweep
    result = run_sweep("configs/sweep/lora-lr.yaml", jobs=2)
    for s in result.settings:     # one per setting: params, seeds, metrics {name: {mean, std, values}}
        print(s["setting"], s["metrics"]["test.accuracy"]["mean"])
    result.rows                   # one per trial (results.jsonl): params, seed, status, metrics, wall_seconds

The spec (YAML, or the same as a dict)::

    command: finetune                  # pretrain | finetune | prompt
    base:                              # the same in every trial
      config: configs/finetune/classification.yaml   # optional base config file (pretrain, finetune)
      model.init: ${realmodel:minilm}  # then config keys, as `section.key=value` on the command line
      peft.method: lora                # (nested sections work too: `train: {batch_size: 16}`)
      data.train_limit: 500
    grid:                              # cartesian product over these keys
      train.lr: [1e-4, 1e-3]
      peft.r: [4, 8]
    cases:                             # optional: settings whose keys vary together, each joins every grid point
      - {tune.epochs: 2, tune.evals_per_epoch: 1}
      - {tune.epochs: 4, tune.evals_per_epoch: 2}
    random:                            # optional random search; each draw joins every grid point
      n: 8
      seed: 0
      space:
        tune.warmup_ratio: {uniform: [0.0, 0.2]}          # also log_uniform, int_uniform: [low, high]
        train.batch_size: {choice: [16, 32]}              # and choice: [values]
    seeds: [0, 1, 2]                   # every setting runs once per seed (train.seed; prompt: --seed)
    metrics: [test.accuracy, test.macro_f1]               # reported per trial, mean ± std per setting
    out: runs/sweep-lora                                  # the sweep folder

For ``command: prompt`` the keys are the prompt command's options without ``--`` (``model`` is MODEL, the
positional; ``shots: 4``, ``order: shuffle``, ``calibrate: true``) and the metrics are ``metrics.accuracy``,
``metrics.macro_f1``. ``${bundled:PATH}`` is a bundled data file, ``${realmodel:minilm}`` (or ``smollm2``) an
offline real checkpoint. Metric names: :mod:`pretune.sweep.report`. The folder's layout and how a rerun
continues: :mod:`pretune.sweep.engine`.
"""

from .engine import aggregate, cores, launch_mode, plan, run_sweep
from .report import SweepResult, aggregate_rows, available_metrics, metric_value, trial_metrics
from .spec import COMMANDS, SweepSpec, Trial, check_trials, draws, expand, load_spec

__all__ = ["run_sweep", "plan", "aggregate", "load_spec", "expand", "draws", "check_trials", "SweepSpec", "Trial",
           "SweepResult", "aggregate_rows", "trial_metrics", "metric_value", "available_metrics", "launch_mode",
           "cores", "COMMANDS"]
