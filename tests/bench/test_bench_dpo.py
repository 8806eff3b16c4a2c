"""`pretune bench dpo`: the pairs every side trains on, a whole run of the harness (each side in its own process) on a
tiny random-weight Llama with SmolLM2's tokenizer, and the table. No timing is asserted."""

import json
import math
import shutil

import pytest

from pretune.bench.dpo import build_pairs, format_rows

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A folder holding a random tiny LlamaForCausalLM (dim 32, 2 layers) and SmolLM2's tokenizer and template."""
    T = pytest.importorskip("transformers")
    import torch

    from pretune import realmodels

    try:
        smol = realmodels.smollm2_dir()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    tok = T.AutoTokenizer.from_pretrained(smol)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    folder = tmp_path_factory.mktemp("bench-dpo") / "tiny"
    T.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in TOKENIZER_FILES:
        shutil.copy(smol / f, folder / f)
    return folder


def test_pairs_fill_the_length_and_prefer_the_glosses_own_words(tiny):
    from pretune.loading import load_pretrained
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record

    pairs = build_pairs(tiny, 3, 96)
    loaded = load_pretrained(tiny)
    task = build_task(TaskConfig(name="dpo", max_len=96), loaded.model.config, loaded.tokenizer)
    for rec in pairs:
        prompt, chosen, rejected = task.pair_ids(Record("pairs", rec))
        assert 72 <= len(prompt) + max(len(chosen), len(rejected)) <= 96  # within a gloss of the length, never cut
        words = [line.split(". ", 1)[1] for line in rec["chosen"][0]["content"].splitlines()]
        wrong = [line.split(". ", 1)[1] for line in rec["rejected"][0]["content"].splitlines()]
        assert len(words) >= 2 and sorted(words) == sorted(wrong)
        assert all(w != x for w, x in zip(words, wrong))  # every line of rejected answers another gloss
    assert len({p["prompt"][0]["content"] for p in pairs}) == 3  # different glosses in each pair
    with pytest.raises(ValueError, match="--seq 40"):
        build_pairs(tiny, 1, 40)


def test_a_run_times_both_sides_in_their_own_processes_and_reports_it(tiny, tmp_path, capsys):
    """`pretune bench dpo --impls pretune trl` end to end (1 round, 1 step, no warmup): pretune and TRL's DPOTrainer
    each ran in a process of its own, on the same tokens, from the same first loss (ln 2: the adapter starts as the
    identity, so policy = reference), and the table and JSON say what the rows hold."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from pretune.cli import main

    out = tmp_path / "rows.json"
    assert main(["bench", "dpo", "--model", str(tiny), "--impls", "pretune", "trl", "--rounds", "1", "--steps", "1",
                 "--warmup", "0", "--batch", "2", "--seq", "96", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["impls"] == ["pretune", "trl"] and row["dtype"] == "fp32" and row["sequences"] == 4
    for impl in row["impls"]:
        assert len(row[f"{impl}_runs"]) == 1 and row[f"{impl}_pairs_per_s"] > 0, impl
        assert row[f"{impl}_first_loss"] == pytest.approx(math.log(2), abs=1e-5), impl
        assert row[f"{impl}_peak_rss_mb"] > 0, impl
        assert row[f"{impl}_trainable"] == 2 * 8 * (32 + 32 + 32 + 16), impl  # 2 layers, r 8: q 32->32, v 32->16
    assert row["same_tokens"] and row["pretune_tokens"] == row["trl_tokens"] > 4 * 72
    assert 0 < row["pretune_ref_fraction"] < 1 and "trl_ref_fraction" not in row
    assert row["speed_ratio"] == pytest.approx(row["pretune_pairs_per_s"] / row["trl_pairs_per_s"])
    assert row["memory_ratio"] == pytest.approx(row["pretune_peak_rss_mb"] / row["trl_peak_rss_mb"])
    assert row["target_met"] == (row["speed_ratio"] >= 1.5 and row["memory_ratio"] <= 0.8)
    assert not any(k.startswith(("ac_", "pre_")) for k in row)  # pretune-ac, pretune-pre, trl-pre were not run
    text = capsys.readouterr().out
    assert text.startswith(format_rows([row]))
    assert f"pretune vs trl: {row['speed_ratio']:.2f}x pairs/s at {row['memory_ratio']:.2f}x peak memory" in text
    assert f"{row['pretune_ref_fraction']:.1%} of the step in the reference pass" in text
    assert "trl: activation checkpointing on (DPOConfig's default)" in text and row["trl_gradient_checkpointing"]
    assert "WARNING" not in text


def test_the_precomputed_reference_side_reads_it_instead_of_the_reference_pass(tiny, tmp_path):
    """pretune-pre (task.precompute_reference=true) computes the reference once before its steps, starts from the
    same loss on the same tokens as pretune, and its steps call the reference model no more."""
    from pretune.bench.dpo import Job, run_worker

    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps(build_pairs(tiny, 2, 96)))
    res = {impl: run_worker(Job(impl, batch=2, seq=96, steps=1, warmup=1, model=str(tiny), pairs_file=str(pairs)))
           for impl in ("pretune", "pretune-pre")}
    assert res["pretune-pre"]["first_loss"] == pytest.approx(res["pretune"]["first_loss"], abs=1e-6)
    assert res["pretune-pre"]["tokens"] == res["pretune"]["tokens"]
    assert res["pretune-pre"]["precompute_s"] > 0 and res["pretune"]["precompute_s"] is None
    assert 0 <= res["pretune-pre"]["ref_fraction"] < 1 and 0 < res["pretune"]["ref_fraction"] < 1


def test_format_rows_reports_ratios_target_and_reference_share():
    row = {"dtype": "bf16", "batch": 4, "seq": 256, "r": 8, "beta": 0.1, "rounds": 3, "sequences": 8,
           "impls": ["pretune", "pretune-pre", "trl"], "same_tokens": False, "speed_ratio": 1.6, "memory_ratio": 0.7,
           "target_met": True, "pre_vs_pretune_speed_ratio": 1.25, "pre_vs_pretune_memory_ratio": 0.99,
           "pretune_ref_fraction": 0.2, "pretune-pre_ref_fraction": 0.001, "pretune-pre_precompute_s": 0.5,
           "trl_gradient_checkpointing": False}
    for impl, pps, tokens in (("pretune", 1.6, 2000), ("pretune-pre", 2.0, 2000), ("trl", 1.0, 1990)):
        row.update({f"{impl}_pairs_per_s": pps, f"{impl}_peak_rss_mb": 700.0, f"{impl}_first_loss": 0.6931,
                    f"{impl}_runs": [pps], f"{impl}_tokens": tokens})
    text = format_rows([row])
    assert "bf16: LoRA DPO step (r=8, q_proj, v_proj; sigmoid, beta 0.1), 4 pairs = 8 sequences" in text
    assert "pretune vs trl: 1.60x pairs/s at 0.70x peak memory (target >= 1.5x at <= 0.8x: met)" in text
    assert "pretune-pre vs pretune: 1.25x pairs/s at 0.99x peak memory" in text
    assert "pretune: 20.0% of the step in the reference pass" in text
    assert "pretune-pre: 0.1% of the step in reading the precomputed" in text
    assert "precomputed once in 0.50 s for 4 pairs (fp32" in text
    assert "trl: activation checkpointing off (DPOConfig's default)" in text and "3 rounds" in text
    assert "WARNING: the sides trained on different numbers of tokens: pretune 2000, pretune-pre 2000, trl 1990" in text
    assert ["trl", "1.000", "700", "0.6931", "-"] == next(x.split()[:5] for x in text.splitlines()
                                                          if x.strip().startswith("trl "))
