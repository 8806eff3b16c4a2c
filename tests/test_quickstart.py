"""`pretune quickstart --fast`: every step runs, every artefact lands in the run folder, the table is
well-formed (with the MiniLM row when its package is installed), and the bundled data is reachable."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from pretune import bundled
from pretune.cli import main


def _minilm_installed() -> bool:
    from pretune.realmodels import minilm_dir

    try:
        minilm_dir()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("qs") / "quickstart"
    cpu0 = time.process_time()
    code = main(["quickstart", "--fast", "--quiet", "--out", str(out)])
    return code, out, time.process_time() - cpu0


def test_quickstart_fast_writes_every_artefact(quickstart):
    code, out, cpu_seconds = quickstart
    assert code == 0
    assert cpu_seconds < 90, f"--fast took {cpu_seconds:.0f} CPU seconds; it is meant for tests (< 90)"
    runs = ["finetune-pretrained", "finetune-scratch"] + (["finetune-minilm"] if _minilm_installed() else [])
    expected = ["tokenizer.json", "results.md", "results.json", "quickstart.png", "data/train.jsonl",
                "pretrain/run.yaml", "pretrain/metrics.jsonl", "pretrain/loss.png", "pretrain/model/config.json",
                "pretrain/model/model.safetensors", "pretrain/model/tokenizer.json"]
    for run in runs:
        expected += [f"{run}/{f}" for f in ("run.yaml", "metrics.jsonl", "loss.png", "results.json",
                                           "test_predictions.jsonl", "model/model.safetensors", "model/task.json")]
    missing = [f for f in expected if not (out / f).is_file()]
    assert not missing, missing
    assert (out / "quickstart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "finetune-minilm").exists() or _minilm_installed()


def test_quickstart_table_is_well_formed(quickstart):
    _, out, _ = quickstart
    lines = (out / "results.md").read_text().strip().splitlines()
    assert lines[0] == "| model | parameters | test accuracy | test macro-F1 | train time | run folder |"
    assert lines[1].startswith("|---")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    names = [r[0] for r in rows]
    assert names[:2] == ["pretrained here", "from scratch (same architecture)"]
    assert ("all-MiniLM-L6-v2 (real checkpoint)" in names) == _minilm_installed()
    summary = json.loads((out / "results.json").read_text())
    for row, saved in zip(rows, summary["rows"]):
        assert len(row) == 6
        assert re.fullmatch(r"\d+\.\dM", row[1])
        acc, f1 = float(row[2]), float(row[3])
        assert 0 <= acc <= 1 and 0 <= f1 <= 1
        assert acc == pytest.approx(saved["test"]["accuracy"], abs=5e-5)
        assert re.fullmatch(r"\d+s", row[4])
        assert Path(saved["run_dir"]).is_dir() and Path(saved["run_dir"]).name == Path(row[5]).name
    # both small models share one architecture: the parameter counts match
    assert rows[0][1] == rows[1][1]


def test_quickstart_prints_the_table(tmp_path, capsys):
    """The printed output holds the table and points to the run folder (quiet run, MiniLM left out)."""
    out = tmp_path / "qs"
    assert main(["quickstart", "--fast", "--quiet", "--no-minilm", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "results.md").read_text().strip() in printed
    assert f"all artefacts in {out}/" in printed
    assert not (out / "finetune-minilm").exists()


def test_bundled_files_are_found_and_copied(tmp_path, capsys):
    assert bundled.path("tasks/sms_spam/train.jsonl").is_file()
    assert set(bundled.task("wordnet_qa")) == {"train", "dev", "test"}
    assert len(bundled.corpus()) == 4 and all(p.name.endswith(".txt.gz") for p in bundled.corpus())
    assert set(bundled.DESCRIPTIONS) <= {f.rsplit("/", 1)[0] for f in bundled.files()} | set(bundled.files())
    with pytest.raises(FileNotFoundError, match="did you mean 'tasks/sms_spam/train.jsonl'"):
        bundled.path("tasks/sms_span/train.jsonl")
    with pytest.raises(FileNotFoundError):
        bundled.path("../pyproject.toml")
    assert main(["data", "bundled", "--copy", str(tmp_path / "data")]) == 0
    assert (tmp_path / "data" / "tasks" / "sms_spam" / "train.jsonl").read_bytes() == \
        bundled.path("tasks/sms_spam/train.jsonl").read_bytes()
    assert (tmp_path / "data" / "README.md").is_file()  # the licences travel with the data
    assert main(["data", "bundled"]) == 0
    assert "tasks/austen_ner" in capsys.readouterr().out


def test_data_bundled_lists_every_bundled_data_set(capsys):
    """Every corpus file and task folder has its line in `pretune data bundled` (issue 32: wordnet_pos, which the
    README tour finetunes on, was missing)."""
    shipped = {f"corpus/{p.name}" for p in bundled.corpus()} | {f"tasks/{t}" for t in bundled.tasks()}
    assert set(bundled.DESCRIPTIONS) == shipped
    assert main(["data", "bundled"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert sorted(listed) == sorted(shipped) and "tasks/wordnet_pos" in listed
