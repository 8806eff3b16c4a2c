"""What every ``pretune bench`` subcommand shares: one measurement per process, the flags, the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict


def spawn_worker(job, module: str) -> dict:
    """Run ``python -m module JOB_JSON`` in a fresh process (one measurement per process, so two models
    never share an allocator) and return the JSON dict it prints last."""
    cmd = [sys.executable, "-m", module, json.dumps(asdict(job))]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {job}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])



def add_run_arguments(p, *, threads: str = "every core", default_threads: int = 0) -> None:
    """The flags every ``pretune bench`` subcommand has: --rounds, --threads, --json."""
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--threads", type=int, default=default_threads,
                   help=f"torch threads of every run (default {default_threads or f'0: {threads}'})")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def without_missing_trl(impls) -> tuple[str, ...]:
    """``impls`` less TRL's sides (``trl``, ``trl-...``) when TRL is not installed."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return tuple(i for i in impls if not i.startswith("trl"))
    return tuple(impls)


def chosen_impls(requested, default, *, bench: str, trainer: str) -> tuple[str, ...] | None:
    """The sides a TRL benchmark times: those asked for (``--impls``), else ``default`` less TRL's when it is not
    installed (said on stderr); None after an error message when a TRL side is asked for without TRL."""
    impls = tuple(requested) if requested else without_missing_trl(default)
    if without_missing_trl(impls) != impls:
        print(f"pretune bench {bench}: --impls trl needs TRL: pip install 'pretune[trl]'", file=sys.stderr)
        return None
    if requested is None and "trl" not in impls:
        print(f"pretune bench {bench}: TRL is not installed, so its {trainer} is not timed (pip install "
              "'pretune[trl]')", file=sys.stderr)
    return impls


def report(rows: list[dict], table: str, json_path: str | None) -> int:
    """Print a benchmark's table and, with ``json_path``, write its rows as JSON (every ``bench`` command)."""
    print(table)
    if json_path:
        from pathlib import Path

        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def bench_main(argv, *, prog: str, doc: str, job_cls, run_worker, add_arguments, run_cli) -> int:
    """Entry of a benchmark module: with one JSON argument it is the worker (run that job, print its
    result as JSON, read back by :func:`spawn_worker`); otherwise the command line ``prog``."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].startswith("{"):
        print(json.dumps(run_worker(job_cls(**json.loads(argv[0])))))
        return 0
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))
