"""``pretune finetune``: a checkpoint + labelled data → a task model and its scores.

    cfg = load_finetune_config(None, ["model.init=runs/mlm/model", "task.name=classification",
                                      "data.train=train.jsonl", "data.dev=dev.jsonl", "data.test=test.jsonl"])
    result = finetune(cfg)            # result.model_dir: the finetuned checkpoint; result.test: its metrics

A recipe on the shared trainer: :func:`prepare` (config → model, task, data; every derived value resolved)
→ the same :class:`~pretune.train.loop.Trainer` pretraining uses (its optimizer, schedules, accumulation, bf16,
checkpoints, DDP) with keep-best and early stopping as callbacks → :func:`export` (the model or adapter,
dev/test scores, predictions). How the run trains — all of the model, only the head, or an adapter — is decided
once (:func:`method_for`). The finetuned model is an ordinary checkpoint (config.json with the head and label
map, model.safetensors, tokenizer.json) plus ``task.json`` (how records become inputs), or an adapter folder;
evaluating and predicting with it is :mod:`pretune.jobs.inference`; both run the task through :mod:`pretune.tasks.run`.

This module is the recipe (:func:`finetune`); its steps are modules of their own: ``config`` (the run config and
:func:`load_finetune_config`), ``methods`` (full, head-only or adapter), ``prepare`` (:func:`prepare`,
:func:`resolved_yaml`), ``trainer`` (the ``Trainer`` with keep-best and early stopping), ``export`` and
``diagnose`` (did training take: the dev score against the task's baseline, the train loss's fall) and ``defaults``
(the batch size and epochs chosen from the number of training examples, where the user left them).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ...loading import TASK_FILE
from ...tasks.run import encode_records, evaluate_task, run_outputs, subsample
from ...train.precision import resolve_precision
from ...train.trackers import open_trackers
from ..inference import evaluate, load_finetuned, predict  # re-exported: finetune's API before inference.py
from .config import FinetuneConfig, FinetuneData, TuneConfig, _stored_as_now, load_finetune_config
from .export import FinetuneResult, export
from .methods import method_for
from .prepare import Prepared, prepare, resolved_yaml
from .trainer import build_trainer

__all__ = ["FinetuneConfig", "FinetuneData", "TuneConfig", "FinetuneResult", "Prepared", "load_finetune_config",
           "prepare", "resolved_yaml", "finetune", "export", "method_for", "evaluate", "predict", "load_finetuned",
           "encode_records", "run_outputs", "evaluate_task", "subsample", "TASK_FILE"]


def finetune(cfg: FinetuneConfig, *, resume: bool = False, overwrite: bool = False, show_progress: bool = True,
             log=print) -> FinetuneResult:
    """Train ``cfg.model`` on ``cfg.data`` for ``cfg.task``; keep the best dev model; score dev and test.

    ``train.out`` must be a new (or empty) folder; ``overwrite=True`` starts over in an earlier run's folder
    (removing what that run wrote, nothing else); ``resume=True`` continues the run there from its newest intact
    checkpoint, bit for bit as if it had not stopped (its config may differ only as ``runconfig.check_resume``
    allows).

    Under ``torchrun`` (the same command, N processes): each process trains on its share of every batch (DDP, or
    FSDP with ``train.parallel=fsdp``) and scores its share of dev and test; process 0 alone writes and logs."""
    from ...train.dist import init_distributed, shutdown

    dist = init_distributed()
    try:
        if not dist.is_main:
            log, show_progress = (lambda *a, **k: None), False
        return _finetune(cfg, dist, resume=resume, overwrite=overwrite, show_progress=show_progress, log=log)
    finally:
        shutdown(dist)


def _finetune(cfg: FinetuneConfig, dist, *, resume: bool, overwrite: bool, show_progress: bool,
              log) -> FinetuneResult:
    from ...io.outputs import check_folder, prepare_run_folder
    from ...model import count_parameters
    from ...train.dist import barrier
    from ...train.elastic import record_launch, restart_mode
    from ...train.precision import precision_line

    # started again by torchrun after a failure (--max-restarts): the launch's own run resumes by itself
    resume, overwrite = restart_mode(cfg.train.out, dist, resume=resume, overwrite=overwrite, log=log)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.set_flush_denormal(True)
    if dist.is_main:
        check_folder(cfg.train.out, overwrite=overwrite, resume=resume, what="run")  # before any work
    requested = cfg.train.precision
    resolve_precision(requested, dist.device, warn=log)
    job = prepare(cfg, show_progress=show_progress, log=log)
    cfg, model, task, tr = job.cfg, job.model, job.task, job.cfg.train
    run_dir = Path(tr.out)
    if dist.is_main:
        run_dir = prepare_run_folder(tr.out, cfg.to_dict(), resume=resume, overwrite=overwrite, log=log,
                                     derived=tuple(job.derived), stored_as_now=_stored_as_now)
    record_launch(run_dir, dist)
    barrier(dist)
    if getattr(cfg.task, "precompute_reference", False):  # dpo, kto: the reference pass once, before training
        from .reference import precompute_reference

        precompute_reference(job, run_dir, resume=resume, is_main=dist.is_main, barrier=lambda: barrier(dist),
                             show_progress=show_progress, log=log)
    counts = count_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = {k: len(v) for k, v in job.records.items()}
    test = f" / {n['test']} test" if n["test"] else ""
    log(f"pretune finetune: {task.name} on {model.config.arch} model ({counts['total'] / 1e6:.2f}M parameters, "
        f"{trainable / 1e6:.2f}M trainable, {job.method.name}{', from scratch' if cfg.tune.from_scratch else ''}), "
        f"{n['train']} train / {n['dev']} dev{test} records"
        f"{f', {len(task.labels)} labels' if task.labels else ''}; {tr.steps} steps of {tr.batch_size} "
        f"({f'{cfg.tune.epochs:g} epochs' if cfg.tune.epochs else 'train.steps, as tune.epochs=0'}) at lr "
        f"{tr.lr:g}, dev {job.metric} every {tr.eval_every} steps -> {run_dir}"
        + (f", {dist.world} processes ({tr.parallel})" if dist.enabled else ""))
    log(precision_line(requested, tr.precision, dist.device))
    if job.method.base_note:
        log(job.method.base_note)
    # process 0's MLflow / W&B runs (train.report_to); ended as failed if anything below raises
    with open_trackers(tr, run_dir, config=cfg.to_dict(), job="finetune", resume=resume,
                       enabled=dist.is_main) as trackers:
        trainer = build_trainer(job, show_progress=show_progress, log=log, dist=dist, trackers=trackers)
        t0 = time.perf_counter()
        result = trainer.fit(resume=resume, log=log)
        seconds = time.perf_counter() - t0
        job = dataclasses.replace(job, model=trainer.consolidated())  # FSDP: the gathered weights, a plain model
        out = export(job, trainer, result.step, seconds, show_progress=show_progress, log=log, dist=dist)
        trackers.log_artifacts(run_dir, ["results.json", "loss.png", "run.yaml"])
    return out
