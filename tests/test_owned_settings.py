"""The ``task`` and ``peft`` sections belong to the task and the PEFT methods they name (as ``objective`` belongs to
its objective): each declares its settings (``Task.Settings``, a method module's ``Settings``), the shared classes
keep the shared fields, and the config keys, files and run.yaml of before still work."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from pretune.config import ConfigError
from pretune.jobs.finetune.config import _stored_as_now, load_finetune_config
from pretune.peft import PeftConfig
from pretune.peft.config import peft_defaults
from pretune.runconfig import check_resume
from pretune.tasks import TASKS, TaskConfig, task_defaults, task_settings
from pretune.tasks.qa import QASettings

BASE = ["model.init=base", "data.train=train.jsonl"]


def test_a_run_config_holds_what_applies_to_its_task_and_methods():
    cfg = load_finetune_config(None, [*BASE, "task.name=qa", "task.stride=16", "peft.method=lora+prompt",
                                      "peft.r=4", "peft.n_virtual=5"])
    assert type(cfg.task) is QASettings and cfg.task.stride == 16
    saved = cfg.to_dict()
    assert set(saved["task"]) == {f.name for f in dataclasses.fields(QASettings)}
    assert "text_field" not in saved["task"] and "threshold" not in saved["task"]
    assert (cfg.peft.r, cfg.peft.n_virtual, cfg.peft.methods) == (4, 5, ["lora", "prompt"])
    assert "reduction_factor" not in saved["peft"] and "prefix_projection" not in saved["peft"]
    plain = load_finetune_config(None, BASE).to_dict()
    assert plain["peft"] == {"method": "", "base_dtype": "fp32"} and plain["task"]["name"] == "classification"


def test_another_tasks_key_is_left_out_but_a_bad_value_is_an_error():
    """A sweep may share settings across tasks (task.stride for qa and tagging alike); a value its task refuses is an
    error wherever it is set, as when one class held every task's keys."""
    cfg = load_finetune_config(None, [*BASE, "task.name=tagging", "task.stride=8", "task.max_target_len=4"])
    assert not hasattr(cfg.task, "stride") and cfg.task.tokens_field == "tokens"
    with pytest.raises(ConfigError, match=r"task.stride \(-1\) must be >= 0"):
        load_finetune_config(None, [*BASE, "task.name=tagging", "task.stride=-1"])
    with pytest.raises(ConfigError, match="task.stride must be an integer, got 'wide'"):
        load_finetune_config(None, [*BASE, "task.stride=wide"])


def test_unknown_keys_name_the_nearest_and_literals_their_choices():
    with pytest.raises(ConfigError, match=r"unknown key task.strid.*did you mean 'stride'.*task 'qa' has: "):
        task_settings({"name": "qa", "strid": 8})
    with pytest.raises(ConfigError, match=r"unknown key peft.alpah; did you mean 'alpha'\?; peft method 'lora' has: "
                                          r"alpha, base_dtype, bias"):
        load_finetune_config(None, [*BASE, "peft.method=lora", "peft.alpah=4"])
    with pytest.raises(ConfigError, match=r"task.pair_style='xlnet' is not one of \['auto', 'bert', 'gpt'\]"):
        task_settings(name="pair", pair_style="xlnet")
    with pytest.raises(ConfigError, match=r"task.name='qaa': expected one of .*did you mean 'qa'"):
        task_settings(name="qaa")


def test_constructors_give_the_named_tasks_and_methods_settings():
    assert type(TaskConfig(name="qa", stride=64)) is QASettings
    assert type(TaskConfig()) is TASKS["classification"].Settings
    multi = dataclasses.replace(TaskConfig(text_field="sentence"), name="multilabel")  # inference's HF guess
    assert type(multi) is TASKS["multilabel"].Settings and (multi.text_field, multi.threshold) == ("sentence", 0.5)
    assert type(dataclasses.replace(multi, name="qa")) is QASettings
    both = PeftConfig(method="prefix+prompt", n_virtual=3, r=4)  # r: lora's, left out; n_virtual: one setting of both
    assert both.n_virtual == 3 and not hasattr(both, "r") and set(both.to_dict()) == {
        "method", "base_dtype", "n_virtual", "prefix_projection", "prompt_init"}
    with pytest.raises(TypeError, match="rr"):
        PeftConfig(method="lora", rr=4)  # a key no method has


def test_a_run_yaml_written_with_every_key_still_loads_and_resumes(tmp_path):
    """run.yaml (and task.json, adapter files) written while one class held every task's (method's) keys."""
    cfg = load_finetune_config(None, [*BASE, "task.name=qa", "task.stride=16", "peft.method=lora", "peft.r=4"])
    old = cfg.to_dict()
    old["task"] = {**task_defaults(), "name": "qa", "stride": 16}
    old["peft"] = {**peft_defaults(), "method": "lora", "r": 4}
    (tmp_path / "run.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    again = load_finetune_config(tmp_path / "run.yaml")
    assert again.to_dict() == cfg.to_dict()
    assert check_resume(_stored_as_now(old), cfg.to_dict(), source="run") == []
    with pytest.raises(ConfigError, match="task.stride: 16 -> 8"):
        check_resume(_stored_as_now(old), {**cfg.to_dict(), "task": {**cfg.to_dict()["task"], "stride": 8}},
                     source="run")
    meta = PeftConfig.from_dict({**peft_defaults(), "method": "prompt", "n_virtual": 5})  # an old adapter file
    assert meta.n_virtual == 5 and "r" not in meta.to_dict()
