"""PEFT against full finetuning on the real MiniLM (all-MiniLM-L6-v2), with each method's default learning rates
(no --lr, no --head-lr): the table in BENCHMARKS.md ("PEFT methods against full finetuning").

    .venv/bin/python scripts/peft_vs_full.py --out runs/peft-vs-full            # every method, both tasks
    .venv/bin/python scripts/peft_vs_full.py --out runs/x --tasks supersense5 --methods full lora

Tasks (bundled data, nothing downloaded):
  sms_spam      2 classes: the first 1000 training records (as the quickstart), the full dev and test splits.
  supersense5   5 classes: WordNet glosses of the five most frequent supersenses (adj.all, noun.person,
                noun.artifact, noun.animal, noun.plant), every record of those classes in each split.

Every run: task.max_len=64, the finetune defaults otherwise (3 epochs, batch 32, keep the best dev model, seed 0).
Writes <out>/results.jsonl (one line per run, appended as runs finish; a finished run is not run again) and
<out>/table.md. Not a timed benchmark (results.jsonl keeps each run's seconds, for orientation only).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

METHODS = ("full", "lora", "ia3", "adapter", "bitfit", "prefix", "prompt")
TOP5 = ("adj.all", "noun.person", "noun.artifact", "noun.animal", "noun.plant")


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_files(name: str, folder: Path) -> dict[str, Path]:
    from pretune import bundled

    def rows(task, split):
        return [json.loads(x) for x in bundled.path(f"tasks/{task}/{split}.jsonl").read_text().splitlines() if x]

    if name == "sms_spam":
        return {"train": _write(folder / "train.jsonl", rows("sms_spam", "train")[:1000]),
                "dev": _write(folder / "dev.jsonl", rows("sms_spam", "dev")),
                "test": _write(folder / "test.jsonl", rows("sms_spam", "test"))}
    if name == "supersense5":
        return {split: _write(folder / f"{split}.jsonl",
                              [r for r in rows("wordnet_supersense", split) if r["label"] in TOP5])
                for split in ("train", "dev", "test")}
    raise SystemExit(f"unknown task {name!r}: expected sms_spam or supersense5")


def run_one(task: str, method: str, files: dict, out: Path, extra: list[str]) -> dict:
    from pretune.jobs.finetune import finetune, load_finetune_config
    from pretune.realmodels import minilm_dir

    overrides = [f"model.init={minilm_dir()}", "task.name=classification", f"data.train={files['train']}",
                 f"data.dev={files['dev']}", f"data.test={files['test']}", f"train.out={out}", "task.max_len=64",
                 "train.plot=false", "train.keep_last=0", *extra]
    if method != "full":
        overrides.append(f"peft.method={method}")
    cfg = load_finetune_config(None, overrides)
    t0 = time.perf_counter()
    res = finetune(cfg, show_progress=False, log=lambda *a: None)
    preds = [json.loads(x)["prediction"] for x in (res.run_dir / "test_predictions.jsonl").read_text().splitlines()]
    results = json.loads((res.run_dir / "results.json").read_text())
    run_yaml = (res.run_dir / "run.yaml").read_text()
    import yaml

    used = yaml.safe_load(run_yaml)
    return {"task": task, "method": method, "extra": extra, "test": res.test, "dev": res.dev,
            "lr": used["train"]["lr"], "head_lr": used["tune"]["head_lr"], "steps": res.steps,
            "predicted": dict(collections.Counter(preds)), "seconds": round(time.perf_counter() - t0, 1),
            "trainable_fraction": results.get("peft", {}).get("fraction", 1.0)}


def table(rows: list[dict]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        full = next((r for r in rows if r["task"] == task and r["method"] == "full"), None)
        lines += [f"**{task}**", "", "| method | trains | lr | head lr | test macro-F1 | × full | test accuracy | "
                  "classes predicted |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["task"] != task:
                continue
            f1 = r["test"]["macro_f1"]
            ratio = f"{f1 / full['test']['macro_f1']:.2f}" if full else "–"
            frac = r.get("trainable_fraction", 1.0)
            trains = "all" if frac >= 1 else f"{100 * frac:.2g} %"
            lines.append(f"| {r['method']} | {trains} | {r['lr']:g} | "
                         f"{r['head_lr'] or r['lr']:g} | {f1:.4f} | {ratio} | "
                         f"{r['test']['accuracy']:.4f} | {len(r['predicted'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the runs, results.jsonl and table.md")
    p.add_argument("--tasks", nargs="+", default=["sms_spam", "supersense5"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more finetune overrides for every run")
    args = p.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    done = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    for task in args.tasks:
        files = task_files(task, out / "data" / task)
        for method in args.methods:
            if any(r["task"] == task and r["method"] == method and r["extra"] == args.set for r in done):
                continue
            tag = "-".join([task, method] + [s.replace("=", "") for s in args.set])
            row = run_one(task, method, files, out / tag, args.set)
            done.append(row)
            with open(log, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{task} {method}: test macro-F1 {row['test']['macro_f1']:.4f} acc {row['test']['accuracy']:.4f} "
                  f"predicted {row['predicted']} ({row['seconds']:.0f}s)", flush=True)
    (out / "table.md").write_text(table(done))
    print(table(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
