"""``pretune sweep SPEC.yaml``: a grid / random search over config keys x seeds, each trial an ordinary run.

``python -m pretune.cli.sweep --check-prompt`` (JSON list of argument lists on stdin, JSON list of errors or
null on stdout) is how the sweep engine checks prompt trials' options with this command line's own parser
before any trial runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import textwrap

SWEEP_DESCRIPTION = (
    "Run a sweep: one base run of pretune pretrain, finetune or prompt, a grid (cartesian product) and/or random "
    "search over its config keys, each setting once per seed. Every trial is an ordinary run in "
    "OUT/trials/<name>, launched as its own process (--jobs at a time, torch threads split between them: "
    "train.threads = cores // jobs). Every trial's config is checked before any runs. Rerunning the same "
    "command continues the sweep: finished trials are skipped, interrupted ones resume from their checkpoint, "
    "failed ones run again. A live table shows each trial's state and metrics; at the end (and on every rerun) "
    "OUT holds results.jsonl and results.csv (a row per trial), summary.md (a row per setting: mean ± std over "
    "seeds), curves.png (training and eval curves) and bars.png (means with std error bars).")

SWEEP_EPILOG = """spec (YAML):
  command: finetune                    # pretrain | finetune | prompt
  base:                                # the same in every trial
    config: configs/finetune/classification.yaml     # optional base config file
    model.init: ${realmodel:minilm}    # config keys as in section.key=value (prompt: its options, no --)
    peft.method: lora
    data.train_limit: 500              # a seeded subsample of the training records
    tune.epochs: 1
  grid:                                # every combination of these values
    train.lr: [3e-4, 1e-3, 3e-3]
  random:                              # optional: n draws, each combined with every grid point
    n: 4
    seed: 0
    space: {peft.r: {choice: [4, 8, 16]}, tune.warmup_ratio: {uniform: [0, 0.2]}}   # + log_uniform, int_uniform
  seeds: [0, 1]                        # each setting once per seed (sets train.seed; prompt: --seed)
  metrics: [test.accuracy, test.macro_f1]
  out: runs/sweep-lora-lr

metrics: finetune test.X / dev.X (results.json: accuracy, macro_f1, mcc, pearson, ...); pretrain eval.X / train.X
(the last metrics.jsonl record: eval.loss, eval.mlm_loss, eval.lm_ppl, ...); prompt metrics.accuracy,
metrics.macro_f1.  ${bundled:tasks/sms_spam/train.jsonl}: a bundled file; ${realmodel:minilm}: the real MiniLM.

examples:
  pretune sweep configs/sweep/lora-lr.yaml --jobs 2
  pretune sweep configs/sweep/lora-lr.yaml --dry-run           list the trials (configs checked), run nothing
  pretune sweep spec.yaml --executor slurm --slurm-partition gpu --slurm-gpus 1 --slurm-time 2:00:00 --jobs 16
  pretune sweep spec.yaml --executor slurm --slurm-nodes 2 --slurm-gpus 8      each trial torchrun on 2 nodes
see docs/sweep.md
"""


def add_sweep_parser(sub) -> argparse.ArgumentParser:
    """Register ``sweep`` on an argparse subparsers object (``func=cmd_sweep``); returns its parser."""
    s = sub.add_parser("sweep", help="grid / random search over config keys x seeds, aggregated into tables and "
                       "plots (resumable; local processes or Slurm)", description=textwrap.fill(SWEEP_DESCRIPTION, 100),
                       epilog=SWEEP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("spec", metavar="SWEEP.yaml", help="the sweep spec (format below)")
    s.add_argument("--out", metavar="DIR", help="sweep folder (default: the spec's out)")
    s.add_argument("--jobs", type=int, default=1, metavar="N", help="trials at once (default 1)")
    s.add_argument("--threads", type=int, metavar="N", help="torch threads per trial (default: cores // jobs; "
                   "slurm: --slurm-cpus)")
    s.add_argument("--executor", choices=["processes", "local", "slurm"], default="processes",
                   help="processes (default): child processes; local: submitit's local executor; slurm: Slurm jobs "
                   "through submitit (pip install 'pretune[sweep]')")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier sweep "
                   "(what it wrote is removed, nothing else)")
    s.add_argument("--dry-run", action="store_true", help="list the trials (every config checked) and exit")
    s.add_argument("--report", action="store_true", help="only rewrite the report (results, summary, plots) from "
                   "the trials the folder holds; run nothing")
    s.add_argument("--quiet", action="store_true", help="no live table (a line per finished trial)")
    g = s.add_argument_group("slurm (--executor slurm; --slurm-time also limits --executor local)")
    g.add_argument("--slurm-partition", metavar="NAME", help="partition")
    g.add_argument("--slurm-time", metavar="TIME", help="time limit per trial: minutes, or [D-]HH:MM[:SS] "
                   "(default 24:00:00)")
    g.add_argument("--slurm-gpus", type=int, metavar="N", help="GPUs per trial")
    g.add_argument("--slurm-cpus", type=int, metavar="N", help="CPU cores per trial (and its torch threads)")
    g.add_argument("--slurm-mem", type=float, metavar="GB", help="memory per trial in GB")
    g.add_argument("--slurm-account", metavar="NAME", help="account to charge")
    g.add_argument("--slurm-nodes", type=int, metavar="N", help="nodes per trial: each trial is a torchrun launch on "
                   "N nodes (one task per node, the rendezvous on the allocation's first node, --slurm-gpus processes "
                   "per node, else 1); with --executor local, N launchers on this machine (docs/distributed.md)")
    g.add_argument("--slurm-param", action="append", metavar="KEY=VALUE", default=[],
                   help="any other submitit parameter, e.g. slurm_qos=high or slurm_constraint=a100 (repeatable)")
    s.set_defaults(func=cmd_sweep)
    return s


def minutes(text: str) -> float:
    """``--slurm-time``: ``90`` (minutes), ``1:30:00``, ``2:00`` (H:MM) or ``1-12:00:00`` -> minutes."""
    from ..config import ConfigError

    days, _, clock = text.rpartition("-")
    try:
        parts = [float(p) for p in clock.split(":")]
        if len(parts) == 1:
            total = parts[0]
        elif len(parts) in (2, 3):
            total = parts[0] * 60 + parts[1] + (parts[2] / 60 if len(parts) == 3 else 0)
        else:
            raise ValueError
        total += float(days) * 24 * 60 if days else 0
    except ValueError:
        raise ConfigError(f"--slurm-time {text!r}: expected minutes (90) or [D-]HH:MM[:SS] (1:30:00)") from None
    if total <= 0:
        raise ConfigError(f"--slurm-time {text!r}: expected a positive time")
    return total


def cluster_parameters(args) -> dict:
    """The submitit parameters the --slurm-* flags give."""
    from ..config import ConfigError

    params: dict = {}
    if args.slurm_time:
        params["timeout_min"] = int(round(minutes(args.slurm_time)))
    for flag, key in (("slurm_partition", "slurm_partition"), ("slurm_gpus", "gpus_per_node"),
                      ("slurm_cpus", "cpus_per_task"), ("slurm_mem", "mem_gb"), ("slurm_account", "slurm_account"),
                      ("slurm_nodes", "nodes")):
        if getattr(args, flag) is not None:
            params[key] = getattr(args, flag)
    for item in args.slurm_param:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--slurm-param {item!r}: expected KEY=VALUE, e.g. slurm_qos=high")
        import yaml

        params[key] = yaml.safe_load(value) if value else value
    return params


def cmd_sweep(args) -> int:
    from ..sweep import aggregate, load_spec, plan, run_sweep

    if args.report:
        result = aggregate(args.out or load_spec(args.spec).out)
    elif args.dry_run:
        spec, trials = plan(args.spec, out=args.out)
        print(f"{len(trials)} trials of pretune {spec.command} -> {spec.out}/trials/ (every config checked; nothing "
              "run):")
        for t in trials:
            print(f"  {t.name}")
        return 0
    else:
        result = run_sweep(args.spec, out=args.out, jobs=args.jobs, executor=args.executor, threads=args.threads,
                           cluster=cluster_parameters(args), overwrite=args.overwrite, show_progress=not args.quiet)
    print(result.summary)
    print(f"results: {result.out / 'results.jsonl'} (and .csv), {result.out / 'summary.md'}, plots: "
          f"{result.out / 'bars.png'}" + ("" if not (result.out / "curves.png").is_file() else
                                           f", {result.out / 'curves.png'}"))
    if result.failed:
        print(f"pretune sweep: {len(result.failed)} of {len(result.rows)} trials failed (their output: "
              f"{result.out / 'logs'}/<trial>.log); run the same command again to retry them", file=sys.stderr)
        return 1
    return 0


def check_prompt_arguments(argvs: list[list[str]]) -> list[str | None]:
    """Parse each argument list with ``pretune prompt``'s parser: None, or argparse's message (with the nearest
    option for an unknown one)."""
    from ..config import _did_you_mean
    from .prompt import add_prompt_parser

    sub = argparse.ArgumentParser(prog="pretune").add_subparsers()
    parser = add_prompt_parser(sub)
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    errors: list[str | None] = []
    for argv in argvs:
        buf = io.StringIO()
        try:
            with contextlib.redirect_stderr(buf):
                parser.parse_args(argv)
            errors.append(None)
        except SystemExit:
            message = (buf.getvalue().strip().splitlines() or ["bad options"])[-1]
            message = message.split("error: ", 1)[-1]
            unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in options]
            hint = _did_you_mean(unknown[0].split("=")[0], options) if unknown else ""
            errors.append(message + hint)
    return errors


if __name__ == "__main__" and sys.argv[1:] == ["--check-prompt"]:
    print(json.dumps(check_prompt_arguments(json.load(sys.stdin))))
