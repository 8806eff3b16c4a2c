"""How well finetuning's default settings learn at several training-set sizes, against fixed settings (issue 32).

Each trial is one ``pretune finetune`` run of the real MiniLM (or SmolLM2 for ``sft``) on a bundled task, trained
on ``data.train_limit=N`` of its training records, scored on the task's test split with its default metric. A
trial's settings are ``auto`` (no batch size or epochs given: the run chooses them from the data), ``today`` (the
fixed defaults before issue 32: batch 32, 3 epochs) or ``bsB-epE`` (a point of the grid). Trials append one JSON
line each to ``--out`` (a finished trial is skipped when the study is run again, so it resumes), and ``--table``
prints the tables docs/finetune.md holds.

    python scripts/defaults_study.py --out study.jsonl --tasks spam,ner --methods full,lora --sizes 300 \\
        --settings bs8-ep3,bs8-ep10,bs16-ep3,bs16-ep10,bs32-ep3,bs32-ep10,auto --workers 2
    python scripts/defaults_study.py --out study.jsonl --table

Dev and test are the task's own splits cut to at most 200 and 500 records (drawn once with seed 0), so that a
10-epoch run on 100 records is not dominated by its evaluations. Each run gets ``train.threads`` = 2 / workers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

# name -> (bundled folder, task, its settings)
TASKS = {
    "spam": ("sms_spam", "classification", ["task.max_len=64"]),
    "supersense": ("wordnet_supersense", "classification", ["task.max_len=64"]),
    "defines": ("wordnet_defines", "pair", ["task.max_len=96"]),
    "similarity": ("austen_edit_similarity", "regression", ["task.max_len=96"]),
    "ner": ("austen_ner", "tagging", ["task.max_len=96"]),
    "qa": ("wordnet_qa", "qa", ["task.max_len=128", "task.stride=32", "task.max_answer_len=40"]),
    "pos": ("wordnet_pos", "multilabel", ["task.max_len=32"]),
    # SmolLM2-135M-Instruct told to label SMS messages (the README's SFT recipe): the label words ham / spam
    "sft": ("sms_spam", "sft", ["task.max_len=128", "task.max_target_len=4", "task.chat=true",
                                "task.completion_field=label", "task.metric=macro_f1",
                                "task.prompt_template=Is this SMS message spam? Answer ham or spam. {text}"]),
}
DEV_MAX, TEST_MAX = 200, 500


def bundled_tasks() -> Path:
    import pretune

    return Path(pretune.__file__).parent / "bundled" / "tasks"


def model_dir(task: str) -> str:
    from pretune.realmodels import minilm_dir, smollm2_dir

    return str(smollm2_dir() if task == "sft" else minilm_dir())


def cut_splits(folder: Path, data: Path) -> dict:
    """The task's dev and test files cut to DEV_MAX / TEST_MAX records (seed 0), written once under ``data``."""
    out = {"train": str(folder / "train.jsonl")}
    for split, most in (("dev", DEV_MAX), ("test", TEST_MAX)):
        target = data / folder.name / f"{split}.jsonl"
        if not target.exists():
            lines = (folder / f"{split}.jsonl").read_text().splitlines()
            random.Random(0).shuffle(lines)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text("\n".join(lines[:most]) + "\n")
            tmp.replace(target)
        out[split] = str(target)
    return out


def all_labels(folder: Path) -> list[str]:
    return sorted({json.loads(line)["label"] for split in ("train", "dev", "test")
                   for line in (folder / f"{split}.jsonl").read_text().splitlines() if line.strip()})


def trial_key(t: dict) -> str:
    return f"{t['task']}/{t['method']}/n{t['n']}/{t['settings']}/s{t['seed']}"


def run_trial(t: dict, args) -> dict:
    folder, task, task_settings = TASKS[t["task"]]
    files = cut_splits(bundled_tasks() / folder, Path(args.out).parent / "study-data")
    out = Path(tempfile.mkdtemp(prefix="study-", dir=args.scratch))
    cmd = [args.pretune, "finetune", "--model", model_dir(t["task"]), "--task", task, "--train", files["train"],
           "--dev", files["dev"], "--test", files["test"], "--out", str(out / "run"), "--overwrite", "--quiet",
           f"data.train_limit={t['n']}", f"train.seed={t['seed']}", "train.keep_last=0",
           f"train.threads={max(1, 2 // args.workers)}", *task_settings]
    if task in ("classification", "pair"):  # every label of the task: 300 records of 45 classes miss some of test's
        cmd.append(f"task.labels=[{','.join(all_labels(bundled_tasks() / folder))}]")
    if t["method"] != "full":
        cmd += ["--peft", t["method"]]
    if t["settings"] == "today":
        cmd += ["--batch-size", "32", "--epochs", "3"]
    elif t["settings"] != "auto":
        bs, ep = t["settings"].split("-")
        cmd += ["--batch-size", bs[2:], "--epochs", ep[2:]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode:
            return {**t, "error": proc.stderr[-2000:] or proc.stdout[-2000:]}
        res = json.loads((out / "run" / "results.json").read_text())
        cfg = (out / "run" / "run.yaml").read_text()
        metric = res["metric"]
        chosen = [line for line in proc.stdout.splitlines() if line.startswith("defaults:")]
        return {**t, "metric": metric, "test": res["test"][metric], "dev": res["dev"][metric], "scores": res["test"],
                "steps": res["steps"],
                "train_seconds": round(res["train_seconds"], 1), "wall_seconds": round(wall, 1),
                "warnings": [w["kind"] for w in res.get("warnings", [])], "chosen": chosen,
                "batch_size": _yaml_value(cfg, "batch_size"), "epochs": _yaml_value(cfg, "epochs"),
                "lr": _yaml_value(cfg, "lr")}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _yaml_value(text: str, key: str) -> str:
    for line in text.splitlines():
        if line.strip().startswith(f"{key}:"):
            return line.split(":", 1)[1].split("#", 1)[0].strip()  # run.yaml marks derived values: "8  # derived"
    return ""


def table(rows: list[dict]) -> str:
    """Per task and method: the grid's test scores at each size, the best of the grid, today's and auto's."""
    lines = []
    by = {}
    for r in rows:
        if "error" not in r:
            r = {**r, **{k: str(r[k]).split("#")[0].strip() for k in ("batch_size", "epochs") if k in r}}
            by.setdefault((r["task"], r["method"], r["n"]), {})[r["settings"]] = r
    grid = [f"bs{b}-ep{e}" for b in (8, 16, 32) for e in (3, 10)]
    lines.append("| task | method | rows | today (32 x 3 ep) | auto (batch x epochs, steps) | best of grid | "
                 "auto - best |")
    lines.append("|---|---|---|---|---|---|---|")
    for (task, method, n), s in sorted(by.items(), key=lambda kv: (list(TASKS).index(kv[0][0]), kv[0][1], kv[0][2])):
        cells = [g for g in grid if g in s]
        best = max(cells, key=lambda g: s[g]["test"]) if cells else None
        auto, today = s.get("auto"), s.get("today") or s.get("bs32-ep3")
        metric = next(iter(s.values()))["metric"]
        fmt = lambda r: f"{r['test']:.3f}" if r else "—"  # noqa: E731
        auto_cell = (f"{auto['test']:.3f} ({auto['batch_size']} x {float(auto['epochs']):g}, {auto['steps']})"
                     if auto else "—")
        best_cell = f"{s[best]['test']:.3f} ({best.replace('bs', '').replace('-ep', ' x ')})" if best else "—"
        gap = f"{auto['test'] - s[best]['test']:+.3f}" if auto and best and len(cells) == len(grid) else ""
        lines.append(f"| {task} ({metric}) | {method} | {n} | {fmt(today)} | {auto_cell} | {best_cell} | {gap} |")
    return "\n".join(lines)


def sizes_table(rows: list[dict]) -> str:
    """Per task and method: today's fixed settings against the chosen ones at each size (test metric, steps)."""
    by = {}
    for r in rows:
        if "error" not in r and r["settings"] in ("auto", "today", "bs32-ep3"):
            by.setdefault((r["task"], r["method"]), {})[(r["n"], "today" if r["settings"] != "auto" else "auto")] = r
    sizes = sorted({n for cells in by.values() for n, _ in cells})
    lines = ["| task | method | " + " | ".join(f"{n:,} rows: today → chosen (steps)" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for (task, method), cells in sorted(by.items(), key=lambda kv: (list(TASKS).index(kv[0][0]), kv[0][1])):
        out = []
        for n in sizes:
            t, a = cells.get((n, "today")), cells.get((n, "auto"))
            out.append(f"{t['test']:.3f} → {a['test']:.3f} ({t['steps']} → {a['steps']})" if t and a else
                       f"— → {a['test']:.3f} ({a['steps']})" if a else "—")
        metric = next(iter(cells.values()))["metric"]
        lines.append(f"| {task} ({metric}) | {method} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results JSONL (appended; finished trials are skipped)")
    p.add_argument("--tasks", default=",".join(t for t in TASKS if t != "sft"))
    p.add_argument("--methods", default="full,lora")
    p.add_argument("--sizes", default="300")
    p.add_argument("--settings", default="auto")
    p.add_argument("--seeds", default="0")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--pretune", default=shutil.which("pretune") or "pretune", help="the pretune command to run")
    p.add_argument("--scratch", default=None, help="folder for the runs (removed after each)")
    p.add_argument("--table", action="store_true", help="print the tables of what --out holds and exit")
    args = p.parse_args()
    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if args.table:
        print(table([r for r in rows if r["n"] == 300]))
        print()
        print(sizes_table(rows))
        return 0
    done = {trial_key(r) for r in rows if "error" not in r}
    todo = [dict(task=task, method=m, n=int(n), settings=s, seed=int(seed))
            for task in args.tasks.split(",") for m in args.methods.split(",") for n in args.sizes.split(",")
            for s in args.settings.split(",") for seed in args.seeds.split(",")]
    todo = [t for t in todo if trial_key(t) not in done]
    for task in {t["task"] for t in todo}:  # once, before the workers start
        cut_splits(bundled_tasks() / TASKS[task][0], out.parent / "study-data")
    print(f"{len(todo)} trials to run ({len(done)} done in {out})", flush=True)
    with ThreadPoolExecutor(args.workers) as pool, out.open("a") as f:
        for future in as_completed([pool.submit(run_trial, t, args) for t in todo]):
            r = future.result()
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(trial_key(r), r.get("test", r.get("error", "")[-300:]), r.get("steps", ""), r.get("wall_seconds", ""),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
