"""bench_generate: the parent path on a tiny Llama (one process per side), the table, the flags."""

import json
from pathlib import Path

import pytest
import torch

from conftest import requires_cxx
from pretune.bench import generate as bg

T = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                        eos_token_id=2)
    d = tmp_path_factory.mktemp("llama")
    T.LlamaForCausalLM(cfg).eval().save_pretrained(d)
    return d


def _in_process(job, module):
    assert module == "pretune.bench.generate"
    return bg.run_worker(job)


@requires_cxx  # the pretune-compiled side
@pytest.mark.parametrize("spawn", [_in_process, pytest.param(None, marks=pytest.mark.slow)])
def test_bench_generate_tiny(tiny_llama, spawn):
    """Two rounds, batch 1 and 2: every side generates exactly new_tokens tokens per row (in this process, or
    each run in its own process as the real benchmark does: slow, ~7 s per process start)."""
    lines = []
    kw = {"spawn": spawn} if spawn is not None else {}
    rows = bg.bench_generate(model=tiny_llama, batches=(1, 2), rounds=2, prompt_len=5, new_tokens=6, repeats=1,
                             threads=1, show_progress=False, echo=lines.append, **kw)
    assert [r["batch"] for r in rows] == [1, 2] and len(lines) == 12
    order = [line.split(":")[0] for line in lines]  # who goes first alternates between rounds
    assert order[:3] == ["batch 1 pretune", "batch 1 pretune-compiled", "batch 1 transformers"]
    assert order[6:9] == ["batch 1 transformers", "batch 1 pretune-compiled", "batch 1 pretune"]
    for row in rows:
        assert row["bench"] == "generate" and row["threads"] == 1 and row["new_tokens"] == 6
        for impl in bg.DEFAULT_IMPLS:
            assert len(row[f"{impl}_runs"]) == 2 and row[f"{impl}_tokens_per_s"] > 0
        for impl, key in bg.OURS.items():
            assert row[f"{key}ratio"] == pytest.approx(row[f"{impl}_tokens_per_s"] / row["transformers_tokens_per_s"])
            assert row[f"{key}same_tokens"] is True  # the same greedy tokens as transformers
        assert row["compiled_first_seconds"] > 0
    for impl, key in bg.OURS.items():
        assert rows[0][f"{key}target_met"] == (rows[0][f"{key}ratio"] >= bg.TARGETS[impl])
        assert f"{key}target_met" not in rows[1]
    text = bg.format_rows(rows)
    assert "6 new tokens after a 5-token prompt" in text and "target" in text and "first call" in text
    json.dumps(rows)  # --json writes them as they are


def test_bench_generate_subset_of_implementations(tiny_llama):
    rows = bg.bench_generate(model=tiny_llama, batches=(1,), rounds=1, prompt_len=4, new_tokens=3, repeats=1,
                             threads=1, show_progress=False, echo=None, impls=("pretune", "transformers"),
                             spawn=_in_process)
    assert "ratio" in rows[0] and "compiled_ratio" not in rows[0] and "pretune-compiled_runs" not in rows[0]
    assert "compiled" not in bg.format_rows(rows)
    with pytest.raises(ValueError, match="impls"):
        bg.bench_generate(model=tiny_llama, impls=("pretune", "vllm"))


def test_bench_generate_quantized_sides(tiny_llama):
    """--quantize int8 int4: pretune.quantize's sides, their speed-up over pretune's fp32 eager side and its target."""
    rows = bg.bench_generate(model=tiny_llama, batches=(1,), rounds=1, prompt_len=4, new_tokens=3, repeats=1,
                             threads=1, show_progress=False, echo=None, spawn=_in_process,
                             impls=("pretune", "pretune-int8", "pretune-int4"))
    row = rows[0]
    for mode, (impl, target) in (("int8", ("pretune-int8", 1.8)), ("int4", ("pretune-int4", 2.5))):
        assert row[f"{mode}_speedup"] == pytest.approx(row[f"{impl}_tokens_per_s"] / row["pretune_tokens_per_s"])
        assert row[f"{mode}_target_met"] == (row[f"{mode}_speedup"] >= target)
    assert "pretune-int4: " in bg.format_rows(rows) and "pretune's fp32 eager tokens/s" in bg.format_rows(rows)


def test_worker_generates_every_token(tiny_llama):
    res = bg.run_worker(bg.Job("pretune", str(tiny_llama), batch=2, prompt_len=4, new_tokens=5, repeats=2,
                               threads=1))
    assert len(res["all_seconds"]) == 2 and res["seconds"] == min(res["all_seconds"])
    assert res["tokens_per_s"] == pytest.approx(2 * 5 / res["seconds"])
    assert [len(r) for r in res["tokens"]] == [5, 5]


def test_format_rows():
    row = {"bench": "generate", "model": "/x/smollm2-135m-instruct", "dtype": "fp32", "batch": 1, "prompt_len": 32,
           "new_tokens": 128, "rounds": 1, "repeats": 2, "threads": 2, "pretune_runs": [30.0],
           "transformers_runs": [18.0], "pretune_tokens_per_s": 30.0, "transformers_tokens_per_s": 18.0,
           "ratio": 30 / 18, "same_tokens": True, "target_met": True}
    text = bg.format_rows([row])
    assert "smollm2-135m-instruct" in text and "1.67" in text and ": met" in text and "same tokens" in text
    assert "NOT met" in bg.format_rows([{**row, "ratio": 1.2, "target_met": False}])
    compiled = {**row, "pretune-compiled_runs": [36.0], "pretune-compiled_tokens_per_s": 36.0, "compiled_ratio": 2.0,
                "compiled_same_tokens": False, "compiled_target_met": True, "compiled_first_seconds": 61.0}
    text = bg.format_rows([compiled])
    assert "2.00" in text and "tokens DIFFER" in text and "61.0 s" in text


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="rounds"):
        bg.bench_generate(model=tmp_path, rounds=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        bg.bench_generate(model=tmp_path)


def test_cli_flags():
    from pretune.cli import build_parser

    args = build_parser().parse_args(["bench", "generate", "--batches", "1", "--rounds", "1", "--new-tokens", "16",
                                      "--json", "out.json"])
    assert (args.batches, args.rounds, args.new_tokens, args.prompt_len, args.json) == ([1], 1, 16, 32, "out.json")
    assert args.func is bg.run_cli and Path(bg.__file__).parts[-2:] == ("bench", "generate.py")
