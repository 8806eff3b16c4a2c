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


def test_accumulated_micro_batches_train_as_the_whole_batch_and_the_adapter_loads_in_peft(tiny, tmp_path):
    """dpo with train.grad_accum=2 (two micro-batches of 2 pairs) gives the losses and adapter weights of one batch of
    4 pairs; the run's model/ is a PEFT-format adapter that peft.PeftModel.from_pretrained loads onto transformers'
    model, which then gives pretune's log-probability of a completion."""
    T = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    import torch

    from pretune.io.checkpoint import read_weights
    from pretune.jobs.inference import load_finetuned

    train = _write_pairs(tmp_path / "train.jsonl", 8)
    runs = {}
    for accum in (1, 2):
        out = tmp_path / f"accum{accum}"
        argv = ["finetune", "--model", str(tiny["ref"]), "--task", "dpo", "--peft", "lora", "--train", str(train),
                "--test", str(train), "--out", str(out), "--quiet", "--batch-size", "4", "--lr", "1e-2",
                "train.plot=false", "train.tensorboard=false", "train.log_every=1", "tune.epochs=0", "train.steps=3",
                "task.max_len=48", "train.precision=fp32", f"train.grad_accum={accum}"]
        assert main(argv) == 0
        runs[accum] = out
    curves = [[json.loads(x)["loss"] for x in (runs[a] / "metrics.jsonl").read_text().splitlines()
               if '"train"' in x] for a in (1, 2)]
    assert curves[1] == pytest.approx(curves[0], abs=1e-6)
    a, b = (read_weights(runs[k] / "model" / "adapter_model.safetensors") for k in (1, 2))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    # peft loads the adapter onto transformers' model: the same log-probabilities as pretune's
    hf = peft_lib.PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(tiny["ref"]), runs[1] / "model")
    model, _, task = load_finetuned(runs[1] / "model")
    from pretune.tasks.base import Record

    batch = task.collate([task.encode(Record("p:1", json.loads(train.read_text().splitlines()[0])))[0]])
    ours, _ = task.sequence_logps(model.eval(), batch)
    with torch.no_grad():
        logits = hf.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    keep = labels != -100
    theirs = torch.log_softmax(logits.double(), -1).gather(2, labels.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(ours, (theirs * keep).sum(1).float(), rtol=1e-5, atol=1e-5)
