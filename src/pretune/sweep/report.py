"""A sweep's results: each trial's metrics read from its run folder, one row per trial, the settings aggregated
over seeds (mean ± sample standard deviation), and the files: results.jsonl, results.csv, summary.md, curves.png,
bars.png (each written atomically).

Metric names (``metrics:`` in the spec) are looked up in a trial's folder in this order:

1. a dotted path into its ``results.json``: finetune writes ``dev`` (the kept model's dev scores) and ``test``
   (``test.accuracy``, ``dev.macro_f1``, ``test.mcc``, ``test.pearson``, ...) and plain values (``steps``,
   ``train_seconds``, ``best_step``); prompt's ``results.json`` holds ``metrics`` (``metrics.accuracy``,
   ``metrics.macro_f1``);
2. ``SPLIT.KEY``: KEY of the last ``metrics.jsonl`` record of that split: pretrain's ``eval.loss``,
   ``eval.mlm_loss``, ``eval.mlm_acc``, ``eval.lm_loss``, ``eval.lm_ppl``, ``train.loss``; finetune's
   ``eval.dev_accuracy`` (the last dev evaluation, not the kept one), ``train.loss``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..io.outputs import write_atomic
from .spec import SweepSpec, Trial

REPORT_FILES = ("results.jsonl", "results.csv", "summary.md", "curves.png", "bars.png")


@dataclass
class SweepResult:
    """What a sweep measured: ``rows`` (one per trial, as results.jsonl) and ``settings`` (one per setting,
    aggregated over its seeds, as summary.md)."""

    out: Path  # the sweep folder
    metrics: list[str]  # the reported metric names, in the spec's order
    rows: list[dict]  # trial, setting, status, params, seed, metrics {name: value or None}, wall_seconds
    settings: list[dict]  # setting, params, seeds (those done), n, metrics {name: {mean, std, values}}
    failed: list[str] = field(default_factory=list)  # names of the trials that failed
    unfinished: list[str] = field(default_factory=list)  # names of the trials not finished (pending, interrupted)
    summary: str = ""  # summary.md's text


# ----------------------------------------------------------------------------------------------
# reading a trial
# ----------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _records(folder: Path) -> list[dict]:
    from ..train.logging import METRICS_FILE, read_metrics

    return read_metrics(folder / METRICS_FILE) if (folder / METRICS_FILE).is_file() else []


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def metric_value(name: str, results: dict | None, records: list[dict]) -> float | None:
    """The value of the metric ``name`` for one trial (see the module docstring), None when it has none."""
    node = results
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if _number(node) is not None:
        return _number(node)
    split, _, key = name.partition(".")
    for r in reversed(records):
        if r.get("split") == split and _number(r.get(key)) is not None:
            return _number(r[key])
    return None


def available_metrics(folder: str | Path) -> list[str]:
    """Every metric name a trial folder answers to (for a message when a spec's metric is not there)."""
    folder = Path(folder)
    names: set[str] = set()

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif _number(v) is not None:
                names.add(prefix + k)

    walk({k: v for k, v in (_read_json(folder / "results.json") or {}).items() if k != "history"})
    names |= {f"{r.get('split')}.{k}" for r in _records(folder) for k, v in r.items()
              if k not in ("step", "split") and _number(v) is not None}
    return sorted(names)


def trial_metrics(folder: str | Path, metrics: list[str]) -> dict[str, float | None]:
    """The spec's metrics for one trial folder (None for each it does not hold)."""
    folder = Path(folder)
    results, records = _read_json(folder / "results.json"), _records(folder)
    return {m: metric_value(m, results, records) for m in metrics}


# ----------------------------------------------------------------------------------------------
# rows and aggregation
# ----------------------------------------------------------------------------------------------
def collect(spec: SweepSpec, trials: list[Trial], state: dict, out: Path) -> list[dict]:
    """One row per trial: its parameters, seed, status, metrics (done trials) and wall time."""
    rows = []
    for t in trials:
        st = state.get(t.name, {})
        status = st.get("status", "pending")
        status = "interrupted" if status == "running" else status
        values = trial_metrics(out / "trials" / t.name, spec.metrics) if status == "done" else \
            {m: None for m in spec.metrics}
        row = {"trial": t.name, "setting": t.setting, "status": status, "params": dict(t.params), "seed": t.seed,
               "metrics": values, "wall_seconds": st.get("wall_seconds")}
        if status == "failed":
            row["error"] = st.get("error", "")
        rows.append(row)
    return rows


def aggregate_rows(rows: list[dict], metrics: list[str]) -> list[dict]:
    """The rows of done trials grouped by setting (in first-seen order): for each metric the values over the
    seeds, their mean and sample standard deviation (``statistics.stdev``; None with a single value)."""
    groups: dict[str, dict] = {}
    for row in rows:
        g = groups.setdefault(row["setting"], {"setting": row["setting"], "params": row["params"], "seeds": [],
                                               "wall_seconds": [], "values": {m: [] for m in metrics}})
        if row["status"] != "done":
            continue
        g["seeds"].append(row["seed"])
        if row.get("wall_seconds") is not None:
            g["wall_seconds"].append(row["wall_seconds"])
        for m in metrics:
            if row["metrics"].get(m) is not None:
                g["values"][m].append(row["metrics"][m])
    out = []
    for g in groups.values():
        stats = {}
        for m, values in g.pop("values").items():
            stats[m] = {"mean": statistics.fmean(values) if values else None,
                        "std": statistics.stdev(values) if len(values) > 1 else None, "values": values}
        walls = g.pop("wall_seconds")
        out.append({**g, "n": len(g["seeds"]), "metrics": stats,
                    "wall_seconds": statistics.fmean(walls) if walls else None})
    return out


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.4g}"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("|", "\\|")


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else "(no output)"


def summary_markdown(spec: SweepSpec, rows: list[dict], settings: list[dict]) -> str:
    """summary.md: one table row per setting, each metric as mean ± std over its seeds; then what did not run."""
    keys = list(dict.fromkeys(k for s in settings for k in s["params"]))
    done = sum(r["status"] == "done" for r in rows)
    lines = [f"# pretune sweep: {spec.command}, {len(settings)} settings x {len(spec.seeds)} seeds "
             f"({done} of {len(rows)} trials done)", "",
             "Each metric is the mean ± sample standard deviation over the setting's finished seeds "
             "(one seed: the value alone).", ""]
    header = keys + ["seeds"] + spec.metrics + ["wall s / trial"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in settings:
        cells = [_cell(s["params"][k]) if k in s["params"] else "" for k in keys]
        cells.append(", ".join(map(str, s["seeds"])) or "—")
        for m in spec.metrics:
            st = s["metrics"][m]
            cells.append(_num(st["mean"]) + (f" ± {_num(st['std'])}" if st["std"] is not None else ""))
        cells.append(_num(s["wall_seconds"]))
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        lines += ["", f"Failed trials ({len(failed)}; their output is in logs/<trial>.log):", ""]
        lines += [f"- `{r['trial']}`: {_last_line(r.get('error'))}" for r in failed]
    other = [r["trial"] for r in rows if r["status"] in ("pending", "interrupted")]
    if other:
        lines += ["", f"Not finished ({len(other)}): " + ", ".join(f"`{n}`" for n in other)]
    missing = sorted({m for r in rows if r["status"] == "done" for m, v in r["metrics"].items() if v is None})
    if missing:
        lines += ["", "Missing in some finished trials' results: " + ", ".join(f"`{m}`" for m in missing)]
    return "\n".join(lines) + "\n"


def _csv(rows: list[dict], metrics: list[str]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r["params"]))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["trial", "setting", "status", *keys, "seed", *metrics, "wall_seconds"])
    for r in rows:
        w.writerow([r["trial"], r["setting"], r["status"], *(r["params"].get(k, "") for k in keys), r["seed"],
                    *("" if r["metrics"][m] is None else r["metrics"][m] for m in metrics),
                    "" if r["wall_seconds"] is None else round(r["wall_seconds"], 3)])
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------------------------
def _png(fig, path: Path) -> None:
    write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))


def _curve_key(all_records: list[list[dict]], metrics: list[str]) -> str | None:
    """The eval key to draw: the first spec metric logged during training (``dev.accuracy`` ->
    ``dev_accuracy``, ``eval.mlm_loss`` -> ``mlm_loss``), else ``loss``, else the first eval key."""
    keys = {k for recs in all_records for r in recs if r.get("split") == "eval" for k, v in r.items()
            if k not in ("step", "split") and _number(v) is not None}
    for m in metrics:
        section, _, leaf = m.partition(".")
        for cand in ((leaf,) if section == "eval" else ()) + (f"{section}_{leaf}",):
            if cand in keys:
                return cand
    return "loss" if "loss" in keys else (sorted(keys)[0] if keys else None)


def plot_curves(out: Path, trials: list[Trial], settings: list[dict], metrics: list[str], path: Path) -> Path:
    """curves.png: every trial's training loss and its evaluation curve over steps (the first of ``metrics``
    logged during training, else the eval loss), a colour per setting and a line style per seed."""
    from matplotlib.figure import Figure

    recs = [_records(out / "trials" / t.name) for t in trials]
    key = _curve_key(recs, metrics)
    fig = Figure(figsize=(11 if key else 6, 4), layout="constrained")
    axes = fig.subplots(1, 2 if key else 1, squeeze=False)[0]
    order = {s["setting"]: i for i, s in enumerate(settings)}
    seeds = sorted({t.seed for t in trials})
    styles = ["-", "--", ":", "-."]
    labelled = set()
    for t, rr in zip(trials, recs):
        color = f"C{order.get(t.setting, 0) % 10}"
        style = styles[seeds.index(t.seed) % len(styles)]
        label = None if t.setting in labelled else t.setting
        for ax, split, k in ((axes[0], "train", "loss"), *(((axes[1], "eval", key),) if key else ())):
            pts = [(r["step"], r[k]) for r in rr if r.get("split") == split and _number(r.get(k)) is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, linestyle=style, marker="o" if split == "eval" else None,
                        markersize=3, linewidth=1.2, label=label if ax is axes[0] else None)
                if ax is axes[0]:
                    labelled.add(t.setting)
    axes[0].set(title="training loss", xlabel="step", ylabel="loss")
    if key:
        axes[1].set(title=f"evaluation: {key}", xlabel="step", ylabel=key)
    if labelled:
        axes[0].legend(fontsize=7, title=f"setting (line style: seed {', '.join(map(str, seeds))})",
                       title_fontsize=7)
    else:
        axes[0].text(0.5, 0.5, "no training curves (metrics.jsonl) yet", ha="center", va="center",
                     transform=axes[0].transAxes)
    for ax in axes:
        ax.grid(alpha=0.3)
    _png(fig, path)
    return path


def plot_bars(settings: list[dict], metrics: list[str], path: Path) -> Path:
    """bars.png: a panel per metric, a bar per setting at its mean with the seeds' standard deviation as an error
    bar, each seed's value as a dot."""
    from matplotlib.figure import Figure

    n = len(settings)
    fig = Figure(figsize=(max(4.5, 0.9 * n + 2) * len(metrics), 4.2), layout="constrained")
    fig.suptitle("mean ± sample standard deviation over seeds (dots: each seed)", fontsize=10)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, m in zip(axes, metrics):
        means = [s["metrics"][m]["mean"] for s in settings]
        errs = [s["metrics"][m]["std"] or 0.0 for s in settings]
        ax.bar(range(n), [0.0 if v is None else v for v in means], yerr=errs, capsize=4,
               color=[f"C{i % 10}" for i in range(n)], alpha=0.75)
        for i, s in enumerate(settings):
            vals = s["metrics"][m]["values"]
            ax.plot([i] * len(vals), vals, "k.", markersize=5)
        ax.set_xticks(range(n))
        ax.set_xticklabels([s["setting"] for s in settings], rotation=30 if n > 3 else 0, ha="right" if n > 3
                           else "center", fontsize=8)
        ax.set(title=m)
        ax.grid(axis="y", alpha=0.3)
        finite = [v for s in settings for v in s["metrics"][m]["values"]]
        if finite and min(finite) > 0 and max(finite) <= 1 and min(finite) > 0.5:  # scores near the top: zoom in
            ax.set_ylim(max(0.0, min(finite) - 0.1), min(1.0, max(finite) + 0.05))
    _png(fig, path)
    return path


# ----------------------------------------------------------------------------------------------
# all of it
# ----------------------------------------------------------------------------------------------
def write_report(spec: SweepSpec, trials: list[Trial], state: dict, out: str | Path) -> SweepResult:
    """Read every trial, aggregate and write results.jsonl, results.csv, summary.md, curves.png (pretrain and
    finetune) and bars.png into ``out``; returns the same as a SweepResult."""
    out = Path(out)
    rows = collect(spec, trials, state, out)
    settings = aggregate_rows(rows, spec.metrics)
    summary = summary_markdown(spec, rows, settings)
    write_atomic(out / "results.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
    write_atomic(out / "results.csv", _csv(rows, spec.metrics))
    write_atomic(out / "summary.md", summary)
    if spec.command != "prompt":  # a prompt evaluation has no training curve
        plot_curves(out, trials, settings, spec.metrics, out / "curves.png")
    plot_bars(settings, spec.metrics, out / "bars.png")
    return SweepResult(out=out, metrics=list(spec.metrics), rows=rows, settings=settings,
                       failed=[r["trial"] for r in rows if r["status"] == "failed"],
                       unfinished=[r["trial"] for r in rows if r["status"] in ("pending", "interrupted")],
                       summary=summary)
