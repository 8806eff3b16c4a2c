"""lm-evaluation-harness: the ``pretune`` model class against lm-eval's own ``hf`` class on the same exported model,
over local task YAMLs on bundled data (tests/eval/tasks: a WordNet gloss -> word multiple choice, an SMS spam yes/no,
the glosses' perplexity and the gloss's word generated); and ``pretune eval``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "tasks"
ALL = ["wordnet_gloss_word", "sms_spam_yn", "wordnet_gloss_ppl", "wordnet_gloss_gen"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tiny random chat model of the server tests, exported as a transformers folder."""
    from helpers.tiny_chat import tiny_chat_model
    from pretune.interop import to_hf

    d = tmp_path_factory.mktemp("lmeval")
    model, _ = tiny_chat_model(d / "tiny")
    return to_hf(model, d / "hf", tokenizer_dir=d / "tiny")


def _run(model: str, folder, tasks, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import pretune.jobs.harness  # noqa: F401  (registers "pretune")

    # the exported tokenizer declares no BOS where pretune's token-string rule finds one (<|endoftext|>), so the
    # token an empty context is scored after is named for both sides
    return lm_eval.simple_evaluate(model=model, model_args=f"pretrained={folder},prefix_token_id=2", tasks=tasks,
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
                                   batch_size=8, device="cpu", log_samples=True, **kw)


def test_pretune_model_equals_hf_model(hf_folder):
    ours, theirs = _run("pretune", hf_folder, ALL), _run("hf", hf_folder, ALL)
    for task in ("wordnet_gloss_word", "sms_spam_yn", "wordnet_gloss_gen"):
        a, b = ours["results"][task], theirs["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            assert a.get(metric) == b.get(metric), (task, metric)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["wordnet_gloss_ppl"][metric] == pytest.approx(
            theirs["results"]["wordnet_gloss_ppl"][metric], rel=1e-5)
    n = 0
    for task in ALL:
        for x, y in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert x["doc_id"] == y["doc_id"]
            for (rx,), (ry,) in zip(x["resps"], y["resps"], strict=True):
                if isinstance(rx, str):  # generate_until: the same greedy text, cut at the same stop
                    assert rx == ry
                elif isinstance(rx, float):  # loglikelihood_rolling
                    assert rx == pytest.approx(ry, abs=1e-4)
                else:  # loglikelihood: (log-likelihood, is_greedy)
                    assert rx[0] == pytest.approx(ry[0], abs=1e-4) and rx[1] == ry[1]
                n += 1
    assert n == 32 * 4 + 24 * 2 + 32 + 32  # every request compared
    assert ours["results"]["sms_spam_yn"]["acc,none"] == theirs["results"]["sms_spam_yn"]["acc,none"]


def test_pretune_eval_cli(hf_folder, tmp_path, capsys):
    from pretune.cli import main

    out = tmp_path / "results.json"
    rc = main(["eval", str(hf_folder), "--tasks", "sms_spam_yn", "--include-path", str(TASKS), "--limit", "6",
               "--batch-size", "4", "--out", str(out), "--model-args", "prefix_token_id=2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "sms_spam_yn" in printed and "acc" in printed
    results = json.loads(out.read_text())
    assert results["results"]["sms_spam_yn"]["sample_len"] == 6
    assert main(["eval", str(hf_folder), "--tasks", "sms_spam_yn", "--out", str(out)]) == 2  # exists: refused
    assert "already exists" in capsys.readouterr().err


@pytest.mark.slow  # lm-eval's index of its own tasks takes ~8 s to build
def test_pretune_eval_unknown_task(hf_folder, capsys):
    from pretune.cli import main

    assert main(["eval", str(hf_folder), "--tasks", "no_such_task", "--include-path", str(TASKS)]) == 2
    assert "unknown lm-eval task(s) no_such_task" in capsys.readouterr().err
