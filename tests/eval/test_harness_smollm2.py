"""lm-evaluation-harness on SmolLM2-135M-Instruct (slow): the ``pretune`` model class against lm-eval's ``hf`` class,
and lm-eval's ``local-completions`` class against ``pretune serve``, on the local WordNet and SMS tasks."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "tasks"
MC = ["wordnet_gloss_word", "sms_spam_yn"]


def _evaluate(model: str, model_args: str, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import pretune.jobs.harness  # noqa: F401  (registers "pretune")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=MC, log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), **kw)


@pytest.fixture(scope="module")
def smollm2():
    from pretune.realmodels import smollm2_dir

    return smollm2_dir()


@pytest.fixture(scope="module")
def ours(smollm2):
    return _evaluate("pretune", f"pretrained={smollm2}", batch_size=8)


def _loglikelihoods(results, task):
    return [r[0][0] for s in results["samples"][task] for r in s["resps"]]


def test_pretune_model_equals_hf_model_smollm2(smollm2, ours):
    theirs = _evaluate("hf", f"pretrained={smollm2},dtype=float32", batch_size=8, device="cpu")
    for task in MC:
        for metric in ("acc,none", "acc_norm,none"):
            assert ours["results"][task].get(metric) == theirs["results"][task].get(metric), (task, metric)
        a, b = _loglikelihoods(ours, task), _loglikelihoods(theirs, task)
        assert len(a) == len(b) > 0
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert ours["results"]["wordnet_gloss_word"]["acc,none"] > 0.5  # the model knows words (chance: 0.25)


def test_local_completions_against_pretune_serve(smollm2, ours):
    from helpers.serving import Running
    from pretune.serve import Limits, load_server

    running = Running(load_server(str(smollm2), name="smollm2", limits=Limits(max_batch=8, max_queue=256)))
    try:
        served = _evaluate("local-completions", f"base_url={running.url}/v1/completions,model=smollm2,"
                           f"tokenizer={smollm2},tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")
    finally:
        running.stop()
    for task in MC:
        assert served["results"][task]["acc,none"] == ours["results"][task]["acc,none"], task
        a, b = _loglikelihoods(served, task), _loglikelihoods(ours, task)
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3  # the server scores at batch 1 (another kernel)
