"""`pretune bench sft`: the batch every side trains on, the sides computing the same loss, and the table."""

import numpy as np
import pytest

from pretune.bench.sft import IMPLS, Job, available_impls, build_batch, format_rows, run_worker


def smollm2():
    from pretune import realmodels

    try:
        return realmodels.smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))


def test_batch_is_full_rows_of_chat_with_labels_on_the_answers():
    from pretune.io.tokenization import Tokenizer

    folder = smollm2()
    batch = build_batch(folder, 2, 128)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 128) and batch["attention_mask"].all()
    tok = Tokenizer.load(folder)
    labelled = batch["labels"][0] != -100
    assert 0 < labelled.sum() < 0.2 * labelled.size  # completion-only: a few answer tokens per exchange
    answers = tok.decode(batch["input_ids"][0][labelled]).split("<|im_end|>")
    assert {a.strip() for a in answers if a.strip()} <= {"ham", "spam"}
    np.testing.assert_array_equal(batch["labels"][0][labelled], batch["input_ids"][0][labelled])


@pytest.mark.slow
def test_every_side_starts_from_the_same_loss(tmp_path):
    pytest.importorskip("peft")
    folder = smollm2()
    np.savez(tmp_path / "b.npz", **build_batch(folder, 1, 64))
    res = {impl: run_worker(Job(impl, batch=1, seq=64, steps=2, warmup=1, batch_file=str(tmp_path / "b.npz")))
           for impl in available_impls()}
    for impl in res:
        assert res[impl]["first_loss"] == pytest.approx(res["pretune"]["first_loss"], abs=1e-4), impl
        assert res[impl]["trainable"] == 30 * 8 * (576 + 576 + 576 + 192), impl
        assert res[impl]["tokens_per_s"] > 0 and res[impl]["peak_rss_mb"] > 0


def test_trl_is_timed_only_where_it_is_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert available_impls() == ("pretune", "pretune-ac", "peft")
    assert available_impls(("pretune", "peft")) == ("pretune", "peft")
    from pretune.bench.common import chosen_impls  # what sft, dpo and grpo's run_cli ask

    assert chosen_impls(None, ("pretune", "trl-pre", "trl"), bench="dpo", trainer="DPOTrainer") == ("pretune",)
    assert chosen_impls(["pretune", "trl"], ("pretune", "trl"), bench="dpo", trainer="DPOTrainer") is None


def test_format_rows_reports_ratios_and_target():
    row = {"dtype": "bf16", "batch": 8, "seq": 256, "targets": 121, "speed_ratio": 1.6, "memory_ratio": 0.7,
           "target_met": True, "eval_records": 100, "eval_s": 20.0, "eval_records_per_s": 5.0, "eval_accuracy": 0.5}
    for impl, tps in zip(("pretune", "peft"), (1600.0, 1000.0)):
        row.update({f"{impl}_tokens_per_s": tps, f"{impl}_peak_rss_mb": 700.0, f"{impl}_first_loss": 1.1,
                    f"{impl}_runs": [tps]})
    text = format_rows([row])
    assert "pretune vs peft: 1.60x tokens/s at 0.70x peak memory (target >= 1.5x at <= 0.8x: met)" in text
    assert "pretune vs trl" not in text and "pretune-ac" not in text  # a row written before TRL was a side
    row.update(impls=list(IMPLS), trl_tokens_per_s=1250.0, trl_peak_rss_mb=800.0, trl_first_loss=1.1,
               trl_runs=[1250.0], trl_speed_ratio=1.28, trl_memory_ratio=0.875, trl_target_met=False,
               **{"pretune-ac_tokens_per_s": 1300.0, "pretune-ac_peak_rss_mb": 500.0, "pretune-ac_first_loss": 1.1,
                  "pretune-ac_runs": [1300.0]},
               trl_ac_speed_ratio=1.04, trl_ac_memory_ratio=0.625, trl_ac_target_met=False)
    text = format_rows([row])
    assert "pretune vs trl: 1.28x tokens/s at 0.88x peak memory (target >= 1.5x at <= 0.8x: NOT met)" in text
    assert "pretune-ac vs trl: 1.04x tokens/s at 0.62x peak memory (target >= 1.5x at <= 0.8x: NOT met)" in text
    assert text.count("1250") == 2  # its tokens/s and its rounds
    assert ["pretune-ac", "1300", "500"] in [line.split()[:3] for line in text.splitlines()]
    assert "100 test records in 20.0 s (5.00 records/s)" in text
