"""``pretune experiment NAME`` and ``pretune experiment list``: a lecture's claim re-run as sweeps, with a table and
a verdict (pretune.experiments)."""

from __future__ import annotations

import argparse
import sys
import textwrap

DESCRIPTION = (
    "Re-run a finding of the lectures with one command: the experiment runs its sweep(s) (each trial an ordinary "
    "pretune run, resumable: rerunning continues), then prints the lecture's claim, the measured table (mean ± std "
    "over seeds) and a verdict per claim: 'confirmed' when the claimed ordering holds by more than the seed-to-seed "
    "spread (its rule is stated), else 'not confirmed at this scale', with the margin and the spread. OUT holds "
    "results.jsonl/.csv, summary.md, the plots, verdict.json and report.md (claim, table, verdict, size, device, wall "
    "time, commit). Sizes: fast (seconds, for tests), default (<= 20 minutes on 2 CPU cores in fp32), large.")

EPILOG = """examples:
  pretune experiment list                              the experiments and their claims
  pretune experiment positions --jobs 2                run (or continue) one at its default size
  pretune experiment peft-vs-data --size large --out runs/peft-large --jobs 8
  pretune experiment positions --report                rewrite the report from what its folder holds
see docs/experiments.md
"""


def add_experiment_parser(sub) -> argparse.ArgumentParser:
    """Register ``experiment`` on an argparse subparsers object (``func=cmd_experiment``); returns its parser."""
    s = sub.add_parser("experiment", help="re-run a lecture's finding (pretrained vs scratch, positions, PEFT vs "
                       "data, ...): sweeps, a table and a verdict", description=textwrap.fill(DESCRIPTION, 100),
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("name", metavar="NAME", help="an experiment (see `pretune experiment list`), or list")
    s.add_argument("--size", choices=["fast", "default", "large"], default="default",
                   help="fast: seconds (tests); default: <= 20 minutes on 2 CPU cores; large: bigger machines")
    s.add_argument("--out", metavar="DIR", help="experiment folder (default runs/experiment-NAME[-SIZE])")
    s.add_argument("--jobs", type=int, default=1, metavar="N", help="trials at once (default 1)")
    s.add_argument("--threads", type=int, metavar="N", help="torch threads per trial (default: cores // jobs)")
    s.add_argument("--overwrite", action="store_true", help="start over in a folder that holds an earlier experiment "
                   "(what it wrote is removed, nothing else)")
    s.add_argument("--report", action="store_true", help="run nothing: rewrite the report from what OUT holds")
    s.add_argument("--quiet", action="store_true", help="no live tables (a line per finished trial)")
    s.add_argument("--report-to", metavar="NAMES", help="trackers every training trial also logs to, comma-separated: "
                   "tensorboard, mlflow, wandb (one tracked run per trial, grouped by sweep; docs/tracking.md)")
    s.set_defaults(func=cmd_experiment)
    return s


def list_experiments() -> str:
    from ..experiments import EXPERIMENTS

    lines = []
    for name, exp in EXPERIMENTS.items():
        lines.append(f"{name}")
        lines += textwrap.wrap(exp.claim, 96, initial_indent="    ", subsequent_indent="    ")
        lines += textwrap.wrap(f"({exp.source})", 96, initial_indent="    ", subsequent_indent="    ")
    lines += ["", "run one: pretune experiment NAME [--size fast|default|large] [--out DIR] [--jobs N]"]
    return "\n".join(lines)


def cmd_experiment(args) -> int:
    from ..experiments import get_experiment, run_experiment

    if args.name == "list":
        print(list_experiments())
        return 0
    exp = get_experiment(args.name)
    print(f"{exp.title} ({exp.name}, size {args.size})\nclaim: {exp.claim}\nsource: {exp.source}\n", flush=True)
    result = run_experiment(exp, size=args.size, out=args.out, jobs=args.jobs, threads=args.threads,
                            overwrite=args.overwrite, report_only=args.report, show_progress=not args.quiet,
                            report_to=[n.strip() for n in args.report_to.split(",") if n.strip()]
                            if args.report_to is not None else None)
    label, explanation = result.verdict
    print(f"\n{exp.title} ({exp.name}, size {result.size}): mean ± std over seeds\n")
    print(result.table)
    print(f"\nverdict: {label}")
    for f in result.findings:
        print(textwrap.fill(f"- {f.claim.key}: {f.label}. {f.explanation}", 110, subsequent_indent="    "))
    print(f"\nreport: {result.out / 'report.md'}, verdict.json, results.jsonl (and .csv), summary.md, plots in "
          f"{result.out}")
    if result.failed:
        print(f"pretune experiment: {len(result.failed)} trials failed (their output: {result.out}/<sweep>/logs/); "
              "run the same command again to retry them", file=sys.stderr)
        return 1
    return 0
