"""``pretune bench finetune``: finetuning MiniLM on sms_spam, pretune vs transformers' ``Trainer``.

Each run is one Python process (:func:`pretune.bench.common.spawn_worker`); the two implementations alternate
which goes first, for several rounds. Both sides get the same model (sentence-transformers/all-MiniLM-L6-v2,
``pretune.realmodels.minilm_dir()``), the same records and the same hyperparameters:

* pretune: :func:`pretune.jobs.finetune.finetune`, task classification (BERT pooler -> dropout -> linear, as
  ``BertForSequenceClassification``), ``tune.epochs`` epochs, one dev evaluation at the end, no checkpoints
  (``train.keep_last=0``), TensorBoard and plot off; its own length-bucketed batches.
* transformers: ``AutoModelForSequenceClassification.from_pretrained(..., num_labels, id2label, label2id)``,
  ``AutoTokenizer`` (truncation to ``max_len``), ``DataCollatorWithPadding`` and ``Trainer`` with
  ``TrainingArguments`` (save/eval/logging off, ``report_to="none"``, ``use_cpu``, no dataloader workers,
  ``max_steps`` = ours' step count ``ceil(n_train // batch * epochs)``: one epoch without its last partial
  batch, as ours; otherwise Trainer's defaults, e.g. its random sampler and ``adamw_torch_fused``);
  then ``trainer.predict`` on dev and test (every record: ``dataloader_drop_last`` would drop eval ones too).

Shared: batch 32, AdamW lr 5e-5, weight decay 0.01 (not on biases and norms, on both sides), linear decay
after ``warmup_steps = int(warmup_ratio * steps)`` (0.1: ours' ``tune.warmup_ratio``, the same integer
handed to transformers), gradient clipping 1.0, max_len 128, seed 0, eval batch 2 x batch (ours' rule),
fp32 (or bf16 = fp32 weights under CPU autocast: ours ``train.precision=bf16``, transformers ``bf16=True``),
the same ``torch.set_num_threads`` on both sides and ``torch.set_flush_denormal(True)`` (``finetune``
sets it; it is set for transformers too, which can only help that side).

What is timed (wall clock, ``time.perf_counter``), on each side:

* pretune: ``FinetuneResult.seconds``, i.e. ``Trainer.fit()`` in :func:`pretune.jobs.finetune.finetune`: every
  optimizer step (batching, collation, forward, backward, clipping, AdamW, schedule), the metrics log,
  and the single end-of-training evaluation on dev (forward passes + accuracy, F1, ...).
* transformers: ``trainer.train()`` (which includes building its optimizer, scheduler and dataloader)
  followed by ``trainer.predict(dev)`` and the dev accuracy computed from its logits.

Not timed on either side: starting Python, imports, loading the model and tokenizer, reading and
tokenizing the records, constructing the trainer, saving the finetuned model and the test evaluation
(which gives the reported accuracy). The test accuracy is on the whole test file; the ratio is
median(transformers seconds) / median(pretune seconds) over rounds; the target is ratio >= 1.3 with
|accuracy difference| <= 0.5 points.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import add_run_arguments, spawn_worker

IMPLS = ("pretune", "transformers")
# pretune/bundled: shipped whole
DEFAULT_DATA = Path(__file__).resolve().parent.parent / "bundled" / "tasks" / "sms_spam"
TARGET_RATIO = 1.3  # transformers seconds / pretune seconds
TARGET_POINTS = 0.5  # |test accuracy difference| in percentage points


@dataclass
class Job:
    impl: str  # pretune | transformers
    dtype: str  # fp32 | bf16 (autocast)
    model: str  # Hugging Face folder (MiniLM)
    train: str  # labelled files: {"text": ..., "label": ...}
    dev: str
    test: str
    epochs: float = 1.0
    batch: int = 32
    lr: float = 5e-5
    warmup_ratio: float = 0.1  # warmup_steps = int(warmup_ratio * steps)
    weight_decay: float = 0.01
    max_len: int = 128
    seed: int = 0
    threads: int = 0  # torch threads; 0: torch's default


def n_steps(n_train: int, job: Job) -> int:
    """Optimizer steps of ``job``: whole batches per epoch (the last partial one dropped) times epochs,
    the rule of :func:`pretune.jobs.finetune.finetune`."""
    import math

    return math.ceil(max(1, n_train // job.batch) * job.epochs)


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process)
# ---------------------------------------------------------------------------------------------
def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _run_pretune(job: Job, run_dir: str) -> dict:
    from omegaconf import OmegaConf

    from ..jobs.finetune import finetune, load_finetune_config

    base = {
        "model": {"init": job.model},
        "task": {"name": "classification", "max_len": job.max_len},
        "data": {"train": job.train, "dev": job.dev, "test": job.test},
        "tune": {"epochs": job.epochs, "evals_per_epoch": 1, "warmup_ratio": job.warmup_ratio, "patience": 0,
                 "keep_best": True},
        "train": {"out": run_dir, "batch_size": job.batch, "grad_accum": 1, "lr": job.lr,
                  "weight_decay": job.weight_decay, "schedule": "linear", "warmup_steps": 0, "clip": 1.0,
                  "precision": job.dtype, "eval_every": 0, "save_every": 0, "keep_last": 0, "seed": job.seed,
                  "threads": job.threads, "tensorboard": False, "plot": False, "compile": False},
    }
    cfg = load_finetune_config(None, [], base=base)
    res = finetune(cfg, show_progress=False, log=lambda s: None)
    ran = OmegaConf.load(Path(run_dir) / "run.yaml").train  # the resolved steps and warmup of the run
    return {"seconds": res.seconds, "test_accuracy": float(res.test["accuracy"]),
            "dev_accuracy": float(res.dev.get("accuracy", float("nan"))), "steps": int(res.steps),
            "warmup_steps": int(ran.warmup_steps)}


def _run_transformers(job: Job, run_dir: str) -> dict:
    import numpy as np
    import torch
    import transformers as T

    from ..tasks.base import TaskConfig, read_records
    from ..tasks.classify import Classification, _label_str

    tcfg = TaskConfig()
    recs = {split: read_records(getattr(job, split)) for split in ("train", "dev", "test")}
    labels = Classification.label_set(tcfg, recs["train"])  # ours' label order: the same head rows
    label2id = {lab: i for i, lab in enumerate(labels)}
    tok = T.AutoTokenizer.from_pretrained(job.model)

    def encode(records) -> list[dict]:
        enc = tok([r.data[tcfg.text_field] for r in records], truncation=True, max_length=job.max_len)
        return [{"input_ids": ids, "attention_mask": mask, "labels": label2id[_label_str(r.data[tcfg.label_field])]}
                for ids, mask, r in zip(enc["input_ids"], enc["attention_mask"], records)]

    data = {split: encode(r) for split, r in recs.items()}
    T.set_seed(job.seed)  # the classifier's initialisation
    model = T.AutoModelForSequenceClassification.from_pretrained(
        job.model, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label2id, dtype=torch.float32)
    steps = n_steps(len(data["train"]), job)
    warmup = int(job.warmup_ratio * steps)
    args = T.TrainingArguments(
        output_dir=run_dir, num_train_epochs=job.epochs, max_steps=steps, per_device_train_batch_size=job.batch,
        per_device_eval_batch_size=2 * job.batch, learning_rate=job.lr, weight_decay=job.weight_decay,
        warmup_steps=warmup, lr_scheduler_type="linear", max_grad_norm=1.0, seed=job.seed, bf16=job.dtype == "bf16",
        save_strategy="no", eval_strategy="no", logging_strategy="no", report_to="none", dataloader_num_workers=0,
        use_cpu=True, disable_tqdm=True)
    trainer = T.Trainer(model=model, args=args, train_dataset=data["train"], processing_class=tok,
                        data_collator=T.DataCollatorWithPadding(tok))

    def accuracy(split: str) -> float:
        out = trainer.predict(data[split])
        if out.predictions is None or out.label_ids is None or len(out.label_ids) != len(data[split]):
            raise RuntimeError(f"transformers predicted {0 if out.label_ids is None else len(out.label_ids)} of the "
                               f"{len(data[split])} {split} records")
        return float((np.argmax(out.predictions, axis=-1) == out.label_ids).mean())

    t0 = time.perf_counter()
    trainer.train()
    dev_accuracy = accuracy("dev")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "test_accuracy": accuracy("test"), "dev_accuracy": dev_accuracy,
            "steps": int(trainer.state.global_step), "warmup_steps": warmup,
            "attn_implementation": model.config._attn_implementation}


def run_worker(job: Job) -> dict:
    """Finetune with one implementation, time it (see the module docstring) and score the test set.

    Returns:
        seconds (timed part), test_accuracy, dev_accuracy, steps, warmup_steps, n_train, peak_rss_mb, threads.
    """
    import torch

    if job.impl not in IMPLS:
        raise ValueError(f"impl ({job.impl!r}) must be one of {IMPLS}")
    if job.dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype ({job.dtype!r}) must be fp32 or bf16")
    if job.threads:
        torch.set_num_threads(job.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(job.seed)
    with tempfile.TemporaryDirectory(prefix="pretune-bench-finetune-") as run_dir:
        run = _run_pretune if job.impl == "pretune" else _run_transformers
        out = run(job, run_dir)
    from ..tasks.base import read_records

    return {**out, "n_train": len(read_records(job.train)), "peak_rss_mb": _peak_rss_mb(),
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def _split_file(folder: Path, split: str) -> Path:
    """``folder/<split>.jsonl`` (or another format ``pretune finetune`` reads: .csv, .tsv, .parquet, .gz)."""
    found = sorted(p for p in folder.glob(f"{split}.*") if p.is_file())
    pick = [p for p in found if p.name == f"{split}.jsonl"] or found
    if not pick:
        raise FileNotFoundError(f"{folder} has no {split} file ({split}.jsonl): pass --data FOLDER with "
                                "train, dev and test files")
    return pick[0]


def _limited(train: Path, limit: int, out_dir: Path) -> Path:
    """The first ``limit`` training records as JSONL in ``out_dir``."""
    from ..tasks.base import read_records

    recs = read_records(train)[:limit]
    out = out_dir / "train.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r.data, ensure_ascii=False) + "\n")
    return out


def default_threads() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bench_finetune(*, data=None, model=None, dtypes=("fp32",), rounds: int = 3, limit: int = 0, epochs: float = 1.0,
                   batch: int = 32, lr: float = 5e-5, warmup_ratio: float = 0.1, weight_decay: float = 0.01,
                   max_len: int = 128, seed: int = 0, threads: int = 0, impls=IMPLS, show_progress: bool = True,
                   echo=print) -> list[dict]:
    """Alternate pretune and transformers finetuning runs, one process each, ``rounds`` times per dtype.

    Args:
        data: folder with train, dev and test files (``train.jsonl`` ...); None: ``DEFAULT_DATA`` (sms_spam).
        model: Hugging Face folder; None: MiniLM (``pretune.realmodels.minilm_dir``).
        dtypes: fp32 and/or bf16 (autocast).
        rounds: alternating rounds (who goes first alternates).
        limit: use only the first ``limit`` training records (0: all); dev and test stay whole.
        epochs, batch, lr, warmup_ratio, weight_decay, max_len, seed: see :class:`Job`.
        threads: torch threads of both sides; 0: every core of this machine (:func:`default_threads`).
        echo: where a line per finished run goes (None: nowhere).

    Returns:
        One row per dtype: the settings, ``<impl>_runs`` (per round: seconds, test_accuracy,
        dev_accuracy, peak_rss_mb), ``<impl>_seconds`` and ``<impl>_accuracy`` (medians over rounds),
        ``ratio`` (transformers seconds / pretune seconds), ``accuracy_points`` ((pretune - transformers)
        test accuracy x 100) and ``target_met``.
    """
    from ..io.progress import progress

    if rounds < 1:
        raise ValueError(f"rounds ({rounds}) must be >= 1")
    if limit and limit < batch:
        raise ValueError(f"limit ({limit}) must be at least one batch ({batch})")
    if model is None:
        from ..io.realmodels import minilm_dir

        model = minilm_dir()
    folder = Path(data) if data is not None else DEFAULT_DATA
    if not folder.is_dir():
        raise FileNotFoundError(f"the data folder {folder} is missing: pass --data FOLDER (train/dev/test files)")
    files = {split: _split_file(folder, split) for split in ("train", "dev", "test")}
    threads = threads or default_threads()
    samples: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pretune-bench-finetune-data-") as tmp:
        if limit:
            files["train"] = _limited(files["train"], limit, Path(tmp))
        plan = []
        for r in range(rounds):
            for dt in dtypes:
                order = impls if r % 2 == 0 else tuple(reversed(impls))  # alternate who goes first
                for impl in order:
                    plan.append(Job(impl, dt, model=str(model), **{k: str(v) for k, v in files.items()},
                                    epochs=epochs, batch=batch, lr=lr, warmup_ratio=warmup_ratio,
                                    weight_decay=weight_decay, max_len=max_len, seed=seed, threads=threads))
        for job in progress(plan, desc="bench finetune", unit="run", disable=not show_progress):
            res = spawn_worker(job, "pretune.bench.finetune")
            samples.setdefault((job.dtype, job.impl), []).append(res)
            if echo is not None:
                echo(f"{job.dtype} {job.impl}: {res['seconds']:.1f} s, test accuracy {res['test_accuracy']:.4f}")
    rows = []
    for dt in dtypes:
        first = samples[(dt, impls[0])][0]
        row = {"bench": "finetune", "dtype": dt, "model": str(model), "data": str(folder), "limit": limit,
               "n_train": first["n_train"], "epochs": epochs, "batch": batch, "lr": lr, "warmup_ratio": warmup_ratio,
               "weight_decay": weight_decay, "max_len": max_len, "seed": seed, "rounds": rounds}
        for impl in impls:
            runs = samples[(dt, impl)]
            row[f"{impl}_runs"] = [{k: r[k] for k in ("seconds", "test_accuracy", "dev_accuracy", "peak_rss_mb")}
                                   for r in runs]
            row[f"{impl}_seconds"] = statistics.median(r["seconds"] for r in runs)
            row[f"{impl}_accuracy"] = statistics.median(r["test_accuracy"] for r in runs)
            row[f"{impl}_dev_accuracy"] = statistics.median(r["dev_accuracy"] for r in runs)
            row[f"{impl}_rss_mb"] = statistics.median(r["peak_rss_mb"] for r in runs)
        for key in ("steps", "warmup_steps", "threads"):  # the same schedule and threads, or the run is unfair
            seen = {r[key] for impl in impls for r in samples[(dt, impl)]}
            if len(seen) != 1:
                raise RuntimeError(f"{dt}: the implementations ran with different {key} "
                                   f"{ {impl: [r[key] for r in samples[(dt, impl)]] for impl in impls} }")
            row[key] = seen.pop()
        if "transformers" in impls:
            row["attn_implementation"] = samples[(dt, "transformers")][0].get("attn_implementation")
        if set(impls) == set(IMPLS):
            row["ratio"] = row["transformers_seconds"] / row["pretune_seconds"]
            row["accuracy_points"] = 100 * (row["pretune_accuracy"] - row["transformers_accuracy"])
            row["target_met"] = bool(row["ratio"] >= TARGET_RATIO and abs(row["accuracy_points"]) <= TARGET_POINTS)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows of :func:`bench_finetune` as a text table: every round, then the medians and the target."""
    rows = [r for r in rows if r.get("bench") == "finetune"]
    if not rows:
        return ""
    r0 = rows[0]
    model = Path(r0["model"])
    name = model.parent.name if model.name == "model" else model.name  # the MiniLM package keeps it in .../model
    lines = [f"finetuning {name} on {Path(r0['data']).name}: {r0['n_train']} train records, "
             f"{r0['epochs']:g} epoch(s) = {r0['steps']} steps of {r0['batch']}, lr {r0['lr']:g} linear, warmup "
             f"{r0['warmup_steps']} steps, weight decay {r0['weight_decay']:g}, max_len {r0['max_len']}, "
             f"{r0['threads']} threads",
             "seconds = training loop + one dev evaluation (the rest untimed); accuracy on the test file; "
             "ratio = HF s / pretune s (medians)"]
    head = (f"{'dtype':<6}{'round':<8}{'pretune s':>10}{'pretune acc':>13}{'HF s':>9}{'HF acc':>9}{'ratio':>8}"
            f"{'Δacc pt':>9}")
    lines += [head, "-" * len(head)]
    for r in rows:
        for i, (a, b) in enumerate(zip(r["pretune_runs"], r["transformers_runs"]), 1):
            lines.append(f"{r['dtype']:<6}{i:<8}{a['seconds']:>10.1f}{a['test_accuracy']:>13.4f}{b['seconds']:>9.1f}"
                         f"{b['test_accuracy']:>9.4f}{b['seconds'] / a['seconds']:>8.2f}"
                         f"{100 * (a['test_accuracy'] - b['test_accuracy']):>+9.2f}")
        lines.append(f"{r['dtype']:<6}{'median':<8}{r['pretune_seconds']:>10.1f}{r['pretune_accuracy']:>13.4f}"
                     f"{r['transformers_seconds']:>9.1f}{r['transformers_accuracy']:>9.4f}{r['ratio']:>8.2f}"
                     f"{r['accuracy_points']:>+9.2f}")
        verdict = "met" if r["target_met"] else "NOT met"
        lines.append(f"{r['dtype']}: target (>= {TARGET_RATIO:g}x faster, |Δacc| <= {TARGET_POINTS:g} points): "
                     f"{verdict} ({r['ratio']:.2f}x, {r['accuracy_points']:+.2f} points)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m pretune.bench.finetune [--rounds 3 ...]``; with one JSON argument,
    the worker: run that :class:`Job` and print its result as JSON."""
    from .common import bench_main

    return bench_main(argv, prog="pretune bench finetune", doc=__doc__, job_cls=Job, run_worker=run_worker,
                      add_arguments=add_arguments, run_cli=run_cli)


def add_arguments(p) -> None:
    """The ``pretune bench finetune`` flags, for cli.py's subparser."""
    p.add_argument("--data", metavar="DIR", default=str(DEFAULT_DATA),
                   help="folder with train, dev and test files (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                   help="fp32 (default) and/or bf16 = fp32 weights under torch.autocast(bfloat16)")
    add_run_arguments(p)
    p.add_argument("--limit", type=int, default=0, metavar="N",
                   help="use only the first N training records (smoke tests; default: all)")
    p.add_argument("--epochs", type=float, default=1.0, help="(default 1)")
    p.add_argument("--batch", type=int, default=32, help="(default 32)")
    p.add_argument("--lr", type=float, default=5e-5, help="(default 5e-5)")


def run_cli(args) -> int:
    """Run the benchmark from parsed :func:`add_arguments` flags and print the table."""
    from tqdm import tqdm

    rows = bench_finetune(data=args.data, dtypes=tuple(args.dtypes), rounds=args.rounds, limit=args.limit,
                          epochs=args.epochs, batch=args.batch, lr=args.lr, threads=args.threads, echo=tqdm.write)
    from .common import report

    return report(rows, format_rows(rows), args.json)


if __name__ == "__main__":  # python -m pretune.bench.finetune '{"impl": ...}' (worker) or flags (stand-alone)
    sys.exit(main())
