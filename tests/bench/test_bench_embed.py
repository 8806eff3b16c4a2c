"""`pretune bench embed`: the pairs and texts it reads, the row built from the sides' results (ratios, targets), the
table, and both sides' workers at a tiny size (the same embeddings; a training step each, pretune reading fewer
positions). No timing is asserted."""

import json

import pytest

from pretune.bench import embed
from pretune.bench.embed import TARGET_ENCODE, TARGET_MEMORY, TARGET_SPEED, Job, format_rows, run_worker, summarize

SETTINGS = dict(batch=32, max_len=128, steps=5, warmup=2, passes=3, threads=2, model="")


def minilm():
    from pretune import realmodels

    try:
        return realmodels.minilm_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))


def test_pairs_are_a_definition_and_its_usage_example():
    pairs = embed.wordnet_pairs("train")
    assert len(pairs) > 200 and len({p["anchor"] for p in pairs}) > 150
    first = pairs[0]
    assert first == {"anchor": first["anchor"], "positive": first["positive"]}
    assert all(len(p["anchor"].split()) >= 3 and len(p["positive"].split()) >= 3 and '"' not in p["positive"]
               for p in pairs)
    texts = embed.encode_texts()
    assert len(texts) == len(set(texts)) and {first["anchor"], first["positive"]} <= set(texts)
    assert not {p["anchor"] for p in embed.wordnet_pairs("test")} & {p["anchor"] for p in pairs}  # splits apart


def _train(step_s, rss, cpu_s=None):
    return {"step_s": step_s, "cpu_s": cpu_s or step_s, "peak_rss_mb": rss, "first_loss": 1.5,
            "positions": [700, 720], "tokens": [650, 660]}


def _encode(seconds, vectors):
    return {"encode_s": seconds, "encode_cpu_s": seconds, "texts": 600, "peak_rss_mb": 500.0, "vectors": vectors}


def test_the_row_takes_medians_ratios_and_targets():
    train = {"pretune": [_train(0.5, 900.0), _train(0.4, 950.0), _train(0.6, 920.0)],
             "st": [_train(1.0, 1300.0), _train(0.9, 1250.0, cpu_s=1.2), _train(1.1, 1280.0)]}
    encode = {"pretune": [_encode(2.0, [[0.5, 0.5]]), _encode(2.2, [[0.5, 0.5]])],
              "st": [_encode(2.6, [[0.5, 0.5 + 2e-7]]), _encode(2.5, [[0.5, 0.5]])]}
    row = summarize(train, encode, dtype="fp32", rounds=3, job_kw=SETTINGS)
    assert row["pretune_pairs_per_s"] == pytest.approx(32 / 0.5) and row["st_pairs_per_s"] == pytest.approx(32 / 1.0)
    assert row["pretune_peak_rss_mb"] == 950.0 and row["st_peak_rss_mb"] == 1300.0  # the largest run
    assert row["speed_ratio"] == pytest.approx(2.0) and row["memory_ratio"] == pytest.approx(950 / 1300)
    assert row["cpu_speed_ratio"] == pytest.approx((32 / 0.5) / (32 / 1.1))
    assert 2.0 >= TARGET_SPEED and 950 / 1300 <= TARGET_MEMORY and row["target_met"] is True
    assert row["pretune_positions"] == 710 and row["pretune_tokens"] == 655
    want = (600 / 2.0 + 600 / 2.2) / (600 / 2.6 + 600 / 2.5)  # medians of two rounds: their means
    assert row["encode_ratio"] == pytest.approx(want) and row["encode_ratio"] < TARGET_ENCODE
    assert row["encode_target_met"] is False and row["encode_max_abs_diff"] == pytest.approx(2e-7)
    text = format_rows([{**row, "cpu": "CPU test", "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 2.0, 2.0]}])
    assert "pretune vs sentence-transformers fit: 2.00x pairs/s" in text and "at 0.73x peak memory" in text
    assert "(target >= 1.5x at <= 0.8x: met)" in text and "target >= 1.5x: NOT met" in text
    assert "CPU test" in text and "[1.0, 1.0, 1.0] before" in text

    train["pretune"][1] = _train(0.4, 1200.0)  # over 0.8x the memory: not met however fast
    row = summarize(train, {}, dtype="bf16", rounds=3, job_kw=SETTINGS)
    assert not row["target_met"] and "encode_ratio" not in row and "encoding" not in format_rows([row])


def test_both_sides_embed_the_same_vectors(tmp_path):
    pytest.importorskip("sentence_transformers")
    minilm()
    texts = embed.encode_texts()[:12]
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    res = {impl: run_worker(Job(impl, "encode", batch=4, passes=1, threads=1, data_file=str(data)))
           for impl in ("pretune", "st")}
    assert res["pretune"]["texts"] == res["st"]["texts"] == 12
    assert res["pretune"]["sampled"] == res["st"]["sampled"]
    import numpy as np

    np.testing.assert_allclose(res["pretune"]["vectors"], res["st"]["vectors"], atol=1e-5)
    assert all(r["encode_s"] > 0 and r["peak_rss_mb"] > 0 for r in res.values())


@pytest.mark.slow  # ~2-5 s: two trainers built (make test-slow)
def test_both_sides_train_a_step_and_pretune_reads_fewer_positions(tmp_path):
    pytest.importorskip("sentence_transformers")
    minilm()
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in embed.wordnet_pairs("train")[:16]))
    res = {impl: run_worker(Job(impl, "train", batch=8, steps=1, warmup=1, threads=1, data_file=str(data)))
           for impl in ("pretune", "st")}
    for r in res.values():
        assert len(r["losses"]) == 2 and all(0 < x < 10 for x in r["losses"]) and r["step_s"] > 0
        assert all(p >= t for p, t in zip(r["positions"], r["tokens"]))
    # both read every token of the 16 pairs over the 2 steps; pretune packs them, sentence-transformers pads
    assert sum(res["pretune"]["tokens"]) == sum(res["st"]["tokens"])
    assert sum(res["pretune"]["positions"]) < sum(res["st"]["positions"])
