"""``pretune distill``: knowledge distillation (DistilBERT, Sanh et al. 2019) on the pretraining pipeline.

A distillation run is a pretraining run whose objective is ``distill`` (objectives/distill.py): the same token store,
packing, masking, ``Trainer``, checkpoints, resume and DDP; the objective owns the frozen teacher, which
``pretrain.prepare`` loads from ``objective.teacher``. The student is ``model`` (a preset plus overrides, or
``model.init``), saved in ``<train.out>/model``::

    cfg = load_distill_config(overrides=["objective.teacher=runs/bert/model", "model.preset=distilbert-base",
                                         "objective.init_from_teacher=every_other", "data.train=[corpus.txt]"])
    result = distill(cfg)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ConfigError
from ..runconfig import RunConfig
from .pretrain import PretrainResult, load_run_config, pretrain


def load_distill_config(yaml_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                        base: dict | None = None) -> RunConfig:
    """A pretraining RunConfig with ``objective.name: distill`` (defaults ← YAML ← ``base`` ← overrides, as
    ``pretrain.load_run_config``). The tokenizer defaults to the teacher's folder, which holds the tokenizer its
    vocabulary comes from; the teacher is required, and ``init_from_teacher`` cannot be combined with ``model.init``
    (a student checkpoint already has its weights)."""
    base = dict(base or {})
    base["objective"] = {**(base.get("objective") or {}), "name": "distill"}
    cfg = load_run_config(yaml_file, overrides, base=base)
    if cfg.objective.name != "distill":
        raise ConfigError(f"pretune distill trains with objective 'distill', got objective.name="
                          f"{cfg.objective.name!r} (use pretune pretrain for other objectives)")
    if not cfg.objective.teacher:
        raise ConfigError("no teacher: give --teacher FOLDER (objective.teacher), a pretune checkpoint or a Hugging "
                          "Face model folder")
    if cfg.model.get("init") and cfg.objective.init_from_teacher != "none":
        raise ConfigError(f"objective.init_from_teacher={cfg.objective.init_from_teacher!r} initialises the student "
                          f"from the teacher, but model.init={cfg.model['init']!r} gives it weights already: drop one")
    if not cfg.tokenizer:
        cfg = dataclasses.replace(cfg, tokenizer=cfg.objective.teacher)
    return cfg


def distill(cfg: RunConfig, **kwargs) -> PretrainResult:
    """Run a distillation job (``pretrain.pretrain`` with objective distill; the same keyword arguments: resume,
    overwrite, show_progress, log). Returns where the student went (``model_dir``) and its evaluation: the hard
    ``mlm_loss`` / ``lm_loss`` and its perplexity, ``kd_loss`` (T² · KL per position) and ``cos_loss``."""
    if cfg.objective is None or cfg.objective.name != "distill":
        raise ConfigError("distill() needs a config with objective.name=distill (load_distill_config makes one)")
    return pretrain(cfg, **kwargs)
