"""Beyond one process (torchrun, gloo, 2 CPU processes): FSDP equals one process, sharded checkpoints resume bitwise
after SIGKILLs (one during a checkpoint write) and with another number of processes; finetuning (full and LoRA)
under DDP and FSDP equals one process, dev and test metrics included."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretune.io.checkpoint import read_weights
from pretune.jobs.pretrain import load_run_config, prepare
from pretune.train.loop import Trainer

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "kill_run.py"
QUIET = ["train.tensorboard=false", "train.plot=false", "train.threads=1", "train.precision=fp32",
         "model.dropout=0.0", "model.attn_dropout=0.0", "train.log_every=1"]  # fp32, no dropout: equality holds


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(args, procs=1, mode="none", at=0, ok=True):
    """``pretune ARGS`` in ``procs`` processes through tests/helpers/kill_run.py (MODE at step AT)."""
    cmd = [str(HELPER), mode, str(at), *args]
    if procs > 1:
        port = 20000 + (os.getpid() * 7 + random.randrange(1000)) % 20000
        cmd = ["-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", str(port), *cmd]
    res = subprocess.run([sys.executable, *cmd], env=_env(), capture_output=True, text=True, timeout=600)
    if ok:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    else:
        assert res.returncode != 0
    return res


def _curve(run):
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _weights(run, name="model.safetensors"):
    return read_weights(Path(run) / "model" / name)


def _close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def pretrain_args(small_corpus, tokenizers_by_kind):
    def make(out, *extra):
        return ["pretrain", "--preset", "tiny-gpt2", "--objective", "clm", "--tokenizer",
                str(tokenizers_by_kind["bpe"]), "--data", str(small_corpus), "--quiet", "--out", str(out),
                "train.steps=10", "train.batch_size=8", "train.grad_accum=2", "data.block_size=40",
                "train.eval_every=5", "train.save_every=2", "train.keep_last=3", *QUIET, *extra]
    return make


def test_fsdp_on_two_processes_equals_one_process(tmp_path, pretrain_args):
    _run(pretrain_args(tmp_path / "one"))
    _run(pretrain_args(tmp_path / "fsdp", "train.parallel=fsdp"), procs=2)
    one, fsdp = _curve(tmp_path / "one"), _curve(tmp_path / "fsdp")
    assert len(one) == 10 and one.keys() == fsdp.keys()
    assert list(fsdp.values()) == pytest.approx(list(one.values()), abs=1e-5)
    _close(_weights(tmp_path / "fsdp"), _weights(tmp_path / "one"), 1e-5)
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step-00000010"
    assert sorted(p.name for p in ckpt.iterdir()) == [".pretune.json", "config.json", "run.yaml", "sharded",
                                                      "tokenizer.json", "trainer.pt"]
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2  # one slice per process
    # on demand, in one process: the same weights as the model/ the run wrote at its end
    from pretune.cli import main

    assert main(["consolidate", str(ckpt), "--out", str(tmp_path / "whole")]) == 0
    a, b = read_weights(tmp_path / "whole" / "model.safetensors"), _weights(tmp_path / "fsdp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # ~30 s of SIGKILLs under torchrun (make test-slow); DDP/FSDP equality and resume run by default
def test_sigkills_then_resume_equal_an_uninterrupted_fsdp_run_bitwise(tmp_path, pretrain_args):
    """Killed three times at seeded random moments, once in the middle of writing a checkpoint."""
    moments = random.Random(7).sample([3, 5, 7, 9], 2)
    kills = sorted([("step", m) for m in moments] + [("write", 6)], key=lambda x: x[1])
    full = pretrain_args(tmp_path / "full", "train.parallel=fsdp")
    _run(full, procs=2)
    run = tmp_path / "killed"
    args = pretrain_args(run, "train.parallel=fsdp")
    for i, (mode, at) in enumerate(kills):
        _run(args + (["--resume"] if i else []), procs=2, mode=mode, at=at, ok=False)
    _run(args + ["--resume"], procs=2)
    assert _curve(run) == _curve(tmp_path / "full")
    a, b = _weights(run), _weights(tmp_path / "full")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_with_another_number_of_processes_continues_the_curve(tmp_path, pretrain_args, before, after):
    full = tmp_path / "full"
    _run(pretrain_args(full, "train.parallel=fsdp"), procs=2)
    run = tmp_path / "changed"
    args = pretrain_args(run, "train.parallel=fsdp")
    _run(args, procs=before, mode="step", at=5, ok=False)  # checkpoint of step 4, written by `before` processes
    _run(args + ["--resume"], procs=after)
    a, b = _curve(run), _curve(full)
    assert a.keys() == b.keys()
    assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    _close(_weights(run), _weights(full), 1e-5)


def test_a_ddp_checkpoint_is_not_resumed_as_fsdp(tmp_path, pretrain_args):
    run = tmp_path / "run"
    _run(pretrain_args(run), mode="step", at=3, ok=False)
    res = _run(pretrain_args(run, "train.parallel=fsdp") + ["--resume"], ok=False)
    assert "cannot resume" in res.stderr and "parallel" in res.stderr and "Traceback" not in res.stderr


# -- finetuning ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finetune_args(tmp_path_factory, tokenizers_by_kind):
    from pretune.bundled import task

    data = task("sms_spam")
    base = tmp_path_factory.mktemp("base") / "run"
    common = ["--task", "classification", "--train", str(data["train"]), "--dev", str(data["dev"]), "--test",
              str(data["test"]), "--quiet", "train.steps=6", "tune.epochs=0", "train.batch_size=8",
              "train.grad_accum=2", "train.eval_every=3", "train.save_every=2", *QUIET]
    # a small pretrained-from-scratch base for LoRA (PEFT needs a checkpoint)
    _run(["finetune", "--preset", "tiny-bert-base", "--tokenizer", str(tokenizers_by_kind["wordpiece"]), *common,
          "--out", str(base), "train.lr=1e-3"])

    def make(out, *extra, peft=None):
        start = ["--model", str(base / "model")] if peft else ["--preset", "tiny-bert-base", "--tokenizer",
                                                               str(tokenizers_by_kind["wordpiece"])]
        lr = "train.lr=1e-2" if peft else "train.lr=1e-3"
        return ["finetune", *start, *common, "--out", str(out), lr, *(["--peft", peft] if peft else []), *extra]
    return make


def _results(run):
    return json.loads((Path(run) / "results.json").read_text())


def _same_metrics(a, b):
    for split in ("dev", "test"):
        assert a[split].keys() == b[split].keys() and a[split]
        for k, v in a[split].items():
            assert b[split][k] == pytest.approx(v, abs=1e-5), (split, k)


@pytest.mark.parametrize("parallel,peft", [("ddp", None), ("fsdp", "lora")])
def test_finetuning_on_two_processes_equals_one_and_resumes_bitwise(tmp_path, finetune_args, parallel, peft):
    name = "adapter_model.safetensors" if peft else "model.safetensors"
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _run(finetune_args(one, f"train.parallel={parallel}", peft=peft))
    _run(finetune_args(two, f"train.parallel={parallel}", peft=peft), procs=2)
    assert list(_curve(two).values()) == pytest.approx(list(_curve(one).values()), abs=1e-5)
    _same_metrics(_results(one), _results(two))
    _close(_weights(two, name), _weights(one, name), 1e-5)
    assert len((two / "test_predictions.jsonl").read_text().splitlines()) == len(
        (one / "test_predictions.jsonl").read_text().splitlines())
    args = finetune_args(resumed, f"train.parallel={parallel}", peft=peft)
    _run(args, procs=2, mode="step", at=5, ok=False)
    _run(args + ["--resume"], procs=2)
    assert _curve(resumed) == _curve(two)
    assert _results(resumed)["dev"] == _results(two)["dev"]
    a, b = _weights(resumed, name), _weights(two, name)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_activation_checkpointing_is_switched_on_by_the_train_setting(tmp_path, small_corpus, tokenizers_by_kind):
    cfg = load_run_config(overrides=[
        "model.preset=tiny-t5-small", "objective.name=span", f"tokenizer={tokenizers_by_kind['unigram']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", "train.activation_checkpointing=blocks",
        "train.steps=1", "train.batch_size=4", "data.block_size=32"])
    tok, model, objective, data, _ = prepare(cfg, show_progress=False)
    Trainer(model=model, objective=objective, data=data, cfg=cfg.train, run_dir=cfg.train.out, tokenizer=tok,
            show_progress=False)
    stacks = [model.transformer.encoder, model.transformer.decoder]
    assert all(s.checkpoint_blocks for s in stacks)


def test_cpu_offload_needs_fsdp_and_a_gpu():
    from pretune.config import ConfigError

    with pytest.raises(ConfigError, match="needs train.parallel=fsdp"):
        load_run_config(overrides=["train.cpu_offload=true"])


def test_fp16_under_fsdp_skips_a_step_that_overflows_in_one_process_only(tmp_path, pretrain_args):
    """The overflow is in one element of process 0's gradient shard: both processes must skip that step (the loss
    scaler agrees over the processes), which leaves the same weights as an overflow in every process."""
    runs = {}
    for ranks in ("0", "0,1"):
        out = tmp_path / ranks.replace(",", "-")
        os.environ["INF_RANKS"] = ranks
        try:
            _run(pretrain_args(out, "train.parallel=fsdp", "train.precision=fp16", "train.steps=5"), procs=2,
                 mode="inf", at=3)
        finally:
            os.environ.pop("INF_RANKS")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        train = {r["step"]: r for r in rows if r["split"] == "train"}
        assert train[3]["skipped"] == 1 and train[3]["loss_scale"] == train[2]["loss_scale"] / 2
        assert train[4]["skipped"] == 0
        runs[ranks] = _weights(out)
    a, b = runs["0"], runs["0,1"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_dpo_on_two_processes_equals_one_and_resumes_bitwise(tmp_path, tokenizers_by_kind, parallel):
    """Preference tuning under DDP and FSDP (issue 33): a tiny GPT-2 from scratch, full finetuning (the reference a frozen copy
    of the starting weights), sigmoid DPO on string pairs — two processes give one process's losses, dev/test metrics
    and weights, and a run killed mid-way resumes to the same bits."""
    words = ["river", "stone", "cloud", "field", "light", "storm", "night", "green", "quiet", "bright"]
    rows = [{"prompt": f"{words[i % 10]} {words[(3 * i) % 10]} is", "chosen": f" {words[(7 * i + 1) % 10]} good",
             "rejected": f" {words[(5 * i + 2) % 10]} bad"} for i in range(48)]
    files = {}
    for split, part in (("train", rows[:32]), ("dev", rows[32:40]), ("test", rows[40:])):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in part))

    def args(out):
        return ["finetune", "--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"]), "--task", "dpo",
                "--train", str(files["train"]), "--dev", str(files["dev"]), "--test", str(files["test"]), "--quiet",
                "--out", str(out), "train.steps=6", "tune.epochs=0", "train.batch_size=8", "train.grad_accum=2",
                "train.eval_every=3", "train.save_every=2", "train.lr=1e-3", "task.max_len=16",
                f"train.parallel={parallel}", *QUIET]

    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _run(args(one))
    _run(args(two), procs=2)
    assert list(_curve(two).values()) == pytest.approx(list(_curve(one).values()), abs=1e-5)
    assert _curve(one)[1] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference at the first step
    _same_metrics(_results(one), _results(two))
    _close(_weights(two), _weights(one), 1e-5)
    _run(args(resumed), procs=2, mode="step", at=5, ok=False)
    _run(args(resumed) + ["--resume"], procs=2)
    assert _curve(resumed) == _curve(two)
    a, b = _weights(resumed), _weights(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
