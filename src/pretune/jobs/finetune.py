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
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..config import TASK_HEADS, ConfigError
from ..loading import TASK_FILE
from ..peft.config import PeftConfig, base_dtype_for
from ..runconfig import TrainConfig, check_batch, check_train, merge_layers, section
from ..tasks.base import Record, TaskConfig
from ..tasks.run import (
    encode_records,
    evaluate_task,
    format_scores,
    read_splits,
    run_outputs,
    save_task,
    subsample,
    task_json,
    write_predictions,
)
from ..train.precision import describe_device, resolve_precision
from .inference import evaluate, load_finetuned, predict  # re-exported: finetune's API before inference.py

__all__ = ["FinetuneConfig", "FinetuneData", "TuneConfig", "FinetuneResult", "Prepared", "load_finetune_config",
           "prepare", "resolved_yaml", "finetune", "export", "method_for", "evaluate", "predict", "load_finetuned",
           "encode_records", "run_outputs", "evaluate_task", "subsample", "TASK_FILE"]


@dataclass
class FinetuneData:
    """Labelled files (JSONL, CSV/TSV, Parquet; .gz works): train, dev (model selection), test (reported)."""

    train: str = ""  # training records
    dev: str = ""  # dev records for evaluation during training; empty: hold out dev_fraction of train
    test: str = ""  # test records scored once at the end with the final (best) model
    dev_fraction: float = 0.1  # share of train held out as dev when `dev` is empty
    errors: Literal["strict", "replace"] = "strict"  # non-UTF-8 bytes: stop naming the line, or replace
    packing: bool = False  # sft: several training examples per row of task.max_len tokens (none sees another)
    train_limit: int = 0  # train on a random N of the training records (after the dev split), drawn with train.seed:
    # the same N and seed give the same records, a larger N a superset of a smaller one (learning curves); 0: all


@dataclass
class TuneConfig:
    """What is trained and for how long; model selection on the dev set."""

    epochs: float = 3.0  # passes over the training data; sets train.steps (0: use train.steps)
    from_scratch: bool = False  # random initialisation, same architecture as model.init: what pretraining buys
    freeze_body: bool = False  # train only the task head (a linear probe of the pretrained features)
    evals_per_epoch: int = 1  # dev evaluations per epoch (when train.eval_every is 0)
    patience: int = 0  # stop after this many evaluations without dev improvement; 0: never stop early
    keep_best: bool = True  # the final model is the one with the best dev metric, not the last
    warmup_ratio: float = 0.1  # linear warmup over this share of the steps (when train.warmup_steps is 0)
    head_lr: float = 0.0  # peak lr of a task head (classifier, tagger, QA span head); 0: train.lr, with --peft HEAD_LR


FULL_LR = 5e-5  # full finetuning's default peak learning rate (BERT's range is 2e-5..5e-5; Devlin et al. 2019)
# a fresh task head next to a frozen body (PEFT, a linear probe): without a rate of its own it barely moves in a
# few epochs at an adapter's 1e-3 and settles on the majority class (measured: BENCHMARKS.md, PEFT vs full)
HEAD_LR = 1e-2
FINETUNE_TRAIN_DEFAULTS = dict(out="runs/finetune", lr=0.0, batch_size=32, eval_every=0, save_every=0,
                               keep_last=1, log_every=10, tensorboard=False)


@dataclass
class FinetuneConfig:
    """A finetuning run: ``model.init`` (checkpoint, HF or adapter folder) or ``model.preset`` (from scratch)."""

    model: dict = field(default_factory=dict)
    tokenizer: str = ""  # tokenizer.json or folder; empty: the one saved with model.init
    task: TaskConfig = field(default_factory=TaskConfig)
    data: FinetuneData = field(default_factory=FinetuneData)
    tune: TuneConfig = field(default_factory=TuneConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # peft.method empty: full finetuning
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**FINETUNE_TRAIN_DEFAULTS))  # lr 0: the default

    SECTIONS = {"task": TaskConfig, "data": FinetuneData, "tune": TuneConfig, "peft": PeftConfig,
                "train": TrainConfig}

    def to_dict(self) -> dict:
        return {"model": dict(self.model), "tokenizer": self.tokenizer,
                **{k: dataclasses.asdict(getattr(self, k)) for k in self.SECTIONS}}

    def save(self, path: str | Path) -> None:
        from omegaconf import OmegaConf

        Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(self.to_dict())))


def _stored_as_now(stored: dict) -> dict:
    """A run.yaml's config as a run writes it now: the task and peft sections hold what applies to the task and
    methods they name (a run.yaml written before those settings moved to their owners lists every key)."""
    from ..peft.config import peft_settings
    from ..tasks import task_settings

    out = dict(stored)
    for key, build in (("task", task_settings), ("peft", peft_settings)):
        try:
            out[key] = dataclasses.asdict(build(dict(stored.get(key) or {})))
        except ConfigError:
            pass  # as it was: the comparison names what differs
    return out


def load_finetune_config(yaml_file: str | Path | None = None, overrides=(), base: dict | None = None) -> FinetuneConfig:
    """defaults ← YAML ← flags (``base``) ← ``section.key=value``, validated (unknown keys name the nearest)."""
    from ..peft.config import peft_defaults
    from ..tasks import task_defaults

    # the task and peft sections belong to the task and methods they name (each checks its own settings): their
    # bottom layer holds every task's and method's keys, and each section keeps those that apply
    defaults = {**FinetuneConfig().to_dict(), "task": task_defaults(), "peft": peft_defaults()}
    merged = merge_layers(defaults, yaml_file, overrides, base, ["model", "tokenizer", *FinetuneConfig.SECTIONS])
    cfg = FinetuneConfig(model=merged["model"], tokenizer=str(merged.get("tokenizer") or ""),
                         **{k: section(k, c, merged.get(k) or {}) for k, c in FinetuneConfig.SECTIONS.items()})
    tune, tr = cfg.tune, cfg.train
    for key, value, ok, want in (("tune.epochs", tune.epochs, tune.epochs >= 0, ">= 0 (0: train for train.steps)"),
                                 ("tune.patience", tune.patience, tune.patience >= 0, ">= 0 (0: never stop early)"),
                                 ("tune.evals_per_epoch", tune.evals_per_epoch, tune.evals_per_epoch >= 1, ">= 1"),
                                 ("tune.warmup_ratio", tune.warmup_ratio, 0 <= tune.warmup_ratio < 1, "in [0, 1)")):
        if not ok:
            raise ConfigError(f"{key}={value:g}: expected {want}")
    check_batch(tr)
    if tr.lr < 0:
        raise ConfigError(f"train.lr={tr.lr} must be > 0 (or 0: the method's default)")
    if tune.head_lr < 0:
        raise ConfigError(f"tune.head_lr={tune.head_lr} must be >= 0 (0: the head learns at train.lr)")
    if not 0 < cfg.data.dev_fraction < 1:
        raise ConfigError(f"data.dev_fraction={cfg.data.dev_fraction} must be in (0, 1)")
    if cfg.data.train_limit < 0:
        raise ConfigError(f"data.train_limit={cfg.data.train_limit}: expected a number of training records >= 0 "
                          "(0: all of them)")
    if cfg.peft.method:
        if tune.freeze_body or tune.from_scratch:
            raise ConfigError("peft.method trains adapters on a frozen pretrained body: it does not combine with "
                              "tune.freeze_body or tune.from_scratch")
        if not cfg.model.get("init"):
            raise ConfigError("peft.method needs a pretrained base: set model.init=CHECKPOINT")
    base_dtype_for(cfg.peft, tr.precision)  # bf16 needs a PEFT method and bf16 matmuls
    return cfg


# ----------------------------------------------------------------------------------------------
# how the run trains: the one place that asks about PEFT
# ----------------------------------------------------------------------------------------------
class FullMethod:
    """Every weight trains (or, with tune.freeze_body, only the task head); the result is a whole checkpoint."""

    def __init__(self, freeze_body: bool = False):
        self.freeze_body = freeze_body
        self.name = "head only (body frozen)" if freeze_body else "full finetuning"
        self.default_lr = HEAD_LR if freeze_body else FULL_LR  # a linear probe trains only a fresh head
        self.base_dtype, self.base_note = "fp32", ""  # every weight stays fp32

    def default_head_lr(self, lr: float) -> float:
        """The task head's rate when tune.head_lr is not set: the run's (full finetuning, a probe)."""
        return lr

    def room(self, cfg: FinetuneConfig, model_cfg) -> int:
        """Positions the task's inputs may take (all of them)."""
        return model_cfg.max_seq_len

    def setup(self, model, tok, cfg: FinetuneConfig, log) -> None:
        if self.freeze_body:
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("head."))

    def save(self, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        from ..io.checkpoint import save

        if self.freeze_body:
            for p in model.parameters():
                p.requires_grad_(True)
        save(model, model_dir, tokenizer=tok)
        save_task(model_dir, cfg.task)
        return {}


class AdapterMethod:
    """A parameter-efficient adapter (``peft.method``) on a frozen base; the result is a small adapter folder
    (peft's layout for LoRA) that records its base."""

    def __init__(self, peft_cfg: PeftConfig):
        from ..peft import METHODS

        self.cfg = peft_cfg
        self.modules = [METHODS[m] for m in peft_cfg.methods]
        self.name = f"peft {peft_cfg.method}"
        self.default_lr = self.modules[0].DEFAULT_LR  # a combination: the first method's
        self.base_dtype = "fp32"  # how the frozen base's linear weights are stored (peft.base_dtype, resolved)
        self.base_note = ""  # the start line saying so, when they are cast
        self.base_bytes_saved = 0

    def default_head_lr(self, lr: float) -> float:
        """The task head's rate when tune.head_lr is not set: HEAD_LR, or the run's when that is higher."""
        return max(lr, HEAD_LR)

    def room(self, cfg: FinetuneConfig, model_cfg) -> int:
        """Positions left for the task's inputs: a soft prompt takes some of an absolute position table."""
        taken = sum(getattr(m, "positions_taken", lambda c: 0)(self.cfg) for m in self.modules)
        return model_cfg.max_seq_len - (taken if model_cfg.position in ("learned", "sinusoidal") else 0)

    def setup(self, model, tok, cfg: FinetuneConfig, log) -> None:
        from .. import peft

        self.cfg = cfg.peft  # base_dtype resolved (auto -> fp32 or bf16)
        summary = peft.inject(model, self.cfg, name="default", tokenizer=tok, seed=cfg.train.seed)
        log(f"{self.name}: {peft.format_summary(summary)}")
        self.base_dtype = self.cfg.base_dtype
        if "base_cast" in summary:
            self.base_bytes_saved = summary["base_bytes_saved"]
            self.base_note = (f"frozen base: bf16 ({summary['base_cast']:,} linear weights, "
                              f"{self.base_bytes_saved / 1e6:.1f} MB saved; embeddings, norms and biases fp32)")

    def save(self, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        from .. import peft

        peft.save_adapter(model, model_dir, base=str(Path(cfg.model["init"]).resolve()), tokenizer=tok,
                          extra_files={TASK_FILE: task_json(cfg.task)})
        sizes = {"adapter_bytes": peft.adapter_size(model_dir),  # the full model as saved: fp32 (a bf16 base widened)
                 "full_model_bytes": sum(t.numel() * t.element_size() for t in peft.base_state(model).values())
                 + self.base_bytes_saved}
        a, f = sizes["adapter_bytes"], sizes["full_model_bytes"]
        log(f"adapter -> {model_dir}: {a / 1e6:.2f} MB, against {f / 1e6:.1f} MB for the full model "
            f"({100 * a / f:.2f}%)")
        return {"peft": {"method": self.cfg.method, **peft.trainable_summary(model), **sizes,
                         "base_dtype": self.base_dtype}}


def method_for(cfg: FinetuneConfig) -> FullMethod | AdapterMethod:
    """How a run trains: an adapter (peft.method), only the head (tune.freeze_body), or everything."""
    return AdapterMethod(cfg.peft) if cfg.peft.method else FullMethod(cfg.tune.freeze_body)


# ----------------------------------------------------------------------------------------------
# prepare: config -> model, task, data, resolved config
# ----------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """Everything a finetuning run needs, its config resolved (derived values filled in)."""

    cfg: FinetuneConfig  # train.steps / warmup_steps / eval_every / lr / batch_size as the run uses them
    model: torch.nn.Module
    tokenizer: object
    task: object  # a pretune.tasks.Task
    method: FullMethod | AdapterMethod
    records: dict[str, list[Record]]  # train, dev, test
    features: dict[str, list[dict]]
    metric: str  # the dev metric of model selection and early stopping
    derived: dict[str, str] = field(default_factory=dict)  # config key -> how its value was derived


def prepare(cfg: FinetuneConfig, *, show_progress: bool = True, log=print) -> Prepared:
    """Read and split the data, build the model with the task's head, set up the method (freezing, adapters),
    encode every split and resolve what the config leaves to be derived (steps from epochs, warmup, evaluation
    interval, learning rate, a batch larger than the data); ``Prepared.derived`` says how."""
    from ..loading import build_run_model
    from ..tasks import TASKS

    if not cfg.data.train:
        raise ConfigError("no training data: set data.train=FILE (JSONL, CSV/TSV or Parquet)")
    task_cls = TASKS[cfg.task.name]
    method = method_for(cfg)
    recs = read_splits(cfg.data.train, cfg.data.dev, cfg.data.test, dev_fraction=cfg.data.dev_fraction,
                       seed=cfg.train.seed, errors=cfg.data.errors)
    train_recs, dev_recs, test_recs = recs["train"], recs["dev"], recs["test"]
    derived: dict[str, str] = {}
    if cfg.data.train_limit:
        n_all = len(train_recs)
        train_recs = subsample(train_recs, cfg.data.train_limit, cfg.train.seed)
        derived["data.train_limit"] = (f"{len(train_recs)} of the {n_all} training records, drawn with train.seed="
                                       f"{cfg.train.seed}")
        log(f"data.train_limit: training on {len(train_recs)} of the {n_all} training records (drawn with "
            f"train.seed={cfg.train.seed})")
    # dev labels join the map too: a rare class absent from train must not make every evaluation fail
    labels = task_cls.label_set(cfg.task, train_recs + dev_recs)
    if task_cls.labels_in_task and not cfg.task.labels:
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, labels=list(labels)))
        derived["task.labels"] = "read from the training and dev data"
    model, tok = build_run_model(cfg.model, tokenizer=cfg.tokenizer, head=task_cls.head_config(cfg.task, labels),
                                 from_scratch=cfg.tune.from_scratch, seed=cfg.train.seed, log=log)
    room = method.room(cfg, model.config)
    if cfg.task.max_len > room:
        log(f"task.max_len {cfg.task.max_len} -> {room}: the other positions go to the soft prompt")
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, max_len=room))
        derived["task.max_len"] = f"max_seq_len {model.config.max_seq_len} less the soft prompt"
    task = task_cls(cfg.task, model.config, tok)
    records = task.records()  # how the model reads text after this run (a decoder's layout), saved with it
    if any(getattr(model.config, k) != v for k, v in records.items()):
        model.config = model.transformer.config = model.config.replace(**records)
    feats = {}
    for split, recs in (("train", train_recs), ("dev", dev_recs), ("test", test_recs)):
        before = getattr(task, "truncated", 0)
        feats[split] = encode_records(task, recs, show_progress=show_progress, desc=f"encode {split}")
        cut = getattr(task, "truncated", 0) - before
        if cut:
            log(f"{cut} of {len(recs)} {split} records were cut to fit task.max_len={task.max_len} "
                f"(task.max_target_len={cfg.task.max_target_len} for completions)")
    if cfg.data.packing:
        if not getattr(task, "packable", False):
            raise ConfigError(f"data.packing=true packs training examples of task sft; task {task.name!r} cannot")
        if cfg.peft.method in ("prefix", "prompt"):
            raise ConfigError(f"data.packing=true cannot be used with --peft {cfg.peft.method}: its virtual tokens "
                              "would be shared by every example of a row")
        n = len(feats["train"])
        feats["train"] = task.pack(feats["train"], task.max_len)
        derived["data.packing"] = f"{n} examples packed into {len(feats['train'])} rows of <= {task.max_len} tokens"
        log(f"data.packing: {n} training examples in {len(feats['train'])} rows of at most {task.max_len} tokens")
    requested = cfg.train.precision
    cfg = _resolve_train(cfg, len(feats["train"]), method, derived,
                         task_head=model.config.head in TASK_HEADS and model.head is not None)
    base_dtype = base_dtype_for(cfg.peft, requested, cfg.train.precision)
    if base_dtype != cfg.peft.base_dtype:
        derived["peft.base_dtype"] = (f"auto: {base_dtype}, as train.precision is {cfg.train.precision}"
                                      if cfg.peft.method else "auto: fp32, no PEFT method (nothing is frozen)")
        cfg = dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, base_dtype=base_dtype))
    method.setup(model, tok, cfg, log)
    metric = cfg.task.metric or task.default_metric
    return Prepared(cfg=cfg, model=model, tokenizer=tok, task=task, method=method,
                    records={"train": train_recs, "dev": dev_recs, "test": test_recs}, features=feats,
                    metric=metric, derived=derived)


def resolved_yaml(cfg: FinetuneConfig) -> str:
    """The config a finetuning run would use, as YAML: the data is read and the model built (nothing is
    trained or written), so the values derived from them appear, each marked with how it was derived."""
    from omegaconf import OmegaConf

    if not cfg.data.train or not (cfg.model.get("init") or cfg.model.get("preset")):
        note = ("# train.steps, warmup_steps, eval_every and lr are derived from the data and the model when the run "
                "starts:\n# give data.train and model.init (or model.preset) to see the values it will use\n")
        return note + OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    job = prepare(cfg, show_progress=False, log=lambda *a: None)
    lines = OmegaConf.to_yaml(OmegaConf.create(job.cfg.to_dict())).splitlines()
    section = ""
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line.rstrip(":")
        elif line.startswith("  ") and not line.startswith("   "):
            key = f"{section}.{line.strip().split(':', 1)[0]}"
            if key in job.derived:
                lines[i] = f"{line}  # derived: {job.derived[key]}"
    return "\n".join(lines)


def _resolve_train(cfg: FinetuneConfig, n_train: int, method, derived: dict, *, task_head: bool = False
                   ) -> FinetuneConfig:
    """train.* (and tune.head_lr) as the run uses them, recording each derivation in ``derived``."""
    tr, tune = cfg.train, cfg.tune
    if tr.batch_size > n_train:
        bs = n_train - n_train % tr.grad_accum or tr.grad_accum
        derived["train.batch_size"] = f"the {n_train} training examples (train.batch_size={tr.batch_size} is larger)"
        tr = dataclasses.replace(tr, batch_size=bs)
    per_epoch = max(1, n_train // tr.batch_size)
    steps = tr.steps
    if tune.epochs:
        steps = math.ceil(per_epoch * tune.epochs)
        derived["train.steps"] = (f"tune.epochs={tune.epochs:g} x {per_epoch} steps per epoch ({n_train} training "
                                  f"examples / batch {tr.batch_size}); tune.epochs=0 uses train.steps")
    eval_every = tr.eval_every
    if not eval_every:
        eval_every = max(1, per_epoch // tune.evals_per_epoch)
        derived["train.eval_every"] = f"{per_epoch} steps per epoch / tune.evals_per_epoch={tune.evals_per_epoch}"
    save_every = tr.save_every
    if not save_every and tr.keep_last:
        save_every = eval_every
        derived["train.save_every"] = "train.eval_every: a resumable checkpoint after every dev evaluation"
    warmup = tr.warmup_steps
    if not warmup:
        warmup = int(tune.warmup_ratio * steps)
        derived["train.warmup_steps"] = f"tune.warmup_ratio={tune.warmup_ratio:g} x {steps} steps"
    lr = tr.lr
    if not lr:
        lr = method.default_lr
        derived["train.lr"] = f"the default of {method.name}"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # as train.dist.init_distributed picks it
    precision = resolve_precision(tr.precision, device)
    if tr.precision == "auto":
        derived["train.precision"] = f"auto on {describe_device(device)}"
    tr = dataclasses.replace(tr, steps=steps, eval_every=eval_every, save_every=save_every, warmup_steps=warmup, lr=lr,
                             precision=precision)
    check_train(tr)
    head_lr = tune.head_lr
    if not head_lr and task_head and method.default_head_lr(lr) != lr:
        head_lr = method.default_head_lr(lr)
        derived["tune.head_lr"] = f"the task head's default next to {method.name} (HEAD_LR, or train.lr if higher)"
    return dataclasses.replace(cfg, train=tr, tune=dataclasses.replace(tune, head_lr=head_lr))


# ----------------------------------------------------------------------------------------------
# train and export
# ----------------------------------------------------------------------------------------------
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


def _trainer(job: Prepared, *, show_progress: bool, log, dist=None):
    """The shared Trainer over the training features, with dev evaluation (sharded over the processes of a torchrun
    run, gathered), keep-best and early stopping."""
    from ..train.callbacks import EarlyStopping, EvalHistory, KeepBest
    from ..train.dist import DistInfo
    from ..train.loop import ExampleSet, Trainer

    cfg, model, task, tr = job.cfg, job.model, job.task, job.cfg.train
    feats = job.features["train"]
    higher = task.higher_is_better(job.metric)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}

    def trained_params() -> dict[str, torch.Tensor]:
        return {n: p for n, p in model.named_parameters() if n in trained}

    dist = dist or DistInfo()
    trainers = []

    def evaluator() -> dict:
        # FSDP: each process scores its share with the gathered weights (a sharded forward would need every process
        # to run the same number of forwards, which generation does not)
        net = trainers[0].consolidated() if trainers and trainers[0].fsdp else model
        m, _ = evaluate_task(task, net, job.records["dev"], batch_size=tr.batch_size * 2, precision=tr.precision,
                             features=job.features["dev"], show_progress=show_progress, desc="dev", dist=dist)
        return {f"dev_{k}": v for k, v in m.items()}

    callbacks = [EvalHistory(), KeepBest(f"dev_{job.metric}", trained_params, higher=higher,
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
                      callbacks=callbacks, param_lr=param_lr)
    trainers.append(trainer)
    return trainer


def finetune(cfg: FinetuneConfig, *, resume: bool = False, overwrite: bool = False, show_progress: bool = True,
             log=print) -> FinetuneResult:
    """Train ``cfg.model`` on ``cfg.data`` for ``cfg.task``; keep the best dev model; score dev and test.

    ``train.out`` must be a new (or empty) folder; ``overwrite=True`` starts over in an earlier run's folder
    (removing what that run wrote, nothing else); ``resume=True`` continues the run there from its newest intact
    checkpoint, bit for bit as if it had not stopped (its config may differ only as ``runconfig.check_resume``
    allows).

    Under ``torchrun`` (the same command, N processes): each process trains on its share of every batch (DDP, or
    FSDP with ``train.parallel=fsdp``) and scores its share of dev and test; process 0 alone writes and logs."""
    from ..train.dist import init_distributed, shutdown

    dist = init_distributed()
    try:
        if not dist.is_main:
            log, show_progress = (lambda *a, **k: None), False
        return _finetune(cfg, dist, resume=resume, overwrite=overwrite, show_progress=show_progress, log=log)
    finally:
        shutdown(dist)


def _finetune(cfg: FinetuneConfig, dist, *, resume: bool, overwrite: bool, show_progress: bool,
              log) -> FinetuneResult:
    from ..io.outputs import check_folder, prepare_run_folder
    from ..model import count_parameters
    from ..train.dist import barrier
    from ..train.precision import precision_line

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
    barrier(dist)
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
    trainer = _trainer(job, show_progress=show_progress, log=log, dist=dist)
    t0 = time.perf_counter()
    result = trainer.fit(resume=resume, log=log)
    seconds = time.perf_counter() - t0
    job = dataclasses.replace(job, model=trainer.consolidated())  # FSDP: the gathered weights, a plain model
    return export(job, trainer, result.step, seconds, show_progress=show_progress, log=log, dist=dist)


def _size(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def export(job: Prepared, trainer, steps: int, seconds: float, *, show_progress: bool = True,
           log=print, dist=None) -> FinetuneResult:
    """After training: save the (best) model or adapter, score dev and test, write results.json, predictions
    and the loss plot. ``dist``: several processes score the test set together; process 0 writes."""
    from ..io.outputs import mark
    from ..train.callbacks import EvalHistory, KeepBest
    from ..train.dist import DistInfo, barrier

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
    results = {"task": task.name, "metric": job.metric, "best_step": best.best_step, "steps": steps,
               "stopped_early": trainer.stopped_early, "train_seconds": seconds, "dev": dev_final,
               "test": test_metrics, "history": [{"step": s, **h} for s, h in history], **extra}
    if dist.is_main:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if tr.plot and (run_dir / "metrics.jsonl").is_file():
            from ..train.logging import plot_losses

            plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png", title=f"finetune {task.name}")
        mark(run_dir, ["model", "results.json", "test_predictions.jsonl", "loss.png"])
    barrier(dist)
    log(format_scores("dev", dev_final) + ("\n" + format_scores("test", test_metrics) if test_metrics else ""))
    log(f"model -> {model_dir}  ({steps} steps, {seconds:.1f}s); the run folder holds {_size(run_dir) / 1e6:.1f} MB")
    return FinetuneResult(run_dir=run_dir, model_dir=model_dir, steps=steps, seconds=seconds, dev=dev_final,
                          test=test_metrics, best_step=best.best_step, history=history)
