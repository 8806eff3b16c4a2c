"""Sweeps and experiments log to the trackers (train.report_to): one tracked run per trial, grouped by the sweep,
in one store in the sweep's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pretune.bundled import path as bundled
from pretune.config import ConfigError
from pretune.experiments.runner import tracked
from pretune.sweep import plan, run_sweep
from pretune.sweep.spec import trial_config


def _spec(out: Path, tok: str = "tok.json", data: dict | None = None, **base) -> dict:
    data = data or {"train": "train.jsonl", "test": "test.jsonl"}
    return {"command": "finetune",
            "base": {"model.preset": "tiny-bert-base", "tokenizer": str(tok), "task.name": "classification",
                     "task.max_len": 32, "data.train": data["train"], "data.test": data["test"],
                     "data.train_limit": 64, "tune.epochs": 0, "train.steps": 3, "train.batch_size": 16,
                     "train.eval_every": 0, "train.log_every": 1, "train.plot": False, **base},
            "grid": {"train.lr": [1e-3, 3e-3]}, "seeds": [0], "metrics": ["test.accuracy"], "out": str(out)}


def _train_section(spec, trial) -> dict:
    return yaml.safe_load(trial_config(spec, trial, Path(spec.out) / "trials" / trial.name))["train"]


def test_trials_are_grouped_by_the_sweep_in_its_store(tmp_path):
    spec, trials = plan(_spec(tmp_path / "lr-sweep", **{"train.report_to": ["mlflow", "wandb"]}))
    for t in trials:
        train = _train_section(spec, t)
        assert train["report_to"] == ["mlflow", "wandb"] and train["group"] == "lr-sweep"
        assert train["tracking_dir"] == str((tmp_path / "lr-sweep" / "tracking").resolve())
    # the spec's own choice wins
    spec, trials = plan(_spec(tmp_path / "s2", **{"train.group": "mine", "train.tracking_dir": str(tmp_path)}))
    assert _train_section(spec, trials[0])["group"] == "mine"
    assert _train_section(spec, trials[0])["tracking_dir"] == str(tmp_path)
    with pytest.raises(ConfigError, match=r"train.report_to='wanb' is not one of .*did you mean 'wandb'"):
        plan(_spec(tmp_path / "s3", **{"train.report_to": ["wanb"]}))


def test_an_experiment_sets_the_trackers_of_its_training_sweeps(tmp_path):
    spec = _spec(tmp_path / "exp" / "ft", **{"train": {"tensorboard": False, "lr": 1e-3}})
    spec["grid"] = {"train.steps": [2, 3]}
    assert tracked(spec, None, group="e.ft") is spec  # no --report-to: as the experiment wrote it
    prompt = {"command": "prompt", "base": {"model": "m"}}
    assert tracked(prompt, ["mlflow"], group="e.p") is prompt  # prompting trains nothing
    spec, trials = plan(tracked(spec, ["tensorboard", "mlflow"], group="e.ft"))
    train = _train_section(spec, trials[0])
    # the experiments' train.tensorboard=false gives way to --report-to; their other train settings stay
    assert (train["report_to"], train["tensorboard"], train["group"], train["lr"]) == (
        ["tensorboard", "mlflow"], None, "e.ft", 1e-3)


@pytest.fixture
def sms(tmp_path):
    rows = [json.loads(x) for x in bundled("tasks/sms_spam/dev.jsonl").read_text().splitlines()[:120]]
    out = {}
    for name, part in (("train", rows[:80]), ("test", rows[80:])):
        out[name] = tmp_path / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    return out


@pytest.mark.slow  # two trial processes, each importing torch, mlflow and wandb (about 60 s on 2 cores)
def test_a_sweep_makes_one_tracked_run_per_trial(tmp_path, sms, tokenizers_by_kind, monkeypatch):
    from mlflow.tracking import MlflowClient

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "lr-sweep"
    spec = _spec(out, tokenizers_by_kind["wordpiece"], sms, **{"train.report_to": ["mlflow", "wandb"]})
    result = run_sweep(spec, jobs=2, show_progress=False, threads=1)  # started together: one store, made once
    assert [r["status"] for r in result.rows] == ["done", "done"]
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'tracking' / 'mlruns.db'}")
    runs = client.search_runs([client.get_experiment_by_name("pretune").experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(r["trial"] for r in result.rows)
    assert {r.data.tags["pretune.group"] for r in runs} == {"lr-sweep"}
    for run in runs:
        rows = [json.loads(x) for x in (out / "trials" / run.info.run_name / "metrics.jsonl").read_text().splitlines()]
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
            (r["step"], r["loss"]) for r in rows if r["split"] == "train"]
        assert "results.json" in {f.path for f in client.list_artifacts(run.info.run_id)}
    offline = sorted((out / "tracking" / "wandb").glob("offline-run-*"))
    assert len(offline) == 2
