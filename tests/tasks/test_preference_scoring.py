"""`pretune evaluate` / `predict` of a saved dpo or kto model (jobs.inference.attach_reference): the reference the
rewards compare with is the one finetuning used — an adapter folder's base with the adapter switched off, a full
model's starting model (model.init of its run.yaml), or `--reference MODEL` — so the scores equal the run's own test
figures; without a reference to find, a message that says what to pass."""

from __future__ import annotations

import json
import shutil

import pytest
import test_dpo
from test_dpo import _write_pairs
from test_kto import _write_feedback

from pretune.cli import main

tiny = test_dpo.tiny  # the shared fixture: the tiny Llama folders, built once per module
RUN = ["--batch-size", "4", "--quiet", "--lr", "1e-3", "train.plot=false", "train.tensorboard=false",
       "tune.epochs=0", "train.steps=2", "task.max_len=48"]


def _finetune(tiny, tmp_path, task, peft_method):
    write = _write_pairs if task == "dpo" else _write_feedback
    train, test = write(tmp_path / "train.jsonl", 8), write(tmp_path / "test.jsonl", 6)
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(tiny["ref"]), "--task", task, "--train", str(train), "--test", str(test),
            "--out", str(out), *RUN]
    assert main(argv + (["--peft", peft_method] if peft_method else [])) == 0
    return out, test


def _scores(tmp_path, model, data, *extra):
    path = tmp_path / "scores.json"
    path.unlink(missing_ok=True)
    assert main(["evaluate", str(model), str(data), "--quiet", "--json", str(path), *extra]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("task,peft_method", [("dpo", "lora"), ("dpo", ""), ("kto", "lora")])
def test_evaluate_and_predict_compare_with_the_runs_own_reference(task, peft_method, tiny, tmp_path):
    out, test = _finetune(tiny, tmp_path, task, peft_method)
    want = json.loads((out / "results.json").read_text())["test"]
    got = _scores(tmp_path, out / "model", test)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    assert main(["predict", str(out / "model"), str(test), "--out", str(tmp_path / "pred.jsonl"), "--quiet"]) == 0
    ours = [json.loads(x) for x in (tmp_path / "pred.jsonl").read_text().splitlines()]
    runs = [json.loads(x) for x in (out / "test_predictions.jsonl").read_text().splitlines()]
    key = "margin" if task == "dpo" else "reward"
    assert [p[key] for p in ours] == pytest.approx([p[key] for p in runs], abs=1e-6)


def test_a_full_model_without_its_start_asks_for_reference(tiny, tmp_path, capsys):
    out, test = _finetune(tiny, tmp_path, "dpo", "")
    moved = tmp_path / "moved"
    shutil.copytree(out / "model", moved)
    (moved / "run.yaml").unlink()  # the folder no longer says where its run started
    assert main(["evaluate", str(moved), str(test), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "--reference MODEL" in err and str(moved) in err and "Traceback" not in err
    want = json.loads((out / "results.json").read_text())["test"]
    got = _scores(tmp_path, moved, test, "--reference", str(tiny["ref"]))
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    # another model as the reference gives other rewards: the flag is read
    other = _scores(tmp_path, moved, test, "--reference", str(tiny["policy"]))
    assert other["loss"] != pytest.approx(want["loss"], abs=1e-4)
