"""RL from verifiable rewards (task grpo) through `pretune finetune`: a reward the policy can raise is raised, the
train rows carry TRL's metrics in TRL's order, the same seed gives the same completions and weights, a run killed
mid-way resumes to the same bits, and bad input (an unknown reward, a record without the field a reward reads, a
reward function that fails during training, --epochs, FSDP) is a message, not a traceback.

The model is test_dpo's tiny random-weight Llama with SmolLM2's tokenizer, and for learning a tiny GPT-2 from scratch
on a 700-token BPE vocabulary: the reward (the share of a completion's token ids that are even) is one a 32-wide
model can raise only when the vocabulary is small enough for a direction of its hidden state to favour the even
ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_dpo
import torch

from pretune.cli import main
from pretune.io.checkpoint import read_weights

tiny = test_dpo.tiny  # the shared fixture: the tiny Llama folders, built once per module
REWARDS = textwrap.dedent('''
    def even_ids(prompts, completions, completion_ids, **kwargs):
        """The share of a completion's token ids that are even (dense: a tiny model can move it)."""
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    def needs_answer(prompts, completions, answer, **kwargs):
        return [float(a == "x") for a in answer]

    CALLS = 0

    def flaky(prompts, completions, **kwargs):
        """Fails on its third call (the third step's rollout)."""
        global CALLS
        CALLS += 1
        if CALLS == 3:
            raise ValueError("no score for you")
        return [0.5] * len(prompts)
''')
TRL_KEYS = ("reward", "reward_std", "rewards/even_ids/mean", "rewards/even_ids/std", "frac_reward_zero_std",
            "completions/mean_length")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding the user's reward module and prompts, made the working directory (as a user runs it)."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"Count to {i}:", "answer": str(i)} for i in range(12)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_rewards", None)
    return tmp_path


def _argv(tiny, out, *extra, model=None):
    model = model or ["--model", str(tiny["ref"])]
    return ["finetune", *model, "--task", "grpo", "--train", "prompts.jsonl", "--dev",
            "prompts.jsonl", "--out", str(out), "--quiet", "--reward", "my_rewards:even_ids", "--batch-size", "2",
            "--lr", "1e-2", "train.precision=fp32", "train.plot=false", "train.tensorboard=false", "train.log_every=1",
            "task.group_size=4", "task.max_new_tokens=8", "task.max_len=32", *extra]


def _train_rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def test_grpo_raises_a_reward_and_logs_trls_metrics_in_order(tiny, workdir, tokenizers_by_kind):
    model = ["--preset", "tiny-gpt2", "--tokenizer", str(tokenizers_by_kind["bpe"])]
    assert main(_argv(tiny, workdir / "run", "--steps", "16", "--lr", "3e-2", "task.group_size=8", model=model)) == 0
    rows = _train_rows(workdir / "run")
    assert len(rows) == 16
    keys = [k for k in rows[0] if k in TRL_KEYS]
    assert keys == list(TRL_KEYS)  # TRL's names, in TRL's order
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    assert last > first + 0.08, (first, last)  # about 0.51 -> 0.67 (0.5: a uniform policy)
    results = json.loads((workdir / "run" / "results.json").read_text())
    assert results["metric"] == "reward" and "rewards/even_ids" in results["dev"]


@pytest.mark.parametrize("extra, kill_after", [
    ([], 3),
    # two steps a rollout, killed after step 4: the newest checkpoint (step 3) holds step 3's rollout, which step 4
    # trains on again (10 s: make test-slow, to keep the default suite within its budget)
    pytest.param(["task.num_iterations=2"], 4, marks=pytest.mark.slow),
])
def test_same_seed_same_weights_and_a_killed_run_resumes_bitwise(tiny, workdir, extra, kill_after):
    """A run SIGKILLed mid-way and resumed samples the same completions (the same rewards at every step) and
    ends with the bits of an uninterrupted run with the same seed, in another process (the sampling is seeded by
    seed, step, process and micro-batch, not by a generator's state). One thread, as the suite's other resume
    tests."""
    helper = Path(__file__).resolve().parents[1] / "helpers" / "kill_run.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--steps", "5", "train.save_every=1", "train.eval_every=5", "train.threads=1", *extra]

    def run(name, *more, mode="none", ok=True):
        cmd = [sys.executable, str(helper), mode, str(kill_after), *_argv(tiny, workdir / name, *args, *more)]
        res = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
        assert (res.returncode == 0) == ok, res.stderr[-3000:]

    run("a")
    run("c", mode="step", ok=False)
    run("c", "--resume")
    a, c = (read_weights(workdir / n / "model" / "model.safetensors") for n in "ac")
    assert all(torch.equal(a[k], c[k]) for k in a)
    rewards = [[r.get("reward") for r in _train_rows(workdir / n)] for n in "ca"]
    assert rewards[0] == rewards[1]


def test_several_steps_a_rollout_train_on_it_with_the_ratio_to_the_sampling_policy(tiny, workdir):
    """task.num_iterations=3 (TRL's num_iterations): a rollout (rewards logged) at steps 1, 4, 7, each trained on for
    three steps; at a rollout's first step the ratio is exactly 1 (the old log-probs are the policy's own, taken as
    the loss takes them), at the steps after it moves and gets clipped (lr 5e-2 moves it past 1 +- 0.2) — with one
    step a rollout nothing is ever clipped."""
    def run(name, *more):
        assert main(_argv(tiny, workdir / name, "--steps", "7", "--lr", "5e-2", *more)) == 0
        return _train_rows(workdir / name)

    rows = run("mu3", "task.num_iterations=3")
    assert [i for i, r in enumerate(rows) if "reward" in r] == [0, 3, 6]
    assert all(rows[i]["clip_ratio/region_mean"] == 0 for i in (0, 3, 6))
    assert max(rows[i]["clip_ratio/region_mean"] for i in (1, 2, 4, 5)) > 0
    assert all(r["clip_ratio/region_mean"] == 0 for r in run("mu1"))


@pytest.mark.parametrize("extra, culprits", [
    (["--reward", "nonsense"], ["nonsense", "exact_match"]),
    (["--reward", "no_such_module:f"], ["no_such_module"]),
    (["--reward", "my_rewards:needs_answer"], []),  # every record has "answer": it runs
    (["--epochs", "2"], ["--epochs", "train.steps"]),
    (["train.parallel=fsdp"], ["FSDP", "ddp"]),
])
def test_bad_settings_are_a_message_before_training(tiny, workdir, capsys, extra, culprits):
    code = main(_argv(tiny, workdir / "run", "--steps", "1", *extra))
    err = capsys.readouterr().err
    if not culprits:
        assert code == 0
        return
    assert code != 0 and "Traceback" not in err
    for c in culprits:
        assert c in err, (c, err)
    assert not (workdir / "run" / "metrics.jsonl").exists()  # stopped before any training


def test_a_record_without_the_field_a_reward_reads_is_named(tiny, workdir, capsys):
    (workdir / "prompts.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    assert main(_argv(tiny, workdir / "run", "--steps", "1", "--reward", "exact_match")) != 0
    err = capsys.readouterr().err
    assert "prompts.jsonl:2" in err and "'answer'" in err and "exact_match" in err


def test_a_reward_that_fails_mid_run_stops_after_a_checkpoint(tiny, workdir, capsys):
    """The failing function is named with the record, and the two steps done before are kept (resumable)."""
    code = main(_argv(tiny, workdir / "run", "--steps", "4", "--reward", "my_rewards:flaky", "train.save_every=1"))
    err = capsys.readouterr().err
    assert code != 0 and "flaky" in err and "prompts.jsonl:" in err and "no score for you" in err
    assert "at step 3" in err and "--resume" in err and "Traceback" not in err
    assert (workdir / "run" / "checkpoints" / "step-00000002").is_dir()


def test_a_chat_prompt_is_rendered_as_dpo_renders_it_with_the_generation_prompt(tiny):
    """A prompt given as messages (or a string with task.chat=true, task.system set) is the chat template's rendering
    with its generation prompt: the prompt ids dpo gives the same conversation."""
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record

    model, tok = test_dpo._load(tiny["ref"])
    grpo = build_task(TaskConfig(name="grpo", system="Be brief."), model.config, tok)
    dpo = build_task(TaskConfig(name="dpo", system="Be brief."), model.config, tok)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    want = dpo.pair_ids(Record("p:1", {"prompt": msgs, "chosen": [{"role": "assistant", "content": "4"}],
                                       "rejected": [{"role": "assistant", "content": "5"}]}))[0]
    assert grpo.prompt_ids(Record("p:1", {"prompt": msgs})) == want
    text = tok.decode(want)
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith("<|im_start|>assistant\n")
    as_chat = build_task(TaskConfig(name="grpo", system="Be brief.", chat=True), model.config, tok)
    assert as_chat.prompt_ids(Record("p:1", {"prompt": "What is 2 + 2?"})) == want
