"""pretune bench serve's plumbing on a tiny model: a real pretune serve process, real streaming clients over HTTP."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")
pytest.importorskip("uvicorn")


def test_bench_serve_plumbing(tmp_path):
    from helpers.tiny_chat import tiny_chat_model

    from pretune.bench.serve import bench_serve, format_rows, run_worker

    tiny_chat_model(tmp_path / "tiny")
    lines = []
    rows = bench_serve(model=tmp_path / "tiny", clients=(1, 3), rounds=1, new_tokens=4, threads=1, impls=("pretune",),
                       echo=lines.append, spawn=lambda job, module: run_worker(job))  # the client in this process
    assert [r["clients"] for r in rows] == [1, 3]
    for r in rows:
        # every request streams its 4 tokens (the tiny model's EOS is rare; a stop ends a stream early)
        assert 0 < r["pretune_tokens"][0] <= 4 * r["clients"]
        assert r["pretune_tokens_per_s"] > 0 and 0 < r["pretune_ttft_p50"] <= r["pretune_ttft_p95"]
    assert len(lines) == 1 and "3 clients" in lines[0]
    table = format_rows(rows)
    assert "TTFT p50" in table and table.count("pretune ") == 2
    with pytest.raises(ValueError, match="impls"):
        bench_serve(model=tmp_path / "tiny", impls=("vllm",))
