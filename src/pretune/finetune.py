"""``pretune finetune / evaluate / predict``: a checkpoint + labelled data → a task model and its scores.

    cfg = load_finetune_config(None, ["model.init=runs/mlm/model", "task.name=classification",
                                      "data.train=train.jsonl", "data.dev=dev.jsonl", "data.test=test.jsonl"])
    result = finetune(cfg)            # result.model_dir: the finetuned checkpoint; result.test: its metrics
    scores = evaluate(result.model_dir, "test.jsonl")

The task is an objective of the shared training loop (train/loop.py): same optimizer, schedules,
accumulation, bf16, checkpoints. The finetuned model is an ordinary checkpoint (config.json with the
head and label map, model.safetensors, tokenizer.json) plus ``task.json`` (how records become inputs),
and exports to Hugging Face as ``*ForSequenceClassification`` / ``*ForTokenClassification`` /
``*ForQuestionAnswering`` where the family has one.
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

from .config import TASK_HEADS, ConfigError
from .loading import TASK_FILE
from .peft.config import PeftConfig
from .runconfig import TrainConfig, merge_layers, section
from .tasks.base import Record, TaskConfig


@dataclass
class FinetuneData:
    """Labelled files (JSONL, CSV/TSV, Parquet; .gz works): train, dev (model selection), test (reported)."""

    train: str = ""  # training records
    dev: str = ""  # dev records for evaluation during training; empty: hold out dev_fraction of train
    test: str = ""  # test records scored once at the end with the final (best) model
    dev_fraction: float = 0.1  # share of train held out as dev when `dev` is empty
    errors: Literal["strict", "replace"] = "strict"  # non-UTF-8 bytes: stop naming the line, or replace


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
    head_lr: float = 0.0  # peak learning rate of a task head (classifier, tagger, QA span head); 0: train.lr


FINETUNE_TRAIN_DEFAULTS = dict(out="runs/finetune", lr=5e-5, batch_size=32, eval_every=0, save_every=0,
                               keep_last=1, log_every=10, tensorboard=False)


@dataclass
class FinetuneConfig:
    """A finetuning run: ``model.init`` (checkpoint or HF folder) or ``model.preset`` (from scratch)."""

    model: dict = field(default_factory=dict)
    tokenizer: str = ""  # tokenizer.json or folder; empty: the one saved with model.init
    task: TaskConfig = field(default_factory=TaskConfig)
    data: FinetuneData = field(default_factory=FinetuneData)
    tune: TuneConfig = field(default_factory=TuneConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # peft.method empty: full finetuning
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**FINETUNE_TRAIN_DEFAULTS))

    SECTIONS = {"task": TaskConfig, "data": FinetuneData, "tune": TuneConfig, "peft": PeftConfig,
                "train": TrainConfig}

    def to_dict(self) -> dict:
        return {"model": dict(self.model), "tokenizer": self.tokenizer,
                **{k: dataclasses.asdict(getattr(self, k)) for k in self.SECTIONS}}

    def save(self, path: str | Path) -> None:
        from omegaconf import OmegaConf

        Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(self.to_dict())))


def load_finetune_config(yaml_file: str | Path | None = None, overrides=(), base: dict | None = None) -> FinetuneConfig:
    """defaults ← YAML ← flags (``base``) ← ``section.key=value``, validated (unknown keys name the nearest)."""
    from .tasks import TASKS

    merged = merge_layers(FinetuneConfig().to_dict(), yaml_file, overrides, base,
                          ["model", "tokenizer", *FinetuneConfig.SECTIONS])
    cfg = FinetuneConfig(model=merged["model"], tokenizer=str(merged.get("tokenizer") or ""),
                         **{k: section(k, c, merged.get(k) or {}) for k, c in FinetuneConfig.SECTIONS.items()})
    t, tune, tr = cfg.task, cfg.tune, cfg.train
    if t.name not in TASKS:
        raise ConfigError(f"task.name={t.name!r} is not one of {list(TASKS)}")
    if t.max_len < 8:
        raise ConfigError(f"task.max_len={t.max_len} is too short (at least 8 tokens)")
    if t.pooling and t.pooling not in ("pooler", "cls", "mean", "last"):
        raise ConfigError(f"task.pooling={t.pooling!r} is not one of pooler, cls, mean, last")
    if t.stride < 0 or t.max_answer_len < 1 or t.max_target_len < 2:
        raise ConfigError("task.stride must be >= 0, task.max_answer_len >= 1 and task.max_target_len >= 2")
    if tune.epochs < 0 or tune.patience < 0 or tune.evals_per_epoch < 1 or not 0 <= tune.warmup_ratio < 1:
        raise ConfigError("tune.epochs and tune.patience must be >= 0, tune.evals_per_epoch >= 1, "
                          "tune.warmup_ratio in [0, 1)")
    if tr.batch_size < 1 or tr.grad_accum < 1 or tr.batch_size % tr.grad_accum:
        raise ConfigError(f"train.batch_size ({tr.batch_size}) must be >= 1 and divisible by train.grad_accum "
                          f"({tr.grad_accum})")
    if tr.lr <= 0:
        raise ConfigError(f"train.lr={tr.lr} must be > 0")
    if tune.head_lr < 0:
        raise ConfigError(f"tune.head_lr={tune.head_lr} must be >= 0 (0: the head learns at train.lr)")
    if not 0 < cfg.data.dev_fraction < 1:
        raise ConfigError(f"data.dev_fraction={cfg.data.dev_fraction} must be in (0, 1)")
    if cfg.peft.method:
        cfg.peft.validated()
        if tune.freeze_body or tune.from_scratch:
            raise ConfigError("peft.method trains adapters on a frozen pretrained body: it does not combine with "
                              "tune.freeze_body or tune.from_scratch")
        if not cfg.model.get("init"):
            raise ConfigError("peft.method needs a pretrained base: set model.init=CHECKPOINT")
    return cfg


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


# ----------------------------------------------------------------------------------------------
# models and task files
# ----------------------------------------------------------------------------------------------
def save_task(path: Path, task_cfg: TaskConfig) -> None:
    (path / TASK_FILE).write_text(json.dumps(dataclasses.asdict(task_cfg), indent=2) + "\n")


def load_task_config(model_dir: str | Path, overrides: dict | None = None) -> TaskConfig:
    """The task.json saved with a finetuned model (or defaults), with field overrides."""
    from .loading import read_task
    from .runconfig import section as typed

    data = read_task(model_dir) or {}
    data.update(overrides or {})
    return typed("task", TaskConfig, data)


# ----------------------------------------------------------------------------------------------
# features and inference
# ----------------------------------------------------------------------------------------------
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
                show_progress: bool = False, loss_sums: dict | None = None) -> list:
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
    for chunk in tqdm(chunks, desc="predict", unit="batch", disable=not show_progress, leave=False):
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


def score(task, records: list[Record], predictions: list) -> dict:
    """The task's standard metrics (tasks/metrics.py) of ``predictions`` against the records' gold."""
    from .tasks.metrics import TASK_METRICS, compute

    refs = [task.reference(r) for r in records]
    return compute(TASK_METRICS[task.name], predictions, refs)


def evaluate_task(task, model, records: list[Record], *, batch_size: int = 64, precision: str = "fp32",
                  show_progress: bool = False, features: list[dict] | None = None) -> tuple[dict, list]:
    """(metrics, predictions) of ``model`` on labelled ``records``."""
    if features is None:
        features = encode_records(task, records, labelled=True, show_progress=show_progress)
    sums: dict | None = {} if task.name == "seq2seq" else None
    outs = run_outputs(task, model, features, batch_size=batch_size, precision=precision,
                       show_progress=show_progress, loss_sums=sums)
    preds = task.predict(records, features, outs)
    metrics = score(task, records, preds)
    if sums:
        metrics["perplexity"] = math.exp(min(sums["lm_loss"] / max(sums["lm_n"], 1.0), 50.0))
    return metrics, preds


# ----------------------------------------------------------------------------------------------
# finetune
# ----------------------------------------------------------------------------------------------
def _split_dev(records: list[Record], fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(records))
    n_dev = max(1, round(len(records) * fraction))
    dev = set(idx[:n_dev].tolist())
    return [r for i, r in enumerate(records) if i not in dev], [r for i, r in enumerate(records) if i in dev]


def _read(path: str, what: str, errors: str) -> list[Record]:
    from .data.readers import DataError
    from .tasks.base import read_records

    records = read_records(path, errors=errors)
    if not records:
        raise DataError(f"{path}: the {what} set is empty")
    return records


def build_model_for_task(cfg: FinetuneConfig, task_cls, labels: list[str], *, log=print):
    """(model, tokenizer) with the task head: from model.init (pretrained or --from-scratch) or a preset."""
    from .model import TransformerLM
    from .tokenization import Tokenizer

    head_cfg = task_cls.head_config(cfg.task, labels)
    init = cfg.model.get("init")
    torch.manual_seed(cfg.train.seed)
    if init:
        from .loading import load_pretrained

        loaded = load_pretrained(init, tokenizer=cfg.tokenizer or None, merge=True)  # an adapter: folded in
        model, tok = loaded.model, loaded.tokenizer
        extra = {k: v for k, v in cfg.model.items() if k != "init"}
        if model.config.head in ("classification", "tagging") and head_cfg["head"] == model.config.head:
            head_cfg.update(num_labels=model.config.num_labels, labels=model.config.labels)  # keep its label map
        if cfg.tune.from_scratch:
            model = TransformerLM(model.config.replace(**extra))  # same architecture, random weights
            log(f"from scratch: {init}'s architecture with random weights")
        elif extra:
            model = _rebuilt(model, extra)
        model = model.with_head(**head_cfg)
    else:
        if not cfg.model.get("preset"):
            raise ConfigError("no model: set model.init=CHECKPOINT (a pretune or Hugging Face folder) or "
                              "model.preset=NAME with tokenizer=PATH to train from scratch")
        if not cfg.tokenizer:
            raise ConfigError("model.preset trains from scratch and needs tokenizer=PATH")
        tok = Tokenizer.load(cfg.tokenizer)
        from .runconfig import RunConfig

        extra = {"pad_token_id": tok.pad_id if tok.pad_id is not None else 0}
        if tok.pad_id is not None:
            extra["decoder_start_token_id"] = tok.pad_id
        extra = {k: v for k, v in extra.items() if k not in cfg.model}
        model = TransformerLM(RunConfig(model=dict(cfg.model)).model_config(vocab_size=tok.vocab_size,
                                                                            **extra, **head_cfg))
    if model.config.vocab_size < tok.vocab_size:
        raise ConfigError(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's "
                          f"({tok.vocab_size} tokens): use the checkpoint's own tokenizer")
    return model, tok


def _rebuilt(model, extra: dict):
    """The model with config overrides that do not change weight shapes (e.g. dropout)."""
    from .checkpoint import load_state, unique_state
    from .model import TransformerLM

    new = TransformerLM(model.config.replace(**extra))
    load_state(new, unique_state(model), source="model.init with overrides")
    return new


def finetune(cfg: FinetuneConfig, *, show_progress: bool = True, log=print) -> FinetuneResult:
    """Train ``cfg.model`` on ``cfg.data`` for ``cfg.task``; keep the best dev model; score dev and test."""
    from .checkpoint import load_state, save, unique_state
    from .model import count_parameters
    from .tasks import TASKS
    from .train.dist import DistInfo
    from .train.loop import ExampleSet, Trainer

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.set_flush_denormal(True)
    if not cfg.data.train:
        raise ConfigError("no training data: set data.train=FILE (JSONL, CSV/TSV or Parquet)")
    task_cls = TASKS[cfg.task.name]
    train_recs = _read(cfg.data.train, "training", cfg.data.errors)
    if cfg.data.dev:
        dev_recs = _read(cfg.data.dev, "dev", cfg.data.errors)
    else:
        train_recs, dev_recs = _split_dev(train_recs, cfg.data.dev_fraction, cfg.train.seed)
    test_recs = _read(cfg.data.test, "test", cfg.data.errors) if cfg.data.test else []
    # dev labels join the map too: a rare class absent from train must not make every evaluation fail
    labels = task_cls.label_set(cfg.task, train_recs + dev_recs)
    if task_cls.labels_in_task and not cfg.task.labels:
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, labels=list(labels)))
    model, tok = build_model_for_task(cfg, task_cls, labels, log=log)
    if "prompt" in cfg.peft.methods and model.config.position in ("learned", "sinusoidal"):
        room = model.config.max_seq_len - cfg.peft.n_virtual  # the soft prompt takes positions too
        if cfg.task.max_len > room:
            log(f"task.max_len {cfg.task.max_len} -> {room}: {cfg.peft.n_virtual} positions go to the soft prompt")
            cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, max_len=room))
    task = task_cls(cfg.task, model.config, tok)

    train_feats = encode_records(task, train_recs, show_progress=show_progress, desc="encode train")
    dev_feats = encode_records(task, dev_recs, show_progress=show_progress, desc="encode dev")
    test_feats = encode_records(task, test_recs, show_progress=show_progress, desc="encode test")

    tr = cfg.train
    if tr.batch_size > len(train_feats):
        tr = dataclasses.replace(tr, batch_size=len(train_feats) - len(train_feats) % tr.grad_accum or tr.grad_accum)
    steps_per_epoch = max(1, len(train_feats) // tr.batch_size)
    steps = math.ceil(steps_per_epoch * cfg.tune.epochs) if cfg.tune.epochs else tr.steps
    eval_every = tr.eval_every or max(1, steps_per_epoch // cfg.tune.evals_per_epoch)
    warmup = tr.warmup_steps or int(cfg.tune.warmup_ratio * steps)
    tr = dataclasses.replace(tr, steps=steps, eval_every=eval_every, warmup_steps=warmup)
    cfg = dataclasses.replace(cfg, train=tr)

    if cfg.tune.freeze_body:
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("head."))
    if cfg.peft.method:
        from . import peft

        summary = peft.inject(model, cfg.peft, name="default", tokenizer=tok, seed=tr.seed)
        log(f"peft {cfg.peft.method}: {peft.format_summary(summary)}")
    run_dir = Path(tr.out)
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{run_dir} already holds a run: choose another train.out (or delete it)")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "run.yaml")

    from .tasks.metrics import DEFAULT_METRIC, HIGHER_IS_BETTER

    metric = cfg.task.metric or DEFAULT_METRIC[task.name]
    higher = HIGHER_IS_BETTER.get(metric, True)
    counts = count_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"pretune finetune: {task.name} on {model.config.arch} model ({counts['total'] / 1e6:.2f}M parameters, "
        f"{trainable / 1e6:.2f}M trainable{', body frozen' if cfg.tune.freeze_body else ''}"
        f"{f', peft {cfg.peft.method}' if cfg.peft.method else ''}"
        f"{', from scratch' if cfg.tune.from_scratch else ''}), {len(train_recs)} train / {len(dev_recs)} dev"
        f"{f' / {len(test_recs)} test' if test_recs else ''} records"
        f"{f', {len(task.labels)} labels' if task.labels else ''}; {steps} steps of {tr.batch_size} "
        f"({cfg.tune.epochs:g} epochs), dev {metric} every {eval_every} steps -> {run_dir}")

    history: list = []
    best = {"value": None, "step": None, "state": None, "since": 0}
    trained = set(unique_state(model))
    if cfg.peft.method:
        trained = {n for n, p in model.named_parameters() if p.requires_grad}

    def evaluator() -> dict:
        m, _ = evaluate_task(task, model, dev_recs, batch_size=tr.batch_size * 2, precision=tr.precision,
                             features=dev_feats)
        return {f"dev_{k}": v for k, v in m.items()}

    def on_eval(step: int, metrics: dict) -> bool:
        value = metrics.get(f"dev_{metric}")
        if value is None:
            raise ConfigError(f"task.metric={metric!r} is not computed for task {task.name!r}; "
                              f"choose one of {sorted(k[4:] for k in metrics if k.startswith('dev_'))}")
        history.append((step, {k[4:]: v for k, v in metrics.items() if k.startswith("dev_")}))
        better = best["value"] is None or (value > best["value"] if higher else value < best["value"])
        if better:  # a copy of what trains (everything, or the adapter and head)
            best.update(value=value, step=step, since=0,
                        state={k: v.detach().clone() for k, v in unique_state(model).items() if k in trained})
        else:
            best["since"] += 1
        return bool(cfg.tune.patience) and best["since"] >= cfg.tune.patience

    n_train = len(train_feats)
    data = ExampleSet(get=train_feats.__getitem__, train_ids=np.arange(n_train), eval_ids=np.arange(0),
                      lengths=np.array([len(f["input_ids"]) for f in train_feats]))
    param_lr = None
    if cfg.tune.head_lr:  # the task head at its own rate (PEFT: a fresh head next to a small adapter)
        if model.config.head not in TASK_HEADS or model.head is None:
            raise ConfigError(f"tune.head_lr applies to a task head (classification, regression, tagging, qa); "
                              f"task {task.name!r} trains the model's {model.config.head!r} head")
        param_lr = {id(p): cfg.tune.head_lr for p in model.head.parameters() if p.requires_grad}
        log(f"task head ({sum(p.numel() for p in model.head.parameters()):,} parameters) at lr "
            f"{cfg.tune.head_lr:g}, the rest at {tr.lr:g}")
    trainer = Trainer(model=model, objective=task, data=data, cfg=tr, run_dir=run_dir, tokenizer=tok.tk,
                      dist=DistInfo(), bucket=True, run_config=cfg, show_progress=show_progress,
                      evaluator=evaluator, on_eval=on_eval, param_lr=param_lr)
    t0 = time.perf_counter()
    result = trainer.fit(log=log)
    seconds = time.perf_counter() - t0
    if cfg.tune.keep_best and best["state"] is not None and best["step"] != trainer.step:
        if cfg.peft.method:
            with torch.no_grad():
                for k, v in unique_state(model).items():
                    if k in best["state"]:
                        v.copy_(best["state"][k])
        else:
            load_state(model, best["state"], source=f"best dev model (step {best['step']})")
        log(f"keeping the best dev model: step {best['step']} ({metric} {best['value']:.4f})")
    model_dir = run_dir / "model"
    if cfg.tune.freeze_body:
        for p in model.parameters():
            p.requires_grad_(True)
    sizes = {}
    if cfg.peft.method:
        from . import peft

        peft.save_adapter(model, model_dir, base=str(Path(cfg.model["init"]).resolve()), tokenizer=tok.tk,
                          extra_files={TASK_FILE: json.dumps(dataclasses.asdict(cfg.task), indent=2) + "\n"})
        sizes = {"adapter_bytes": peft.adapter_size(model_dir),
                 "full_model_bytes": sum(t.numel() * t.element_size() for t in peft.base_state(model).values())}
        a, f = sizes["adapter_bytes"], sizes["full_model_bytes"]
        log(f"adapter -> {model_dir}: {a / 1e6:.2f} MB, against {f / 1e6:.1f} MB for the full model "
            f"({100 * a / f:.2f}%)")
    else:
        save(model, model_dir, tokenizer=tok.tk)
        save_task(model_dir, cfg.task)
    cfg.save(model_dir / "run.yaml")
    dev_final = history[-1][1] if history and not cfg.tune.keep_best else (
        dict(next(h for s, h in history if s == best["step"])) if best["step"] is not None else {})
    test_metrics = {}
    if test_recs:
        test_metrics, preds = evaluate_task(task, model, test_recs, batch_size=tr.batch_size * 2,
                                            precision=tr.precision, features=test_feats, show_progress=show_progress)
        write_predictions(task, test_recs, preds, run_dir / "test_predictions.jsonl")
    results = {"task": task.name, "metric": metric, "best_step": best["step"], "steps": result.step,
               "stopped_early": trainer.stopped_early, "train_seconds": seconds, "dev": dev_final,
               "test": test_metrics, "history": [{"step": s, **h} for s, h in history]}
    if cfg.peft.method:
        from .peft import trainable_summary

        results["peft"] = {"method": cfg.peft.method, **trainable_summary(model), **sizes}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if tr.plot and (run_dir / "metrics.jsonl").is_file():
        from .train.logging import plot_losses

        plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png", title=f"finetune {task.name}")
    log(format_scores("dev", dev_final) + ("\n" + format_scores("test", test_metrics) if test_metrics else ""))
    log(f"model -> {model_dir}  ({result.step} steps, {seconds:.1f}s)")
    return FinetuneResult(run_dir=run_dir, model_dir=model_dir, steps=result.step, seconds=seconds, dev=dev_final,
                          test=test_metrics, best_step=best["step"], history=history)


def format_scores(split: str, metrics: dict) -> str:
    return f"{split}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


# ----------------------------------------------------------------------------------------------
# evaluate / predict a finetuned model
# ----------------------------------------------------------------------------------------------
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
        guess = {"classification": "classification", "regression": "regression", "tagging": "tagging",
                 "qa": "qa"}.get(model.config.head)
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
    records = _read(str(data), "evaluation", errors)
    metrics, _ = evaluate_task(task, model, records, batch_size=batch_size, precision=precision,
                               show_progress=show_progress)
    return metrics


def predict(model_dir: str | Path, data: str | Path, out: str | Path, *, task_overrides: dict | None = None,
            batch_size: int = 64, precision: str = "fp32", show_progress: bool = True, errors: str = "strict",
            base: str = "") -> int:
    """Predictions for every record of ``data`` (labels not needed) written to ``out`` as JSONL."""
    model, tok, task = load_finetuned(model_dir, task_overrides, base=base)
    records = _read(str(data), "prediction", errors)
    feats = encode_records(task, records, labelled=False, show_progress=show_progress)
    outs = run_outputs(task, model, feats, batch_size=batch_size, precision=precision, show_progress=show_progress)
    preds = task.predict(records, feats, outs)
    write_predictions(task, records, preds, Path(out))
    return len(preds)


def write_predictions(task, records: list[Record], preds: list, out: Path) -> None:
    """JSONL, one line per record: its row, the task's fields and the prediction; written atomically."""
    import os

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec, pred in zip(records, preds):
            f.write(json.dumps({"row": rec.where, **task.prediction_json(rec, pred)}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
