"""After training: save the (best) model or adapter, score dev and test, say whether training took (``diagnose``),
write results.json, the test predictions and the loss plot."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...tasks.run import evaluate_task, format_scores, write_predictions
from .diagnose import check_training, format_warnings
from .prepare import Prepared


@dataclass
class FinetuneResult:
    run_dir: Path
    model_dir: Path
    steps: int
    seconds: float
    dev: dict
    test: dict
    best_step: int | None
    history: list = field(default_factory=list)  # (step, dev metrics) of every evaluation
    warnings: list = field(default_factory=list)  # training did not take (diagnose.check_training): dicts


def _size(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def export(job: Prepared, trainer, steps: int, seconds: float, *, show_progress: bool = True,
           log=print, dist=None) -> FinetuneResult:
    """After training: save the (best) model or adapter, score dev and test, write results.json, predictions
    and the loss plot. ``dist``: several processes score the test set together; process 0 writes."""
    from ...io.outputs import mark
    from ...train.callbacks import EvalHistory, KeepBest
    from ...train.dist import DistInfo, barrier

    dist = dist or DistInfo()

    cfg, model, task, tr = job.cfg, job.model, job.task, job.cfg.train
    run_dir = Path(tr.out)
    history = next(cb for cb in trainer.callbacks if isinstance(cb, EvalHistory)).history
    best = next(cb for cb in trainer.callbacks if isinstance(cb, KeepBest))
    if best.restored:
        log(f"keeping the best dev model: step {best.best_step} ({job.metric} {best.best:.4f})")
    model_dir = run_dir / "model"
    extra = {}
    if dist.is_main:
        if hasattr(task, "write_model_files"):  # embedding, rerank: another library's folder (merged weights)
            extra = job.method.save_library_folder(task, model, job.tokenizer, model_dir, cfg, log)
        else:
            extra = job.method.save(model, job.tokenizer, model_dir, cfg, log)
        cfg.save(model_dir / "run.yaml")
        mark(model_dir, ["run.yaml"])
    if history and not cfg.tune.keep_best:
        dev_final = history[-1][1]
    else:
        dev_final = dict(next(h for s, h in history if s == best.best_step)) if best.best_step is not None else {}
    test_metrics = {}
    if job.records["test"]:
        # in fp32 whatever the training precision: the scores `pretune evaluate MODEL TEST` reproduces; a base stored in
        # bf16 (peft.base_dtype) runs only under bf16 autocast, where it gives exactly what the fp32 base gives: the
        # scores of `pretune evaluate MODEL TEST --precision bf16`
        precision = "bf16" if job.method.base_dtype == "bf16" else "fp32"
        if precision == "bf16":
            log("test: scored under bf16 autocast, as the base is stored in bf16 (peft.base_dtype): `pretune evaluate "
                "MODEL TEST --precision bf16` gives these scores")
        test_metrics, preds = evaluate_task(task, model, job.records["test"], batch_size=tr.batch_size * 2,
                                            precision=precision, features=job.features["test"],
                                            show_progress=show_progress, desc="test", dist=dist)
        if dist.is_main:
            write_predictions(task, job.records["test"], preds, run_dir / "test_predictions.jsonl")
    baseline, warnings = check_training(job, trainer, steps, dev=dev_final, test=test_metrics)
    results = {"task": task.name, "metric": job.metric, "best_step": best.best_step, "steps": steps,
               "stopped_early": trainer.stopped_early, "train_seconds": seconds, "dev": dev_final,
               "test": test_metrics, "baseline": baseline, "warnings": warnings,
               "history": [{"step": s, **h} for s, h in history], **extra}
    if dist.is_main:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if tr.plot and (run_dir / "metrics.jsonl").is_file():
            from ...train.logging import plot_losses

            plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png", title=f"finetune {task.name}")
        mark(run_dir, ["model", "results.json", "test_predictions.jsonl", "loss.png"])
    barrier(dist)
    log(format_scores("dev", dev_final) + ("\n" + format_scores("test", test_metrics) if test_metrics else ""))
    log(f"model -> {model_dir}  ({steps} steps, {seconds:.1f}s); the run folder holds {_size(run_dir) / 1e6:.1f} MB")
    if job.method.layout_note:  # an adapter: which layout it was written in, and why when not peft's
        log(job.method.layout_note)
    if warnings:  # the last lines of the run, where they are seen
        log(format_warnings(warnings))
    return FinetuneResult(run_dir=run_dir, model_dir=model_dir, steps=steps, seconds=seconds, dev=dev_final,
                          test=test_metrics, best_step=best.best_step, history=history, warnings=warnings)
