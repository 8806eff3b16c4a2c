"""Downstream tasks for finetuning (``pretune finetune --task NAME``) and their metrics.

``TASKS`` is the registry (name -> Task class; ``pretune.catalog.TASKS`` holds each one's line of help, and
``pretune finetune --help`` lists them); each task owns its settings (``.Settings``, the ``task:`` section of a
finetuning config beyond ``TaskConfig``'s shared fields). ``task_settings(values)`` builds and checks that section;
``build_task(settings, model_cfg, tokenizer)`` makes the task. A new task is one module (the class with its
Settings) plus one line below and its line in the catalog.
"""

from __future__ import annotations

from .base import Layout, Record, Task, TaskConfig, read_records
from .choice import Choice
from .classify import Classification, Pair, Regression
from .dpo import DPO
from .embedding import Embedding
from .grpo import GRPO
from .kto import KTO
from .multilabel import Multilabel
from .qa import QA
from .rerank import Rerank
from .reward import Reward
from .seq2seq import Seq2Seq
from .sft import SFT
from .tagging import Tagging

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (Classification, Pair, Regression, Tagging, QA, Seq2Seq,
                                                          SFT, Choice, Multilabel, DPO, KTO, Reward,
                                                          GRPO, Embedding, Rerank)}
TASK_METRICS: dict[str, list[str]] = {name: list(cls.metrics) for name, cls in TASKS.items()}  # what each reports
DEFAULT_METRIC: dict[str, str] = {name: cls.default_metric for name, cls in TASKS.items()}  # model selection


def settings_class(name: str) -> type[TaskConfig]:
    """The Settings dataclass of task ``name``; a name not in TASKS is a ConfigError naming the nearest."""
    if name not in TASKS:
        from ..config import ConfigError, _did_you_mean

        close = _did_you_mean(str(name), list(TASKS))
        raise ConfigError(f"task.name={name!r}: expected one of {', '.join(TASKS)}"
                          f"{close if 'did you mean' in close else ''}")
    return TASKS[name].Settings


def task_settings(values: dict | None = None, **kw) -> TaskConfig:
    """The typed, checked ``task`` section: ``values`` (and keyword overrides) with ``name`` picking the task. Keys
    of other tasks are left out (a sweep may share them across tasks; a task.json or run.yaml written before the
    settings were split lists every key); a key no task has is an error naming the nearest."""
    from ..runconfig import owned_section

    values = {**(values or {}), **kw}
    name = values.get("name", TaskConfig.name)
    return owned_section("task", settings_class(name), values, kind="task", name=name,
                         owners={n: c.Settings for n, c in TASKS.items()}, others="any")


def task_defaults() -> dict:
    """Every task's settings at their defaults, in one mapping (a config's bottom layer: a task setting given on
    the command line is typed by it)."""
    from ..runconfig import union_defaults

    return union_defaults(c.Settings for c in TASKS.values())


def build_task(cfg: TaskConfig, model_cfg, tokenizer) -> Task:
    """The task named by ``cfg.name`` for a model whose config carries the task's head (and label map)."""
    return TASKS[cfg.name](cfg, model_cfg, tokenizer)


__all__ = ["TASKS", "TASK_METRICS", "DEFAULT_METRIC", "Task", "TaskConfig", "Record", "Layout", "read_records",
           "build_task", "task_settings", "task_defaults", "settings_class"]
