"""bench_pretrain: both workers run in-process on a tiny model and see the same data."""

import pytest
import torch

from pretune.bench import pretrain as bp

TINY = dict(n_layers=1, dim=64, n_heads=4, ffn_dim=128, vocab_size=30522)  # vocab: the MiniLM tokenizer's


@pytest.fixture(scope="module")
def minilm():
    from pretune.realmodels import minilm_dir

    try:
        return minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def store(minilm, tmp_path_factory):
    from conftest import corpus_paragraphs

    d = tmp_path_factory.mktemp("bench_pretrain")
    (d / "text.txt").write_text("\n\n".join(corpus_paragraphs("austen.txt.gz", 60)) + "\n", encoding="utf-8")
    return bp.build_bench_store([d / "text.txt"], minilm, d / "cache", show_progress=False)


def _job(impl, store, minilm, dtype="fp32"):
    return bp.Job(impl, dtype, store=store["path"], tokenizer=str(minilm), seq=32, batch=4, steps=2, warmup=1,
                  shape=dict(TINY))


def test_tokenize_row(store):
    assert store["bench"] == "tokenize" and not store["cached"]
    for key in ("text_bytes", "file_bytes", "seconds", "mb_per_s", "tokens", "tokens_per_s", "docs"):
        assert store[key] > 0, key
    assert store["mb_per_s"] == pytest.approx(store["text_bytes"] / 1e6 / store["seconds"])


@pytest.mark.parametrize("impl", bp.IMPLS)
def test_worker_runs_and_reports(impl, store, minilm):
    res = bp.run_worker(_job(impl, store, minilm))
    for key in ("tokens_per_s", "step_s", "tokens", "seconds", "peak_rss_mb", "threads"):
        assert res[key] > 0, key
    assert res["tokens"] <= 2 * 4 * 32  # non-pad tokens of the 2 timed steps of 4 x 32
    assert torch.isfinite(torch.tensor(res["loss"]))


def test_both_sides_see_the_same_unmasked_batches(store, minilm):
    seen = {}
    for impl in bp.IMPLS:
        seen[impl] = []
        bp.run_worker(_job(impl, store, minilm), record=seen[impl])
    ours, theirs = seen["pretune"], seen["transformers"]
    assert len(ours) == len(theirs) == 3  # warmup + steps
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(bp.unmasked_ids(a), bp.unmasked_ids(b), rtol=0, atol=0)
        torch.testing.assert_close(a["attention_mask"], b["attention_mask"].to(a["attention_mask"].dtype))
        ids = bp.unmasked_ids(a)
        assert (ids[:, 0] == 101).all()  # [CLS] first
        assert (a["labels"] != -100).any() and (b["labels"] != -100).any()  # both mask something
    assert not torch.equal(bp.unmasked_ids(ours[0]), bp.unmasked_ids(ours[1]))  # steps take different blocks


def test_format_rows():
    row = {"bench": "mlm", "dtype": "bf16", "seq": 128, "batch": 32, "steps": 10, "threads": 2, **bp.SHAPE,
           "pretune_tokens_per_s": 2600.0, "transformers_tokens_per_s": 2000.0, "ratio": 1.3,
           "pretune_runs": [2600.0, 2590.0], "transformers_runs": [2000.0, 2010.0],
           "pretune_rss_mb": 700.0, "transformers_rss_mb": 900.0}
    tok = {"bench": "tokenize", "text_bytes": 2_000_000, "files": 1, "docs": 10, "tokens": 500_000, "seconds": 1.0,
           "mb_per_s": 2.0, "tokens_per_s": 500_000.0, "cached": False}
    text = bp.format_rows([tok, row])
    assert "1.30" in text and "2600" in text and "2.00 MB/s" in text


@pytest.mark.slow
def test_bench_pretrain_end_to_end(store, minilm, tmp_path):
    """The parent path: a fresh store, one worker process per (impl, dtype), the table."""
    from conftest import corpus_paragraphs

    (tmp_path / "t.txt").write_text("\n\n".join(corpus_paragraphs("austen.txt.gz", 60)) + "\n", encoding="utf-8")
    rows = bp.bench_pretrain(corpus=[tmp_path / "t.txt"], tokenizer=minilm, cache_dir=tmp_path / "cache",
                             dtypes=("fp32",), rounds=1, steps=1, warmup=0, batch=4, seq=32, shape=dict(TINY),
                             show_progress=False, echo=lambda s: None)
    assert [r["bench"] for r in rows] == ["tokenize", "mlm"]
    row = rows[1]
    assert row["pretune_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0 and row["ratio"] > 0
    assert 0 < row["timed_tokens"] <= 4 * 32
    assert "fp32" in bp.format_rows(rows)


def test_the_default_corpus_exists():
    from pretune.bench.pretrain import DEFAULT_CORPUS

    assert DEFAULT_CORPUS.is_dir() and any(DEFAULT_CORPUS.glob("*.txt.gz"))
