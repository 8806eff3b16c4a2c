"""`pretune bench grpo`: the prompts, the row built from the sides' results (ratios, target, the token check), the
pretune worker (`pretune finetune --task grpo`'s Trainer step) on a tiny random-weight Llama with SmolLM2's tokenizer,
a whole run of the harness against TRL's GRPOTrainer, and the table. No timing is asserted."""

import json
import shutil

import pytest

from pretune.bench.grpo import TARGET_MEMORY, TARGET_SPEED, Job, build_prompts, format_rows, run_worker, summarize

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SETTINGS = dict(prompts=2, group=2, new_tokens=5, r=8, steps=1, warmup=1, threads=0, model="")


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
    folder = tmp_path_factory.mktemp("bench-grpo") / "tiny"
    T.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in TOKENIZER_FILES:
        shutil.copy(smol / f, folder / f)
    return folder


def _prompts_file(tmp_path, n: int):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in build_prompts(n)))
    return path


def test_the_prompts_are_additions_with_their_sums():
    recs = build_prompts(5)
    assert recs == build_prompts(5) and recs != build_prompts(5, seed=1)  # seeded
    for rec in recs:
        [turn] = rec["prompt"]
        a, b = (int(x) for x in turn["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert turn["role"] == "user" and 10 <= a <= 99 and 10 <= b <= 99 and rec["answer"] == str(a + b)


def _result(sps, rss, *, tokens=(40, 40), prompt=(300, 300), calls=(1, 1), **extra):
    return {"steps_per_s": sps, "peak_rss_mb": rss, "sampling_fraction": 0.5, "completion_tokens": list(tokens),
            "prompt_tokens": list(prompt), "sample_calls": list(calls), "reward": 0.25, "trainable": 100, **extra}


def test_the_row_takes_medians_ratios_and_checks_every_step_s_tokens():
    samples = {"pretune": [_result(0.2, 1000.0), _result(0.3, 1100.0), _result(0.25, 900.0)],
               "trl": [_result(0.1, 1500.0, gradient_checkpointing=True), _result(0.12, 1400.0),
                       _result(0.11, 1450.0)]}
    row = summarize(samples, impls=("pretune", "trl"), dtype="bf16", rounds=3, job_kw=SETTINGS)
    assert row["pretune_steps_per_s"] == 0.25 and row["trl_steps_per_s"] == 0.11  # medians
    assert row["pretune_peak_rss_mb"] == 1100.0 and row["trl_peak_rss_mb"] == 1500.0  # the largest run
    assert row["speed_ratio"] == pytest.approx(0.25 / 0.11) and row["memory_ratio"] == pytest.approx(1100 / 1500)
    assert 0.25 / 0.11 >= TARGET_SPEED and 1100 / 1500 <= TARGET_MEMORY and row["target_met"] is True
    assert row["same_tokens"] and row["one_generation_per_step"] and row["trl_gradient_checkpointing"]
    assert "ac_speed_ratio" not in row  # pretune-ac was not run
    assert row["pretune_completion_tokens"] == 40 and row["pretune_prompt_tokens"] == 300

    # one TRL step generated fewer tokens (a completion stopped early), one pretune step sampled twice, the memory is
    # over the target
    samples["trl"][1] = _result(0.12, 1400.0, tokens=(40, 39))
    samples["pretune"][2] = _result(0.25, 1300.0, calls=(1, 2))
    row = summarize(samples, impls=("pretune", "trl"), dtype="bf16", rounds=3, job_kw=SETTINGS)
    assert not row["same_tokens"] and not row["one_generation_per_step"] and not row["target_met"]
    text = format_rows([row])
    assert "WARNING: the sides generated or read different numbers of tokens" in text
    assert "WARNING: some step called the generator other than once" in text
    assert f"pretune vs trl: {row['speed_ratio']:.2f}x steps/s at {row['memory_ratio']:.2f}x peak memory " \
           f"(target >= 2x at <= 0.8x: NOT met)" in text


def test_format_rows_reports_the_sides_the_settings_and_the_target():
    samples = {impl: [_result(sps, rss, **extra)] for impl, sps, rss, extra in (
        ("pretune", 0.3, 900.0, {}), ("pretune-ac", 0.25, 600.0, {}),
        ("trl", 0.1, 1500.0, {"gradient_checkpointing": True}))}
    row = summarize(samples, impls=("pretune", "pretune-ac", "trl"), dtype="fp32", rounds=1, job_kw=SETTINGS)
    text = format_rows([{**row, "cpu": "CPU AMD EPYC (AVX512, AVX512-BF16)"}])
    assert text.startswith("fp32: LoRA GRPO step (r=8, q_proj, v_proj; dapo, beta 0), 2 prompts x G 2 = 4 "
                           "completions of 5 tokens (40 completion + 300 prompt tokens a step), 1 warmup + 1 timed "
                           "steps, 1 round; CPU AMD EPYC")
    assert "pretune vs trl: 3.00x steps/s at 0.60x peak memory (target >= 2x at <= 0.8x: met)" in text
    assert "pretune-ac vs trl: 2.50x steps/s at 0.40x peak memory (target >= 2x at <= 0.8x: met)" in text
    assert "trl: activation checkpointing on (GRPOConfig's default)" in text and "WARNING" not in text
    assert ["trl", "0.1000", "10.00", "1500", "50.0%", "0.250"] == next(
        x.split()[:6] for x in text.splitlines() if x.strip().startswith("trl "))


def test_the_pretune_worker_runs_the_finetuning_trainer_to_full_length(tiny, tmp_path):
    """The pretune side samples every completion to exactly new_tokens (EOS forbidden until then) with one call of the
    generator per step, trains the LoRA adapter of `--peft lora` (q_proj, v_proj), and puts the task's generator back
    afterwards."""
    from pretune.tasks import grpo

    generate = grpo.generate
    res = run_worker(Job("pretune", "fp32", data_file=str(_prompts_file(tmp_path, 2)), **{**SETTINGS,
                                                                                           "model": str(tiny)}))
    assert grpo.generate is generate
    assert res["completion_tokens"] == [2 * 2 * 5] * 2 and res["sample_calls"] == [1, 1]
    assert len(set(res["prompt_tokens"])) == 1 and res["prompt_tokens"][0] > 2 * 2 * 20  # the chat-rendered prompts
    assert res["trainable"] == 2 * 8 * (32 + 32 + 32 + 16)  # 2 layers, r 8: q 32->32, v 32->16
    assert res["precision"] == "fp32" and 0 < res["sampling_fraction"] < 1 and res["steps_per_s"] > 0
    assert res["peak_rss_mb"] > 0 and 0 <= res["reward"] <= 1


def test_the_bf16_base_side_stores_the_frozen_weights_in_bf16_and_refuses_fp32(tiny, tmp_path, capsys):
    """pretune-bf16base (peft.base_dtype=bf16) trains the same adapter on the same tokens under bf16 autocast; asked for
    with fp32 matmuls, the command says why it cannot before running anything."""
    from pretune.cli import main

    res = run_worker(Job("pretune-bf16base", "bf16", data_file=str(_prompts_file(tmp_path, 2)),
                         **{**SETTINGS, "model": str(tiny)}))
    assert res["completion_tokens"] == [2 * 2 * 5] * 2 and res["trainable"] == 2 * 8 * (32 + 32 + 32 + 16)
    assert res["precision"] == "bf16"
    assert main(["bench", "grpo", "--model", str(tiny), "--impls", "pretune-bf16base", "--precision", "fp32",
                 "--rounds", "1"]) == 2
    assert "pretune-bf16base stores the frozen base in bf16" in capsys.readouterr().err


def test_a_run_times_both_sides_in_their_own_processes_on_the_same_tokens(tiny, tmp_path, capsys):
    """`pretune bench grpo --impls pretune trl` end to end (1 round, 1 step, no warmup): pretune and TRL's GRPOTrainer
    each ran in a process of its own, generated and read the same tokens with one generation per step, trained the
    same adapter, and the table and JSON say what the rows hold."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from pretune.cli import main

    out = tmp_path / "rows.json"
    assert main(["bench", "grpo", "--model", str(tiny), "--impls", "pretune", "trl", "--rounds", "1", "--steps", "1",
                 "--warmup", "0", "--prompts", "2", "--group", "2", "--new-tokens", "5", "--precision", "fp32",
                 "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["impls"] == ["pretune", "trl"] and row["dtype"] == "fp32" and row["cpu"].startswith("CPU")
    assert row["same_tokens"] and row["one_generation_per_step"]
    assert row["pretune_completion_tokens"] == row["trl_completion_tokens"] == 2 * 2 * 5
    assert row["pretune_prompt_tokens"] == row["trl_prompt_tokens"] > 2 * 2 * 20  # the same chat rendering
    assert row["pretune_trainable"] == row["trl_trainable"] == 2 * 8 * (32 + 32 + 32 + 16)
    assert row["trl_gradient_checkpointing"] and "pretune_gradient_checkpointing" not in row
    for impl in row["impls"]:
        assert len(row[f"{impl}_runs"]) == 1 and row[f"{impl}_steps_per_s"] > 0 and row[f"{impl}_peak_rss_mb"] > 0
        assert 0 < row[f"{impl}_sampling_fraction"] < 1, impl
    assert row["speed_ratio"] == pytest.approx(row["pretune_steps_per_s"] / row["trl_steps_per_s"])
    assert row["memory_ratio"] == pytest.approx(row["pretune_peak_rss_mb"] / row["trl_peak_rss_mb"])
    text = capsys.readouterr().out
    assert text.startswith(format_rows([row])) and "WARNING" not in text
