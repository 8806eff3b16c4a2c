"""`pretune bench peft`: the worker trains what each implementation should train, and the table."""

import pytest

from pretune.bench.peft import IMPLS, Job, format_rows, run_worker


@pytest.mark.parametrize("impl, trainable", [("pretune-lora", 6 * 3 * (8 * 512 + 512 * 8)),
                                             ("peft-lora", 6 * (8 * 512 + 3 * 512 * 8))])
def test_worker_trains_only_the_lora_weights(impl, trainable):
    pytest.importorskip("peft")
    res = run_worker(Job(impl, batch=1, seq=16, steps=1, warmup=0))
    assert res["trainable"] == trainable and res["total"] > 20_000_000
    assert res["step_s"] > 0 and res["peak_rss_mb"] > 0 and res["loss"] == res["loss"]


def test_format_rows_reports_ratios_and_target():
    row = {"dtype": "fp32", "pretune_lora_speedup": 1.8, "peft_lora_speedup": 1.3, "lora_ratio": 1.2,
           "target_met": True}
    for impl, s in zip(IMPLS, (1.0, 0.55, 1.2, 0.66)):
        row.update({f"{impl}_step_s": s, f"{impl}_peak_rss_mb": 500.0, f"{impl}_trainable": 10, f"{impl}_runs": [s]})
    text = format_rows([row])
    assert "pretune LoRA vs peft LoRA: 1.20x (target >= 1.15x: met)" in text
    assert text.count("\n") == len(IMPLS) + 3  # title, header, rule, one line per implementation, summary
