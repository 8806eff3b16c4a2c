"""A task at work on a model: records → features → batched outputs → predictions → metrics, and the files a run
writes (``task.json`` beside a model, predictions as JSONL). What finetuning's dev/test evaluation, ``pretune
evaluate`` / ``pretune predict`` and the benchmarks share.

    records = read_split("dev.jsonl", "dev")
    metrics, predictions = evaluate_task(task, model, records)

Several processes (a torchrun job) share an evaluation through ``dist``: any object with ``rank``, ``world``,
``enabled`` and ``all_gather(obj) -> [obj of each process]`` (the job passes its ``train.dist.DistInfo``); this
module knows nothing of process groups.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..data.readers import DataError
from ..io.checkpoint import TASK_FILE
from .base import Record, TaskConfig, read_records

__all__ = ["read_split", "read_splits", "subsample", "encode_records", "run_outputs", "score", "evaluate_task",
           "write_predictions", "format_scores", "save_task", "task_json", "Processes"]


class Processes(Protocol):
    """The processes an evaluation is shared among (``train.dist.DistInfo`` is one)."""

    rank: int
    world: int

    @property
    def enabled(self) -> bool: ...

    def all_gather(self, obj) -> list: ...


def read_split(path: str | Path, what: str, errors: str = "strict") -> list[Record]:
    """The records of one data file (``what`` names the split in the error when it holds none)."""
    records = read_records(path, errors=errors)
    if not records:
        raise DataError(f"{path}: the {what} set is empty")
    return records


def read_splits(train: str | Path, dev: str | Path = "", test: str | Path = "", *, dev_fraction: float = 0.1,
                seed: int = 0, errors: str = "strict") -> dict[str, list[Record]]:
    """The train, dev and test records (test: [] without a file); without a dev file, a seeded ``dev_fraction`` of
    the training records is held out as dev."""
    records = {"train": read_split(train, "training", errors)}
    if dev:
        records["dev"] = read_split(dev, "dev", errors)
    else:
        train = records["train"]
        held = set(np.random.default_rng(seed).permutation(len(train))[:max(1, round(len(train) * dev_fraction))]
                   .tolist())
        records["train"] = [r for i, r in enumerate(train) if i not in held]
        records["dev"] = [r for i, r in enumerate(train) if i in held]
    records["test"] = read_split(test, "test", errors) if test else []
    return records


def subsample(records: list[Record], n: int, seed: int) -> list[Record]:
    """A seeded random ``n`` of ``records``, in their file order (``n`` 0 or at least ``len(records)``: all).
    The draw is the first ``n`` of one permutation fixed by ``seed``, so a larger ``n`` with the same seed keeps
    every record of a smaller one (nested subsamples make learning curves comparable)."""
    if not n or n >= len(records):
        return records
    keep = np.sort(np.random.default_rng(seed).permutation(len(records))[:n])
    return [records[i] for i in keep]


def encode_records(task, records: list[Record], *, labelled: bool = True, show_progress: bool = False,
                   desc: str = "encode") -> list[dict]:
    """Every record's features, each tagged with its record index (``_record``)."""
    from ..io.progress import progress

    feats = []
    for i, rec in enumerate(progress(records, desc=desc, unit="rec", leave=False,
                                     disable=not show_progress or len(records) < 2000)):
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

    from ..io.progress import progress

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = np.argsort([len(f["input_ids"]) for f in features], kind="stable")
    out: list = [None] * len(features)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for chunk in progress(chunks, desc=desc, unit="batch", disable=not show_progress, leave=False, dynamic_ncols=True):
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


def _sharded_outputs(task, model, features: list[dict], dist: Processes, *, loss_sums: dict | None, **kw) -> list:
    """run_outputs over this process's share of ``features`` (every world-th), gathered from all processes into
    the input order; ``loss_sums`` summed over them."""
    mine = list(range(dist.rank, len(features), dist.world))
    part_sums: dict | None = {} if loss_sums is not None else None
    outs = run_outputs(task, model, [features[i] for i in mine], loss_sums=part_sums, **kw)
    out: list = [None] * len(features)
    for ids, res, sums in dist.all_gather((mine, outs, part_sums)):
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
                  desc: str = "evaluate", dist: Processes | None = None) -> tuple[dict, list]:
    """(metrics, predictions) of ``model`` on labelled ``records``. ``dist`` (several processes, see the module
    docstring): each process runs every world-th feature and the outputs are gathered in order, so every process
    gets the metrics one process would compute."""
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


def format_scores(split: str, metrics: dict) -> str:
    """``split: name value, ...`` (four decimals)."""
    return f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def write_predictions(task, records: list[Record], preds: list, out: Path, scores: list | None = None) -> None:
    """JSONL, one line per record: its row, the task's fields, the prediction, the gold answer when the record has
    one (``gold``) and, with ``scores``, the raw scores; written atomically."""
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


def task_json(task_cfg: TaskConfig) -> str:
    """The text of ``task.json``: how a finetuned model's records become inputs (``loading.read_task`` reads it)."""
    return json.dumps(dataclasses.asdict(task_cfg), indent=2) + "\n"


def save_task(path: Path, task_cfg: TaskConfig) -> None:
    """task.json beside a saved model (recorded in the folder's marker: a later --overwrite replaces it)."""
    from ..io.outputs import mark

    (Path(path) / TASK_FILE).write_text(task_json(task_cfg))
    mark(path, [TASK_FILE])
