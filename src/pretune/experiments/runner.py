"""Running an experiment: its folder, its inputs, its sweeps (resumable), its measurements, its report.

The experiment's folder (``--out``)::

    experiment.json     which experiment and size it holds, and each run of the command (wall time, device)
    inputs/             what the experiment's prepare() made (tokenizer, data subsets, token store)
    <sweep>/            each sweep's own folder (pretune sweep's layout: trials/, configs/, logs/, summary.md, ...)
    results.jsonl       every trial of every sweep (a row as the sweep's, with the sweep's name)
    results.csv         the same as a table
    summary.md          the measured table (mean ± std over seeds), then each sweep's own summary
    bars.png curves.png the sweep's plots (with several sweeps: <sweep>-bars.png, <sweep>-curves.png)
    <figure>.png        the experiment's own figure, when it draws one
    verdict.json        the verdict per claim: label, margin, spread, explanation; size, device, wall time, commit
    report.md           claim, table, verdicts, figures, size, device, wall time, commit

Running the same command again continues: inputs are reused, each sweep skips its finished trials, measured
trials are not measured again, and the report is rewritten from everything finished.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, _did_you_mean
from ..io.outputs import MARKER, check_folder, claim, clean_run_folder, owned_entries, write_atomic
from .base import CONFIRMED, SIZES, Experiment, Finding, Results, Sweep

STATE_FILE = "experiment.json"
INPUTS = "inputs"
REPORTS = ("results.jsonl", "results.csv", "summary.md", "verdict.json", "report.md")


@dataclass
class ExperimentResult:
    """What ``run_experiment`` returns: the measured results, the verdicts and where the report went."""

    experiment: Experiment
    size: str
    out: Path
    results: Results
    findings: list[Finding]
    verdict: tuple[str, str]  # (label, explanation) over every claim
    table: str  # the measured table (markdown)
    report: str  # report.md's text
    failed: list[str] = field(default_factory=list)  # "sweep/trial" of every failed trial
    unfinished: list[str] = field(default_factory=list)  # "sweep/trial" of every trial not finished


def get_experiment(name: str) -> Experiment:
    """The registered experiment called ``name``; a ConfigError naming every experiment otherwise."""
    from . import EXPERIMENTS

    if name not in EXPERIMENTS:
        hint = _did_you_mean(name, list(EXPERIMENTS))
        raise ConfigError(f"unknown experiment {name!r}{hint if 'did you mean' in hint else ''}; the experiments "
                          f"are: {', '.join(EXPERIMENTS)} (pretune experiment list shows their claims)")
    return EXPERIMENTS[name]


def default_out(name: str, size: str) -> str:
    return f"runs/experiment-{name}" + ("" if size == "default" else f"-{size}")


def git_commit() -> str | None:
    """The commit of the pretune source tree (with ``+dirty`` when tracked files changed), or None outside git."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _device_line(threads: int, jobs: int) -> str:
    from ..sweep import cores
    from ..train.precision import describe_device

    return f"{describe_device()}, {cores()} cores; {jobs} trial(s) at a time, {threads} thread(s) each"


# ----------------------------------------------------------------------------------------------
# the folder
# ----------------------------------------------------------------------------------------------
def _read_state(out: Path) -> dict | None:
    try:
        data = json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _open_folder(exp: Experiment, size: str, out: Path, *, overwrite: bool, log) -> dict:
    """The experiment's folder, ready: new, or an earlier run of the same experiment and size (continued), or
    with ``overwrite`` what an earlier experiment wrote there removed. Returns its state (experiment.json)."""
    state = _read_state(out) if STATE_FILE in owned_entries(out) else None
    if state is not None and (state.get("experiment"), state.get("size")) != (exp.name, size):
        if not overwrite:
            raise ConfigError(f"{out} holds the experiment {state.get('experiment')} at size {state.get('size')}; "
                              f"choose another --out for {exp.name} at size {size}, or start over there with "
                              "--overwrite")
    if state is not None and overwrite:
        removed = clean_run_folder(out)
        log(f"--overwrite: removed {', '.join(removed)} of the earlier experiment in {out}")
        state = None
    if state is None:
        check_folder(out, overwrite=overwrite, what="experiment")
        state = {"written_by": "pretune experiment", "experiment": exp.name, "size": size, "runs": []}
    out.mkdir(parents=True, exist_ok=True)
    claim(out, (STATE_FILE, INPUTS, *REPORTS), what="experiment")
    return state


def _save_state(out: Path, state: dict) -> None:
    write_atomic(out / STATE_FILE, json.dumps(state, indent=1) + "\n", fsync=False)


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------
def run_experiment(experiment: str | Experiment, *, size: str = "default", out: str | Path | None = None,
                   jobs: int = 1, threads: int | None = None, overwrite: bool = False, report_only: bool = False,
                   report_to: list[str] | None = None, show_progress: bool = True, log=print) -> ExperimentResult:
    """Run (or continue) an experiment and write its report; returns the results and the verdicts.

    Args:
        experiment: a registered name (``pretune experiment list``) or an Experiment.
        size: ``fast`` (the test suite's, seconds), ``default`` (<= 20 minutes on 2 CPU cores) or ``large``.
        out: the experiment's folder (default ``runs/experiment-NAME`` (``-SIZE`` for other sizes)).
        jobs: trials at once (each sweep's ``--jobs``); threads: torch threads per trial (default cores // jobs).
        overwrite: start over in a folder that holds an earlier experiment (only what it wrote is removed).
        report_only: run nothing; rewrite the report from what the folder holds.
        report_to: trackers every training trial also logs to (``train.report_to``: tensorboard, mlflow, wandb),
            one tracked run per trial grouped by ``EXPERIMENT.SWEEP``; None: as each sweep says (none).
        show_progress: each sweep's live table; log: where progress lines go.
    """
    from ..sweep import aggregate, cores, run_sweep

    exp = get_experiment(experiment) if isinstance(experiment, str) else experiment
    if size not in SIZES:
        raise ConfigError(f"size {size!r}: expected one of {', '.join(SIZES)}{_did_you_mean(size, list(SIZES))}")
    out = Path(out if out is not None else default_out(exp.name, size))
    if report_only:
        state = _read_state(out)
        if state is None or state.get("experiment") != exp.name:
            raise ConfigError(f"{out} holds no run of the experiment {exp.name} ({STATE_FILE} is missing or names "
                              "another); run it first")
        size = state["size"]
    else:
        state = _open_folder(exp, size, out, overwrite=overwrite, log=log)
    threads = threads or max(1, cores() // jobs)
    t0 = time.time()
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "jobs": jobs, "threads": threads,
           "device": _device_line(threads, jobs), "commit": git_commit()}
    if not report_only:
        state["runs"].append(run)
        _save_state(out, state)
    inputs = exp.prepare(size, out / INPUTS, log=log)  # reuses what an earlier run made
    sweeps = [Sweep(s.name, tracked(s.spec, report_to, group=f"{exp.name}.{s.name}")) for s in exp.sweeps(size, inputs)]
    _check_sweeps(exp, sweeps)
    if not report_only:
        claim(out, [s.name for s in sweeps], what="experiment")
    results: dict = {}
    try:
        for sw in sweeps:
            folder = out / sw.name
            if report_only:
                if not (folder / "sweep.yaml").is_file():
                    continue
                result = aggregate(folder)
            else:
                log(f"pretune experiment {exp.name} ({size}): sweep {sw.name} -> {folder}")
                result = run_sweep(sw.spec, out=str(folder), jobs=jobs, threads=threads, show_progress=show_progress,
                                   log=log)
            if exp.measure(size, sw, result, inputs, log=log):
                result = aggregate(folder)
            results[sw.name] = result
    finally:
        if not report_only:
            run["wall_seconds"] = round(time.time() - t0, 1)
            _save_state(out, state)
    return write_report(exp, size, out, Results(size=size, sweeps=results, inputs=inputs), state)


def tracked(spec: dict, report_to: list[str] | None, *, group: str) -> dict:
    """A sweep spec whose training trials log to the trackers ``report_to`` (over the spec's own choice, which the
    experiments leave at none: ``train.tensorboard=false``), grouped as ``group``; a prompt sweep (no training) and
    ``report_to=None`` leave it as it is."""
    if report_to is None or spec.get("command") == "prompt":
        return spec
    base = {**spec.get("base", {}), "train.report_to": list(report_to), "train.tensorboard": None, "train.group": group}
    return {**spec, "base": base}


def _check_sweeps(exp: Experiment, sweeps: list[Sweep]) -> None:
    names = [s.name for s in sweeps]
    reserved = {STATE_FILE, INPUTS, MARKER, *REPORTS}
    if not sweeps or len(set(names)) != len(names) or reserved & set(names) or any(
            "/" in n or n.endswith(".png") for n in names):
        raise ConfigError(f"experiment {exp.name}: its sweeps need distinct plain folder names, none of "
                          f"{', '.join(sorted(reserved))}; got {names}")


# ----------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------
def _csv(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
    metrics = list(dict.fromkeys(m for r in rows for m in r["metrics"]))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["sweep", "trial", "setting", "status", *keys, "seed", *metrics, "wall_seconds"])
    for r in rows:
        w.writerow([r["sweep"], r["trial"], r["setting"], r["status"], *(r["params"].get(k, "") for k in keys),
                    r["seed"], *("" if r["metrics"].get(m) is None else r["metrics"][m] for m in metrics),
                    "" if r.get("wall_seconds") is None else round(r["wall_seconds"], 3)])
    return buf.getvalue()


def _plots(out: Path, results: Results) -> list[str]:
    """Copy each sweep's plots next to the report (one sweep: bars.png, curves.png; several: <sweep>-bars.png)."""
    names = []
    single = len(results.sweeps) == 1
    for sweep, res in results.sweeps.items():
        for plot in ("bars.png", "curves.png"):
            src = res.out / plot
            if src.is_file():
                name = plot if single else f"{sweep}-{plot}"
                claim(out, [name], what="experiment")
                write_atomic(out / name, src.read_bytes(), fsync=False)
                names.append(name)
    return names


def _verdict_lines(findings: list[Finding]) -> list[str]:
    lines = []
    for f in findings:
        mark = "✔" if f.label == CONFIRMED else "✘"
        lines.append(f"- {mark} **{f.label}**: {f.claim.text} — {f.explanation}")
    return lines


def write_report(exp: Experiment, size: str, out: Path, results: Results, state: dict) -> ExperimentResult:
    """Write results.jsonl/csv, summary.md, the plots, verdict.json and report.md into ``out``."""
    rows = results.rows
    findings = exp.findings(results)
    label, explanation = exp.verdict(results)
    table = exp.table(results)
    failed = [f"{r['sweep']}/{r['trial']}" for r in rows if r["status"] == "failed"]
    unfinished = [f"{r['sweep']}/{r['trial']}" for r in rows if r["status"] in ("pending", "interrupted")]
    write_atomic(out / "results.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
    write_atomic(out / "results.csv", _csv(rows))
    summary = [f"# {exp.name} ({size}): {exp.title}", "", "Mean ± sample standard deviation over the seeds.", "",
               table, ""]
    for sweep, res in results.sweeps.items():
        summary += [f"## sweep `{sweep}`", "", res.summary.split("\n", 2)[-1].strip(), ""]
    write_atomic(out / "summary.md", "\n".join(summary))
    plots = _plots(out, results)
    figure = None
    if exp.figure_name:
        name = f"{exp.figure_name}.png"
        claim(out, [name], what="experiment")
        figure = exp.figure(results, out / name) and name
    runs = state.get("runs", [])
    wall = sum(r.get("wall_seconds") or 0.0 for r in runs)
    last = runs[-1] if runs else {}
    done = sum(r["status"] == "done" for r in rows)
    verdict = {"experiment": exp.name, "size": size, "claim": exp.claim, "source": exp.source, "verdict": label,
               "explanation": explanation, "claims": [f.to_dict() for f in findings],
               "trials": {"total": len(rows), "done": done, "failed": len(failed), "unfinished": len(unfinished)},
               "wall_seconds": round(wall, 1), "runs": len(runs), "device": last.get("device"),
               "commit": last.get("commit"), "size_description": exp.sizes.get(size, "")}
    write_atomic(out / "verdict.json", json.dumps(verdict, indent=1) + "\n")
    report = _report_md(exp, size, out, table, findings, (label, explanation), verdict, plots, figure, failed,
                        unfinished)
    write_atomic(out / "report.md", report)
    return ExperimentResult(experiment=exp, size=size, out=out, results=results, findings=findings,
                            verdict=(label, explanation), table=table, report=report, failed=failed,
                            unfinished=unfinished)


def _report_md(exp, size, out, table, findings, verdict, info, plots, figure, failed, unfinished) -> str:
    label, explanation = verdict
    out_flag = "" if Path(out) == Path(default_out(exp.name, size)) else f" --out {out}"
    wall = info["wall_seconds"]
    lines = [f"# {exp.title}: `pretune experiment {exp.name} --size {size}`", "",
             f"**Claim** ({exp.source}): {exp.claim}", "",
             f"**Size** `{size}`: {exp.sizes.get(size, '')}", "",
             "## Measured", "", "Mean ± sample standard deviation over the seeds.", "", table, "",
             "## Verdict", "", f"**{label}** ({explanation})", "", *_verdict_lines(findings), "",
             "How each verdict is decided:", ""]
    lines += [f"- {f.claim.key}: {f.claim.rule}" for f in findings]
    lines.append("")
    if figure:
        lines += [f"![{exp.title}]({figure})", ""]
    lines += [f"![{p}]({p})" for p in plots]
    lines += ["", "## Run", "",
              f"- trials: {info['trials']['done']} of {info['trials']['total']} done"
              + (f", {len(failed)} failed ({', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''})" if failed
                 else "")
              + (f", {len(unfinished)} not finished" if unfinished else ""),
              f"- wall time: {wall:.0f} s ({wall / 60:.1f} min)"
              + (f" over {info['runs']} runs of the command" if info["runs"] > 1 else ""),
              f"- device: {info['device'] or 'unknown'}",
              f"- commit: {info['commit'] or 'unknown (not a git checkout)'}",
              f"- rerun: `pretune experiment {exp.name} --size {size}{out_flag}` (continues; --overwrite starts "
              "over)", ""]
    return "\n".join(lines)
