"""Finetuning survives being killed: SIGKILL at random steps and in the middle of a checkpoint write, SIGINT, and a
corrupt newest checkpoint, each followed by ``pretune finetune --resume``, end with weights bitwise equal to an
uninterrupted run (dropout on), for full finetuning and for LoRA. Real processes, real signals
(tests/helpers/kill_run.py), a tiny BERT on real sentences."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretune
from conftest import corpus_paragraphs
from pretune.io.checkpoint import read_weights
from pretune.io.tokenization import Tokenizer

HERE = Path(__file__).parent
KILL = HERE / "helpers" / "kill_run.py"
STEPS = 30  # 240 examples / batch 16 = 15 steps per epoch, 2 epochs; a dev evaluation and checkpoint every 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizers_by_kind):
    d = tmp_path_factory.mktemp("ftresume")
    sents = []
    for p in corpus_paragraphs("austen.txt.gz", 200):
        sents += [s.strip() + "." for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4]
    rows = [{"text": s, "label": "long" if len(s.split()) > 14 else "short"} for s in sents[:320]]
    files = {}
    for name, part in (("train", rows[:240]), ("dev", rows[240:280]), ("test", rows[280:320])):
        files[name] = d / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    torch.manual_seed(0)
    model = pretune.build_model("tiny-bert-base", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id or 0,
                                dropout=0.1)
    pretune.save(model, d / "base", tokenizer=tok.tk)
    return {"dir": d, "base": d / "base", **files}


def _args(setup, out, method, *extra):
    peft = ["--peft", "lora"] if method == "lora" else []
    return ["finetune", "--model", str(setup["base"]), "--task", "classification", "--train", str(setup["train"]),
            "--dev", str(setup["dev"]), "--test", str(setup["test"]), "--epochs", "2", "--batch-size", "16",
            "--lr", "2e-3", "--out", str(out), "--quiet", *peft, "tune.evals_per_epoch=3", "train.threads=1",
            "train.plot=false", "train.precision=fp32", *extra]


def _run(mode: str, at: int, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KILL), mode, str(at), *args], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1",
                                            "PYTHONPATH": str(HERE)})


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {f"{f.name}/{k}": v for f in sorted((run / "model").glob("*.safetensors"))
            for k, v in read_weights(f).items()}


def _assert_same_run(run: Path, ref: Path) -> None:
    a, b = _weights(run), _weights(ref)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra, rb = (json.loads((r / "results.json").read_text()) for r in (run, ref))
    assert (ra["test"], ra["dev"], ra["best_step"], ra["steps"]) == (rb["test"], rb["dev"], rb["best_step"],
                                                                      rb["steps"])


@pytest.fixture(scope="module")
def reference(setup):
    """The uninterrupted runs, one per method."""
    out = {}
    for method in ("full", "lora"):
        run = setup["dir"] / f"ref-{method}"
        p = _run("none", 0, _args(setup, run, method))
        assert p.returncode == 0, p.stderr[-3000:]
        out[method] = run
    return out


@pytest.mark.parametrize("method", [pytest.param("full", marks=pytest.mark.slow), "lora"])  # full: ~50 s, test-slow
def test_sigkill_at_random_steps_and_during_a_checkpoint_write_then_resume_is_bitwise(setup, reference, method):
    rng = random.Random(f"kill-{method}")
    first, later = rng.randint(2, 9), rng.randint(16, 28)  # before and after the torn checkpoint of step 15
    run = setup["dir"] / f"killed-{method}"
    p = _run("step", first, _args(setup, run, method))
    assert p.returncode == -9, p.stderr[-3000:]
    p = _run("write", 15, _args(setup, run, method, "--resume"))
    assert p.returncode == -9, p.stderr[-3000:]
    torn = [x.name for x in (run / "checkpoints").iterdir() if x.name.startswith(".step-00000015")]
    assert torn, "the kill should leave the temp folder of the checkpoint being written"
    p = _run("step", later, _args(setup, run, method, "--resume"))
    assert p.returncode == -9, p.stderr[-3000:]
    assert "removed .step-00000015" in p.stdout  # the torn write is cleaned up
    p = _run("none", 0, _args(setup, run, method, "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from step {later // 5 * 5}" in p.stdout, p.stdout
    _assert_same_run(run, reference[method])
    ckpts = sorted(x.name for x in (run / "checkpoints").iterdir())
    assert ckpts == [f"step-{STEPS:08d}"]  # a finished run keeps its last checkpoint only, no temp folders


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sigint_checkpoints_exits_130_and_resumes_bitwise(setup, reference, method):
    run = setup["dir"] / f"sigint-{method}"
    p = _run("sigint", 12, _args(setup, run, method))
    assert p.returncode == 130, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "step 12" in last and "--resume" in last, last
    assert (run / "checkpoints" / "step-00000012" / "trainer.pt").is_file()
    p = _run("none", 0, _args(setup, run, method, "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from step 12" in p.stdout
    _assert_same_run(run, reference[method])


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(setup, reference):
    run = setup["dir"] / "corrupt"
    p = _run("step", 17, _args(setup, run, "full", "train.keep_last=2"))
    assert p.returncode == -9
    newest = run / "checkpoints" / "step-00000015" / "trainer.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    p = _run("none", 0, _args(setup, run, "full", "--resume"))  # keep_last may change on resume
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipped checkpoint step-00000015" in p.stdout and "truncated or corrupt" in p.stdout
    assert "resumed from step 10" in p.stdout
    _assert_same_run(run, reference["full"])


def test_a_finished_lora_run_holds_no_copy_of_the_base_weights(setup, reference):
    run = reference["lora"]
    base_bytes = (setup["base"] / "model.safetensors").stat().st_size
    ckpt = run / "checkpoints" / f"step-{STEPS:08d}"
    assert not (ckpt / "model").exists() and (ckpt / "trainable.safetensors").is_file()
    trained = sum(v.numel() * v.element_size() for v in read_weights(ckpt / "trainable.safetensors").values())
    files = [f for f in run.rglob("*.safetensors")]
    assert all(f.stat().st_size < base_bytes for f in files), [(f, f.stat().st_size) for f in files]
    # adapter + tokenizer + one checkpoint (trainable weights, Adam's two moments of them, keep-best's copy) + logs
    total = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    tokenizer = (run / "model" / "tokenizer.json").stat().st_size
    assert total < 5 * trained + 2 * tokenizer + 200_000, total


def test_resume_refuses_a_changed_config_and_names_the_keys(setup, reference, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference["full"], run)
    before = {f: f.read_bytes() for f in run.rglob("*") if f.is_file()}
    p = _run("none", 0, _args(setup, run, "full", "--resume", "train.batch_size=8", "train.weight_decay=0.1"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "train.weight_decay: 0.01 -> 0.1" in p.stderr, p.stderr
    assert "train.batch_size" in p.stderr
    assert {f: f.read_bytes() for f in run.rglob("*") if f.is_file()} == before
    # a longer run is allowed: the schedule is recomputed for the new length, and it continues from the end
    p = _run("none", 0, _args(setup, run, "full", "--resume", "--epochs", "3"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from step {STEPS}" in p.stdout and "tune.epochs: 2.0 -> 3.0" in p.stdout
    assert json.loads((run / "results.json").read_text())["steps"] == 45
