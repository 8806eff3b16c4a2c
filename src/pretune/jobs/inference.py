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
                   base: str = "", reference: str = ""):
    """(model, tokenizer, task) of a finetuned checkpoint (its task.json), of an adapter folder written by
    ``finetune`` with peft.method (its base model + the adapter; ``base`` overrides the recorded base), or
    of an HF task model with ``task_overrides={"name": ...}``. A preference task that compares the policy with a
    reference model (dpo's sigmoid / ipo / hinge, kto) gets one: see :func:`attach_reference`."""
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
    task = cls(tcfg, model.config, tok)
    attach_reference(task, model, model_dir, reference)
    return model, tok, task


def attach_reference(task, model, model_dir: str | Path, reference: str = "") -> str:
    """Give a preference task the reference model its loss and rewards compare the policy with, as finetuning did;
    returns what it is ("" when the task needs none):

    * ``reference`` (``--reference MODEL``): that model, frozen;
    * an adapter folder: its base with the adapter switched off (the reference of ``finetune --peft``);
    * a full model: the model its run started from (``model.init`` of the run.yaml saved beside it).
    """
    if not getattr(task, "needs_reference", False):
        return ""
    from .. import peft
    from ..loading import load_pretrained
    from .finetune.methods import AdapterMethod, FullMethod

    what = f"task {task.cfg.name} (task.loss={getattr(task.cfg, 'loss', task.cfg.name)})"
    if reference:
        source = reference
    elif peft.peft_state(model).active:
        task.reference_model = AdapterMethod(peft.peft_state(model).configs[peft.peft_state(model).active[0]]
                                             ).reference(model)
        return "the base with the adapter switched off"
    else:
        source = _run_start(Path(model_dir))
        if not source:
            raise ConfigError(f"{what} compares the model with a reference model, and {model_dir} records none (no "
                              "run.yaml with model.init beside it): pass --reference MODEL (the model the run "
                              "started from)")
        if not Path(source).exists():
            raise ConfigError(f"{what} compares the model with the model its run started from, {source} "
                              f"(model.init of {Path(model_dir) / 'run.yaml'}), which does not exist here: pass "
                              "--reference MODEL")
    ref = load_pretrained(source).model
    if ref.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"--reference {source} has a vocabulary of {ref.config.vocab_size:,} tokens and {model_dir} "
                          f"one of {model.config.vocab_size:,}: the reference must share the model's tokenizer")
    task.reference_model = FullMethod().reference(ref)
    return f"the model {source}"


def _run_start(model_dir: Path) -> str:
    """``model.init`` of the run.yaml saved in a finetuned model's folder ("" when there is none)."""
    from omegaconf import OmegaConf

    path = model_dir / "run.yaml"
    if not path.is_file():
        return ""
    init = OmegaConf.select(OmegaConf.load(path), "model.init", default="")
    return str(init or "")


def _quantize(model, mode: str | None) -> None:
    """int8 / int4 weights (``pretune.quantize``, CPU kernels) for scoring, when asked."""
    if mode is None:
        return
    from ..model import quantize

    if next(model.parameters()).device.type != "cpu":
        raise ConfigError(f"--quantize {mode} runs PyTorch's CPU kernels; the model is on "
                          f"{next(model.parameters()).device}")
    quantize(model.eval().requires_grad_(False), mode)


def evaluate(model_dir: str | Path, data: str | Path, *, task_overrides: dict | None = None, batch_size: int = 64,
             precision: str = "fp32", show_progress: bool = True, errors: str = "strict", base: str = "",
             reference: str = "", quantize: str | None = None) -> dict:
    """The task's metrics of a finetuned model (or adapter folder) on a labelled file (``reference``: a preference
    task's reference model, see :func:`attach_reference`; ``quantize``: int8 / int4 weights, ``pretune.quantize``)."""
    model, tok, task = load_finetuned(model_dir, task_overrides, base=base, reference=reference)
    _quantize(model, quantize)
    records = read_split(str(data), "evaluation", errors)
    metrics, _ = evaluate_task(task, model, records, batch_size=batch_size, precision=precision,
                               show_progress=show_progress)
    return metrics


def predict(model_dir: str | Path, data: str | Path, out: str | Path, *, task_overrides: dict | None = None,
            batch_size: int = 64, precision: str = "fp32", show_progress: bool = True, errors: str = "strict",
            base: str = "", scores: bool = False, reference: str = "", quantize: str | None = None) -> int:
    """Predictions for every record of ``data`` (labels not needed; a record that has one gets it beside its
    prediction as ``gold``) written to ``out`` as JSONL; ``scores``: each record's raw scores too; ``reference``: a
    preference task's reference model (see :func:`attach_reference`)."""
    model, tok, task = load_finetuned(model_dir, task_overrides, base=base, reference=reference)
    _quantize(model, quantize)
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
