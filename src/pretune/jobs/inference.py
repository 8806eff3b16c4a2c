"""A finetuned model at work: ``pretune evaluate`` / ``pretune predict`` on a model folder.

    scores = evaluate("runs/finetune/model", "test.jsonl")            # the task's metrics
    n = predict("runs/finetune/model", "new.jsonl", "predictions.jsonl")
    model, tok, task = load_finetuned("runs/finetune/model")          # any folder the loader takes, its task.json

Running a task on a model (features, batched outputs, metrics, prediction files) is :mod:`pretune.tasks.run`,
which finetuning's dev/test evaluation shares; its names are importable from here as well.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import TASK_HEADS, ConfigError
from ..loading import TASK_FILE
from ..tasks.base import TaskConfig
from ..tasks.run import (  # re-exported: where they were before tasks/run.py
    encode_records,
    evaluate_task,
    format_scores,
    read_split,
    run_outputs,
    save_task,
    score,
    write_predictions,
)

__all__ = ["evaluate", "predict", "load_finetuned", "load_task_config", "save_task", "encode_records", "run_outputs",
           "score", "evaluate_task", "write_predictions", "format_scores", "read_split"]


def load_task_config(model_dir: str | Path, overrides: dict | None = None) -> TaskConfig:
    """The task.json saved with a finetuned model (or defaults), with field overrides."""
    from ..loading import read_task
    from ..runconfig import section as typed

    data = read_task(model_dir) or {}
    data.update(overrides or {})
    return typed("task", TaskConfig, data)


def load_finetuned(model_dir: str | Path, task_overrides: dict | None = None, tokenizer: str = "",
                   base: str = ""):
    """(model, tokenizer, task) of a finetuned checkpoint (its task.json), of an adapter folder written by
    ``finetune`` with peft.method (its base model + the adapter; ``base`` overrides the recorded base), or
    of an HF task model with ``task_overrides={"name": ...}``."""
    from ..loading import load_pretrained
    from ..tasks import TASKS

    loaded = load_pretrained(model_dir, base=base or None, tokenizer=tokenizer or None)
    model, tok = loaded.model, loaded.tokenizer
    tcfg = load_task_config(model_dir, task_overrides)
    if not (Path(model_dir) / TASK_FILE).is_file() and not (task_overrides or {}).get("name"):
        guess = {"classification": "multilabel" if model.config.multi_label else "classification",
                 "regression": "regression", "tagging": "tagging", "qa": "qa"}.get(model.config.head)
        if guess is None:
            raise ConfigError(f"{model_dir} has no {TASK_FILE} and no task head: pass --task NAME")
        tcfg = dataclasses.replace(tcfg, name=guess)
    cls = TASKS[tcfg.name]
    if cls.model_head != model.config.head:
        what = "a task head" if model.config.head in TASK_HEADS else f"head={model.config.head!r}"
        raise ConfigError(f"{model_dir} has {what}, but task {tcfg.name!r} needs head={cls.model_head!r}")
    return model, tok, cls(tcfg, model.config, tok)


def evaluate(model_dir: str | Path, data: str | Path, *, task_overrides: dict | None = None, batch_size: int = 64,
             precision: str = "fp32", show_progress: bool = True, errors: str = "strict", base: str = "") -> dict:
    """The task's metrics of a finetuned model (or adapter folder) on a labelled file."""
    model, tok, task = load_finetuned(model_dir, task_overrides, base=base)
    records = read_split(str(data), "evaluation", errors)
    metrics, _ = evaluate_task(task, model, records, batch_size=batch_size, precision=precision,
                               show_progress=show_progress)
    return metrics


def predict(model_dir: str | Path, data: str | Path, out: str | Path, *, task_overrides: dict | None = None,
            batch_size: int = 64, precision: str = "fp32", show_progress: bool = True, errors: str = "strict",
            base: str = "", scores: bool = False) -> int:
    """Predictions for every record of ``data`` (labels not needed; a record that has one gets it beside its
    prediction as ``gold``) written to ``out`` as JSONL; ``scores``: each record's raw scores too."""
    model, tok, task = load_finetuned(model_dir, task_overrides, base=base)
    records = read_split(str(data), "prediction", errors)
    if show_progress:
        print(f"predicting {len(records)} records of {data} with {model_dir} ...", flush=True)
    feats = encode_records(task, records, labelled=False, show_progress=show_progress)
    outs = run_outputs(task, model, feats, batch_size=batch_size, precision=precision, show_progress=show_progress)
    preds = task.predict(records, feats, outs)
    raw = None
    if scores:
        first = {}
        for f, o in zip(feats, outs):
            first.setdefault(f["_record"], o)
        raw = [task.scores_json(first.get(i)) for i in range(len(records))]
    write_predictions(task, records, preds, Path(out), scores=raw)
    return len(preds)
