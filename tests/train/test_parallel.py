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


# 2 -> 1 (15 s) runs under make test-slow; the default suite keeps 1 -> 2 (the same resharding code, read the other way)
@pytest.mark.parametrize("before,after", [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
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


@pytest.mark.slow  # 12 s (make test-slow), to keep the default suite within its budget
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


# -- preference tuning (issue 33) -----------------------------------------------------------------------
WORDS = ["river", "stone", "cloud", "field", "light", "storm", "night", "green", "quiet", "bright"]


@pytest.fixture(scope="module")
def preference_args(tmp_path_factory, tokenizers_by_kind):
    """make(out, task, parallel, *extra, base=None): ``pretune finetune --task TASK`` of a tiny GPT-2 (from scratch;
    ``base``: LoRA on that checkpoint) on 32 string records (dpo and reward: pairs; kto: labelled completions, half of
    them desirable), dev and test 8 each, 6 steps of 8 records in 2 micro-batches per process."""
    d = tmp_path_factory.mktemp("preference")
    files = {}
    for kind in ("pairs", "feedback"):
        rows = []
        for i in range(48):
            if kind == "pairs":
                rows.append({"prompt": f"{WORDS[i % 10]} {WORDS[(3 * i) % 10]} is", "chosen":
                             f" {WORDS[(7 * i + 1) % 10]} good", "rejected": f" {WORDS[(5 * i + 2) % 10]} bad"})
            else:  # records 2k and 2k+1: one prompt, one completion but its last word (" not": undesirable), so the
                k = i // 2  # labels do not follow the lengths that batches are bucketed by
                rows.append({"prompt": f"{WORDS[k % 10]} {WORDS[(3 * k + 1) % 10]} is",
                             "completion": f" {WORDS[(7 * k + 2) % 10]} {'good' if i % 2 else 'not'}",
                             "label": bool(i % 2)})
        for split, part in (("train", rows[:32]), ("dev", rows[32:40]), ("test", rows[40:])):
            files[kind, split] = d / f"{kind}-{split}.jsonl"
            files[kind, split].write_text("".join(json.dumps(r) + "\n" for r in part))

    def make(out, task, parallel, *extra, base=None):
        start = (["--model", str(base), "--peft", "lora", "train.lr=1e-2"] if base else
                 ["--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"]), "train.lr=1e-3"])
        kind = "feedback" if task == "kto" else "pairs"
        return ["finetune", *start, "--task", task, *(x for split in ("train", "dev", "test")
                                                       for x in (f"--{split}", str(files[kind, split]))),
                "--quiet", "--out", str(out), "train.steps=6", "tune.epochs=0", "train.batch_size=8",
                "train.grad_accum=2", "train.eval_every=3", "train.save_every=2", "task.max_len=16",
                f"train.parallel={parallel}", *QUIET, *extra]
    return make


@pytest.fixture(scope="module")
def decoder_base(tmp_path_factory, pretrain_args):
    """A tiny GPT-2 pretrained from scratch for 4 steps: the checkpoint LoRA needs as its base."""
    out = tmp_path_factory.mktemp("decoder") / "run"
    _run(pretrain_args(out, "train.steps=4"))
    return out / "model"


def _two_equal_one_and_resume(tmp_path, args, *, weights="model.safetensors", first_loss=None):
    """``args(out)`` run in one process and in two give the same losses (the first ``first_loss``), dev/test metrics
    and weights (file ``weights`` of model/), and a two-process run SIGKILLed after step 5 resumes from its step-4
    checkpoint to the uninterrupted run's bits. Returns the one- and two-process run folders."""
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _run(args(one))
    _run(args(two), procs=2)
    assert list(_curve(two).values()) == pytest.approx(list(_curve(one).values()), abs=1e-5)
    if first_loss is not None:
        assert _curve(one)[1] == pytest.approx(first_loss, abs=1e-6)
    _same_metrics(_results(one), _results(two))
    _close(_weights(two, weights), _weights(one, weights), 1e-5)
    _run(args(resumed), procs=2, mode="step", at=5, ok=False)
    _run(args(resumed) + ["--resume"], procs=2)
    assert _curve(resumed) == _curve(two)
    assert _results(resumed)["dev"] == _results(two)["dev"] and _results(resumed)["test"] == _results(two)["test"]
    a, b = _weights(resumed, weights), _weights(two, weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return one, two


# DDP (17 s) runs under make test-slow; the default suite keeps FSDP (the sharded reference and resume)
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_dpo_on_two_processes_equals_one_and_resumes_bitwise(tmp_path, preference_args, parallel):
    """Preference tuning under DDP and FSDP (issue 33): a tiny GPT-2 from scratch, full finetuning (the reference a
    frozen copy of the starting weights), sigmoid DPO on string pairs — two processes give one process's losses,
    dev/test metrics and weights, and a run killed mid-way resumes to the same bits."""
    _two_equal_one_and_resume(tmp_path, lambda out: preference_args(out, "dpo", parallel),
                              first_loss=0.6931472)  # ln 2: policy = reference at the first step


@pytest.mark.slow  # ~20 s each under torchrun (make test-slow); full-finetuning dpo under DDP and FSDP runs by default
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_lora_dpo_on_two_processes_equals_one_and_resumes_bitwise(tmp_path, preference_args, decoder_base, parallel):
    """DPO with a LoRA adapter on a tiny GPT-2 checkpoint, the reference the base with the adapter switched off (the
    same sharded or replicated module, no second copy): the first loss ln 2 (LoRA's B starts at 0), two processes give
    one process's losses, dev/test metrics and adapter weights, and a killed run resumes to the same bits."""
    one, _ = _two_equal_one_and_resume(tmp_path, lambda out: preference_args(out, "dpo", parallel, base=decoder_base),
                                       weights="adapter_model.safetensors", first_loss=0.6931472)
    assert not (one / "model" / "model.safetensors").exists()  # the adapter alone was saved


@pytest.mark.slow  # ~15-20 s each under torchrun (make test-slow): the default suite keeps to its 12 minutes
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_reward_model_on_two_processes_equals_one_and_resumes_bitwise(tmp_path, preference_args, parallel):
    """A reward model (a tiny GPT-2 from scratch with a scalar head, Bradley-Terry on pairs): two processes give one
    process's losses, dev/test loss, accuracy and margin, and weights, and a killed run resumes to the same bits.

    With the centring term (task.center_rewards_coefficient, TRL's usual 0.01): without it the final norm's bias,
    which shifts both scores of a pair alike, has a gradient of 0 up to rounding, which Adam scales up to steps of
    ~lr, so its weights differ between one process and two by the rounding's sign (6.7e-5 measured)."""
    one, _ = _two_equal_one_and_resume(tmp_path, lambda out: preference_args(out, "reward", parallel,
                                                                             "task.center_rewards_coefficient=0.01"))
    assert set(_results(one)["test"]) == {"loss", "accuracy", "margin"}


def _predictions(run, split="test"):
    return [json.loads(x) for x in (Path(run) / f"{split}_predictions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])  # fsdp: ~8 s more
def test_kto_on_two_processes_equals_one_with_the_reference_precomputed(tmp_path, preference_args, parallel):
    """KTO's reference point z0 is the mean over the processes of each one's estimate (TRL's gather().mean()). With
    one micro-batch per process (train.grad_accum=1) and fixed mismatched rows (task.precompute_reference=true: each
    record's is the previous record's completion), the 8 records z0 averages over at a step are the global batch's,
    whether one process holds them or two hold 4 each (the mean of two means of 4 is the mean of 8), so the losses,
    the train rows' kl and the weights are one process's. (With 2 micro-batches, one process's first averages records
    0-3, two processes' first 0-1 and 4-5; with mismatched rows drawn from the micro-batch, each process rotates its
    own records: neither can match one process.)

    Dev and test: their mismatched rows rotate within each evaluation batch, and each process scores every other
    record, so z0 and what depends on it (loss, kl, reward_accuracy) differ from one process's; the per-record rewards
    and the margin do not depend on z0 and are equal. tune.keep_best=false: the best dev step, read from a metric that
    depends on the number of processes, would pick the final weights."""
    extra = ("task.precompute_reference=true", "train.grad_accum=1", "tune.keep_best=false")
    one, two = tmp_path / "one", tmp_path / "two"
    _run(preference_args(one, "kto", parallel, *extra))
    _run(preference_args(two, "kto", parallel, *extra), procs=2)
    rows = {run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (one, two)}
    train = {run: [r for r in rows[run] if r["split"] == "train"] for run in rows}
    assert len(train[one]) == 6 and train[one][0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference
    for key in ("loss", "kl", "rewards/margins"):
        assert [r[key] for r in train[two]] == pytest.approx([r[key] for r in train[one]], abs=1e-5), key
    assert max(r["kl"] for r in train[one]) > 1e-3  # z0 left 0: each process's own z0 would not do (the losses of
    # steps 5 and 6 differed by up to 1.3e-3 without the all-reduce)
    _close(_weights(two), _weights(one), 1e-5)
    for split in ("dev", "test"):
        assert _results(two)[split]["margin"] == pytest.approx(_results(one)[split]["margin"], abs=1e-5), split
    a, b = _predictions(one), _predictions(two)
    assert [p["reward"] for p in b] == pytest.approx([p["reward"] for p in a], abs=1e-5)


@pytest.mark.slow  # ~17 s each (make test-slow); kto's all-reduce under DDP and FSDP runs by default (above)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_kto_killed_on_two_processes_resumes_bitwise(tmp_path, preference_args, parallel):
    """KTO with the reference pass and mismatched rows drawn from each micro-batch of 2 records, z0 averaged over the
    processes at each micro-batch: a run SIGKILLed after step 5 resumes to the uninterrupted run's losses, dev/test
    metrics and weights, bit for bit."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(preference_args(full, "kto", parallel), procs=2)
    _run(preference_args(resumed, "kto", parallel), procs=2, mode="step", at=5, ok=False)
    _run(preference_args(resumed, "kto", parallel) + ["--resume"], procs=2)
    assert _curve(resumed) == _curve(full) and len(_curve(full)) == 6
    assert _results(resumed)["dev"] == _results(full)["dev"] and _results(resumed)["test"] == _results(full)["test"]
    a, b = _weights(resumed), _weights(full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


GRPO_REWARD = '''
def even_ids(prompts, completions, completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@pytest.mark.slow  # ~25 s of torchrun (make test-slow); grpo's single-process resume runs by default (tests/tasks)
def test_grpo_under_ddp_samples_each_process_its_groups_and_resumes_bitwise(tmp_path, tokenizers_by_kind,
                                                                            monkeypatch):
    """GRPO on two processes (issue 34): each samples the groups of its own prompts, the rewards are gathered for
    the advantages and the logged statistics (the same in every process's row: one metrics.jsonl line per step),
    and a run SIGKILLed after step 3 resumes to the bits of an uninterrupted two-process run."""
    (tmp_path / "pg_rewards.py").write_text(GRPO_REWARD)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(16)))

    def args(out):
        return ["finetune", "--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"]), "--task", "grpo",
                "--train", str(prompts), "--dev", str(prompts), "--quiet", "--out", str(out), "--reward",
                "pg_rewards:even_ids", "--steps", "5", "--batch-size", "4", "--lr", "3e-2", "task.group_size=4",
                "task.max_new_tokens=6", "task.max_len=16", "train.save_every=1", "train.eval_every=5",
                "train.parallel=ddp", *QUIET]

    two, resumed = tmp_path / "two", tmp_path / "resumed"
    _run(args(two), procs=2)
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert len(rows) == 5 and all(0 <= r["reward"] <= 1 for r in rows)
    _run(args(resumed), procs=2, mode="step", at=3, ok=False)
    _run(args(resumed) + ["--resume"], procs=2)
    assert _curve(resumed) == _curve(two)
    a, b = _weights(resumed), _weights(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
