"""Finetuning's run config: the ``model`` and ``tokenizer`` keys and the ``task``, ``data``, ``tune``, ``peft`` and
``train`` sections, read from defaults ← YAML ← flags ← ``section.key=value`` and checked once
(:func:`load_finetune_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ...config import ConfigError
from ...peft.config import PeftConfig, base_dtype_for
from ...runconfig import TrainConfig, check_batch, merge_layers, section
from ...tasks.base import TaskConfig
from .defaults import AUTO


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


@dataclass
class TuneConfig:
    """What is trained and for how long; model selection on the dev set."""

    # passes over the training data, which set train.steps; auto: chosen from the number of training examples (at
    # least defaults.MIN_STEPS optimizer steps, 3 to 20 epochs; train.steps when that is set); 0: use train.steps
    epochs: float | Literal["auto"] = "auto"
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
# lr 0, batch_size 0 and steps 0: chosen from the method and the data (defaults.py), steps from tune.epochs
FINETUNE_TRAIN_DEFAULTS = dict(out="runs/finetune", lr=0.0, batch_size=0, steps=0, eval_every=0, save_every=0,
                               keep_last=1, log_every=10, report_to=[])


@dataclass
class FinetuneConfig:
    """A finetuning run: ``model.init`` (checkpoint, HF or adapter folder) or ``model.preset`` (from scratch)."""

    model: dict = field(default_factory=dict)
    tokenizer: str = ""  # tokenizer.json or folder; empty: the one saved with model.init
    task: TaskConfig = field(default_factory=TaskConfig)
    data: FinetuneData = field(default_factory=FinetuneData)
    tune: TuneConfig = field(default_factory=TuneConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # peft.method empty: full finetuning
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**FINETUNE_TRAIN_DEFAULTS))  # 0s: chosen
    # config key -> how the run derived its value (prepare): comments in run.yaml and --print-config, not settings
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    SECTIONS = {"task": TaskConfig, "data": FinetuneData, "tune": TuneConfig, "peft": PeftConfig,
                "train": TrainConfig}

    def to_dict(self) -> dict:
        return {"model": dict(self.model), "tokenizer": self.tokenizer,
                **{k: dataclasses.asdict(getattr(self, k)) for k in self.SECTIONS}}

    def to_yaml(self) -> str:
        """The config as YAML, each value the run derived marked with how (``# derived: ...``)."""
        from omegaconf import OmegaConf

        lines = OmegaConf.to_yaml(OmegaConf.create(self.to_dict())).splitlines()
        section = ""
        for i, line in enumerate(lines):
            if line and not line.startswith(" "):
                section = line.rstrip(":")
            elif line.startswith("  ") and not line.startswith("   "):
                key = f"{section}.{line.strip().split(':', 1)[0]}"
                if key in self.derived:
                    lines[i] = f"{line}  # derived: {self.derived[key]}"
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())


def _stored_as_now(stored: dict) -> dict:
    """A run.yaml's config as a run writes it now: the task and peft sections hold what applies to the task and
    methods they name (a run.yaml written before those settings moved to their owners lists every key)."""
    from ...peft.config import peft_settings
    from ...tasks import task_settings

    out = dict(stored)
    for key, build in (("task", task_settings), ("peft", peft_settings)):
        try:
            out[key] = dataclasses.asdict(build(dict(stored.get(key) or {})))
        except ConfigError:
            pass  # as it was: the comparison names what differs
    return out


def load_finetune_config(yaml_file: str | Path | None = None, overrides=(), base: dict | None = None) -> FinetuneConfig:
    """defaults ← YAML ← flags (``base``) ← ``section.key=value``, validated (unknown keys name the nearest)."""
    from ...peft.config import peft_defaults
    from ...tasks import task_defaults

    # the task and peft sections belong to the task and methods they name (each checks its own settings): their
    # bottom layer holds every task's and method's keys, and each section keeps those that apply
    defaults = {**FinetuneConfig().to_dict(), "task": task_defaults(), "peft": peft_defaults()}
    merged = merge_layers(defaults, yaml_file, overrides, base, ["model", "tokenizer", *FinetuneConfig.SECTIONS])
    cfg = FinetuneConfig(model=merged["model"], tokenizer=str(merged.get("tokenizer") or ""),
                         **{k: section(k, c, merged.get(k) or {}) for k, c in FinetuneConfig.SECTIONS.items()})
    tune, tr = cfg.tune, cfg.train
    auto_epochs = tune.epochs == AUTO
    for key, value, ok, want in (("tune.epochs", tune.epochs, auto_epochs or tune.epochs >= 0,
                                  ">= 0 (0: train for train.steps), or auto"),
                                 ("tune.patience", tune.patience, tune.patience >= 0, ">= 0 (0: never stop early)"),
                                 ("tune.evals_per_epoch", tune.evals_per_epoch, tune.evals_per_epoch >= 1, ">= 1"),
                                 ("tune.warmup_ratio", tune.warmup_ratio, 0 <= tune.warmup_ratio < 1, "in [0, 1)")):
        if not ok:
            raise ConfigError(f"{key}={value:g}: expected {want}")
    if tr.batch_size or tr.grad_accum < 1:  # 0: chosen from the data
        check_batch(tr)
    if tr.steps < 0 or (tune.epochs == 0 and not tr.steps):
        raise ConfigError(f"train.steps={tr.steps}: tune.epochs=0 trains for train.steps, expected a number of "
                          "optimizer steps >= 1" if tr.steps >= 0 else
                          f"train.steps={tr.steps}: expected >= 1 (or 0: from tune.epochs)")
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
