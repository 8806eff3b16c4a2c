"""`pretune bench model`: both loops run on every family and the table reports speed and memory ratios."""

import pytest

from pretune.bench.model import REAL_VOCAB, Job, _build, format_rows


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_both_sides_build_the_same_shape(family):
    pytest.importorskip("transformers")
    sizes = {}
    for impl in ("pretune", "transformers"):
        model, ids, labels = _build(Job(impl, family, "fp32", batch=2, seq=16, loop="labels"))
        sizes[impl] = sum(p.numel() for p in model.parameters())
        assert ids.shape == labels.shape == (2, 16) and int(ids.max()) < REAL_VOCAB[family]
        if family == "bert":
            assert 0 < int((labels != -100).sum()) < 16  # ~15% of the rows labelled
    # same architecture on both sides (BERT: transformers' MLM decoder bias is separate; GPT-2: same count)
    assert abs(sizes["pretune"] - sizes["transformers"]) <= REAL_VOCAB[family], sizes


def test_labels_loop_table_has_the_memory_ratio():
    row = {"model": "gpt", "dtype": "fp32", "pretune_tokens_per_s": 1200.0, "transformers_tokens_per_s": 1000.0,
           "ratio": 1.2, "pretune_mfu": 0.2, "transformers_mfu": 0.17, "peak_gflops": 500.0, "memory_ratio": 0.65,
           "loop": "labels"}
    text = format_rows([row])
    assert "0.65x" in text and "1.20" in text and "AdamW" in text
