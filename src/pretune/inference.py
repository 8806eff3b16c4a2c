"""A finetuned model at work: features, batched outputs, metrics and predictions. What finetuning's dev/test
evaluation and ``pretune evaluate`` / ``pretune predict`` share.

    scores = evaluate("runs/finetune/model", "test.jsonl")            # the task's metrics
    n = predict("runs/finetune/model", "new.jsonl", "predictions.jsonl")
    model, tok, task = load_finetuned("runs/finetune/model")          # any folder the loader takes, its task.json
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch

from .config import TASK_HEADS, ConfigError
from .loading import TASK_FILE
from .tasks.base import Record, TaskConfig

__all__ = ["evaluate", "predict", "load_finetuned", "load_task_config", "save_task", "encode_records", "run_outputs",
           "score", "evaluate_task", "write_predictions", "format_scores", "read_split"]


def save_task(path: Path, task_cfg: TaskConfig) -> None:
    """task.json beside a saved model (recorded in the folder's marker: a later --overwrite replaces it)."""
    from .outputs import mark

    (path / TASK_FILE).write_text(json.dumps(dataclasses.asdict(task_cfg), indent=2) + "\n")
    mark(path, [TASK_FILE])


def load_task_config(model_dir: str | Path, overrides: dict | None = None) -> TaskConfig:
    """The task.json saved with a finetuned model (or defaults), with field overrides."""
    from .loading import read_task
    from .runconfig import section as typed

    data = read_task(model_dir) or {}
    data.update(overrides or {})
    return typed("task", TaskConfig, data)


def encode_records(task, records: list[Record], *, labelled: bool = True, show_progress: bool = False,
                   desc: str = "encode") -> list[dict]:
    """Every record's features, each tagged with its record index (``_record``)."""
    from tqdm.auto import tqdm

    feats = []
    for i, rec in enumerate(tqdm(records, desc=desc, unit="rec", disable=not show_progress or len(records) < 2000,
                                 leave=False)):
        for f in task.encode(rec, labelled=labelled):
            f["_record"] = i
            feats.append(f)
    return feats


@torch.no_grad()
def run_outputs(task, model, features: list[dict], *, batch_size: int = 64, precision: str = "fp32",
                show_progress: bool = False, loss_sums: dict | None = None, desc: str = "predict") -> list:
    """Raw task outputs for every feature, batched by length (least padding), in the input order.
    With ``loss_sums`` (a dict), also accumulates the loss-term sums and counts (for perplexity)."""
    import contextlib

    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = np.argsort([len(f["input_ids"]) for f in features], kind="stable")
    out: list = [None] * len(features)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for chunk in tqdm(chunks, desc=desc, unit="batch", disable=not show_progress, leave=False, dynamic_ncols=True):
        batch = task.collate([features[i] for i in chunk])
        batch = {k: v.to(device) for k, v in batch.items()}
        with ctx:
            if loss_sums is not None:
                counts = task.counts(batch)
                _, stats = task.loss(model, batch, {k: 1.0 for k in counts})
                for k, v in list(stats.items()) + [(f"{k}_n", float(n)) for k, n in counts.items()]:
                    loss_sums[k] = loss_sums.get(k, 0.0) + v
            res = task.outputs(model, batch)
        for i, r in zip(chunk, res):
            out[int(i)] = r
    model.train(was_training)
    return out


def _sharded_outputs(task, model, features: list[dict], dist, *, loss_sums: dict | None, **kw) -> list:
    """run_outputs over this process's share of ``features`` (every world-th), gathered from all processes into
    the input order; ``loss_sums`` summed over them."""
    from .train.dist import all_gather_objects

    mine = list(range(dist.rank, len(features), dist.world))
    part_sums: dict | None = {} if loss_sums is not None else None
    outs = run_outputs(task, model, [features[i] for i in mine], loss_sums=part_sums, **kw)
    out: list = [None] * len(features)
    for ids, res, sums in all_gather_objects((mine, outs, part_sums), dist):
        for i, r in zip(ids, res):
            out[i] = r
        for k, v in (sums or {}).items():
            loss_sums[k] = loss_sums.get(k, 0.0) + v
    return out


def score(task, records: list[Record], predictions: list) -> dict:
    """The task's metrics (``task.score``) of ``predictions`` against the records' gold."""
    return task.score(predictions, [task.reference(r) for r in records])


def evaluate_task(task, model, records: list[Record], *, batch_size: int = 64, precision: str = "fp32",
                  show_progress: bool = False, features: list[dict] | None = None,
                  desc: str = "evaluate", dist=None) -> tuple[dict, list]:
    """(metrics, predictions) of ``model`` on labelled ``records``. ``dist`` (a DistInfo of several processes):
    each process runs every world-th feature and the outputs are gathered in order, so every process gets the
    metrics one process would compute."""
    if features is None:
        features = encode_records(task, records, labelled=True, show_progress=show_progress)
    sums: dict | None = {} if getattr(task, "reports_perplexity", False) else None
    if dist is not None and dist.enabled:
        outs = _sharded_outputs(task, model, features, dist, batch_size=batch_size, precision=precision,
                                show_progress=show_progress, loss_sums=sums, desc=desc)
    else:
        outs = run_outputs(task, model, features, batch_size=batch_size, precision=precision,
                           show_progress=show_progress, loss_sums=sums, desc=desc)
    preds = task.predict(records, features, outs)
    metrics = score(task, records, preds)
    if sums:
        metrics["perplexity"] = math.exp(min(sums["lm_loss"] / max(sums["lm_n"], 1.0), 50.0))
    return metrics, preds


def read_split(path: str | Path, what: str, errors: str = "strict") -> list[Record]:
    from .data.readers import DataError
    from .tasks.base import read_records

    records = read_records(path, errors=errors)
    if not records:
        raise DataError(f"{path}: the {what} set is empty")
    return records


def format_scores(split: str, metrics: dict) -> str:
    return f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def load_finetuned(model_dir: str | Path, task_overrides: dict | None = None, tokenizer: str = "",
                   base: str = ""):
    """(model, tokenizer, task) of a finetuned checkpoint (its task.json), of an adapter folder written by
    ``finetune`` with peft.method (its base model + the adapter; ``base`` overrides the recorded base), or
    of an HF task model with ``task_overrides={"name": ...}``."""
    from .loading import load_pretrained
    from .tasks import TASKS

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


def write_predictions(task, records: list[Record], preds: list, out: Path, scores: list | None = None) -> None:
    """JSONL, one line per record: its row, the task's fields, the prediction, the gold answer when the record has
    one (``gold``) and, with ``scores``, the raw scores; written atomically."""
    import os

    from .data.readers import DataError

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, (rec, pred) in enumerate(zip(records, preds)):
                line = {"row": rec.row, **task.prediction_json(rec, pred)}
                try:
                    line["gold"] = task.reference(rec)
                except (DataError, KeyError, ValueError):
                    pass  # an unlabelled record
                if scores is not None and scores[i] is not None:
                    line["scores"] = scores[i]
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
