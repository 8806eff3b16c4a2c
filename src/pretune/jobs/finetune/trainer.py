"""The shared ``Trainer`` of a finetuning run: the training features, dev evaluation (shared out over the processes of
a torchrun run and gathered), keep-best and early stopping as callbacks, the task head at its own learning rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...config import TASK_HEADS, ConfigError
from ...tasks.run import evaluate_task
from .prepare import Prepared


def build_trainer(job: Prepared, *, show_progress: bool, log, dist=None, trackers=None):
    """The shared Trainer over the training features, with dev evaluation (sharded over the processes of a torchrun
    run, gathered), keep-best, early stopping and the train losses (did training take? ``diagnose``); ``trackers``:
    the job's open MLflow / W&B runs (``pretune.train.trackers``)."""
    from ...train.callbacks import EarlyStopping, EvalHistory, KeepBest, TrainLosses
    from ...train.dist import DistInfo
    from ...train.loop import ExampleSet, Trainer

    cfg, model, task, tr = job.cfg, job.model, job.task, job.cfg.train
    feats = job.features["train"]
    higher = task.higher_is_better(job.metric)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}

    def trained_params() -> dict[str, torch.Tensor]:
        return {n: p for n, p in model.named_parameters() if n in trained}

    dist = dist or DistInfo()
    task.dist = dist  # kto, grpo and embedding gather across the processes while training
    trainers = []

    def evaluator() -> dict:
        # FSDP: each process scores its share with the gathered weights (a sharded forward would need every process
        # to run the same number of forwards, which generation does not)
        net = trainers[0].consolidated() if trainers and trainers[0].fsdp else model
        m, _ = evaluate_task(task, net, job.records["dev"], batch_size=tr.batch_size * 2, precision=tr.precision,
                             features=job.features["dev"], show_progress=show_progress, desc="dev", dist=dist)
        return {f"dev_{k}": v for k, v in m.items()}

    callbacks = [EvalHistory(), TrainLosses(), KeepBest(f"dev_{job.metric}", trained_params, higher=higher,
                                         restore=cfg.tune.keep_best)]
    if cfg.tune.patience:
        callbacks.append(EarlyStopping(f"dev_{job.metric}", cfg.tune.patience, higher=higher))
    data = ExampleSet(get=feats.__getitem__, train_ids=np.arange(len(feats)), eval_ids=np.arange(0),
                      lengths=np.array([len(f["input_ids"]) for f in feats]))
    param_lr = None
    if cfg.tune.head_lr:  # the task head at its own rate (PEFT: a fresh head next to a small adapter)
        if model.config.head not in TASK_HEADS or model.head is None:
            raise ConfigError(f"tune.head_lr applies to a task head (classification, regression, tagging, qa); "
                              f"task {task.name!r} trains the model's {model.config.head!r} head")
        param_lr = {id(p): cfg.tune.head_lr for p in model.head.parameters() if p.requires_grad}
        log(f"task head ({sum(p.numel() for p in model.head.parameters()):,} parameters) at lr "
            f"{cfg.tune.head_lr:g}, the rest at {tr.lr:g}")
    trainer = Trainer(model=model, objective=task, data=data, cfg=tr, run_dir=Path(tr.out), tokenizer=job.tokenizer,
                      dist=dist, bucket=True, run_config=cfg, show_progress=show_progress, evaluator=evaluator,
                      callbacks=callbacks, param_lr=param_lr, trackers=trackers)
    trainers.append(trainer)
    return trainer
