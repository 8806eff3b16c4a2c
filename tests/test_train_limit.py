"""data.train_limit: finetuning on a seeded random subsample of the training records. The same N and seed give
the same records, a larger N a superset of a smaller one (nested, so learning curves compare), 0 all of them;
the dev split does not depend on N; --print-config shows it."""

from __future__ import annotations

import json

import pytest

from pretune.bundled import path as bundled
from pretune.cli import main
from pretune.config import ConfigError
from pretune.data.records import read_records
from pretune.jobs.finetune import load_finetune_config, prepare, subsample

TRAIN = str(bundled("tasks/sms_spam/dev.jsonl"))  # 453 real records


def _lines(records) -> list[int]:
    return [int(r.row.rsplit(":", 1)[1]) for r in records]


def test_subsamples_are_seeded_nested_and_keep_file_order():
    recs = read_records(TRAIN)
    rows = {n: _lines(subsample(recs, n, seed=3)) for n in (10, 50, 200)}
    assert [len(v) for v in rows.values()] == [10, 50, 200]
    assert rows[10] == _lines(subsample(recs, 10, seed=3))  # the same N and seed: the same records
    assert set(rows[10]) < set(rows[50]) < set(rows[200])  # nested
    assert all(v == sorted(v) for v in rows.values())  # file order
    assert rows[50] != _lines(subsample(recs, 50, seed=4))  # another seed, another sample
    assert subsample(recs, 0, seed=3) == recs and subsample(recs, 10_000, seed=3) == recs


def _cfg(tmp_path, tokenizers_by_kind, *extra):
    return load_finetune_config(None, ["model.preset=tiny-bert-base", f"tokenizer={tokenizers_by_kind['wordpiece']}",
                                       "task.name=classification", f"data.train={TRAIN}", "task.max_len=32",
                                       f"train.out={tmp_path / 'run'}", *extra])


def test_prepare_trains_on_the_subsample_and_keeps_the_dev_split(tmp_path, tokenizers_by_kind):
    quiet = dict(show_progress=False, log=lambda *a: None)
    full = prepare(_cfg(tmp_path, tokenizers_by_kind), **quiet)
    lines: list[str] = []
    job = prepare(_cfg(tmp_path, tokenizers_by_kind, "data.train_limit=60"), show_progress=False, log=lines.append)
    assert len(job.records["train"]) == 60 and len(full.records["train"]) == 453 - 45
    assert {r.row for r in job.records["train"]} <= {r.row for r in full.records["train"]}
    assert [r.row for r in job.records["dev"]] == [r.row for r in full.records["dev"]]  # dev: the same 10% of all
    # the derived batch and length follow the subsample: 60 examples take batches of 8 (7 a epoch) and 20 epochs
    assert (job.cfg.train.batch_size, job.cfg.tune.epochs, job.cfg.train.steps) == (8, 20.0, 20 * (60 // 8))
    assert (full.cfg.train.batch_size, full.cfg.tune.epochs, full.cfg.train.steps) == (8, 5.0, 5 * (408 // 8))
    assert "data.train_limit: training on 60 of the 408 training records (drawn with train.seed=0)" in lines
    other = prepare(_cfg(tmp_path, tokenizers_by_kind, "data.train_limit=60", "train.seed=1"), **quiet)
    assert {r.row for r in other.records["train"]} != {r.row for r in job.records["train"]}


def test_print_config_shows_the_limit(tmp_path, tokenizers_by_kind, capsys):
    assert main(["finetune", "--preset", "tiny-bert-base", "--tokenizer", str(tokenizers_by_kind["wordpiece"]),
                 "--task", "classification", "--train", TRAIN, "--out", str(tmp_path / "run"), "--print-config",
                 "data.train_limit=100"]) == 0
    out = capsys.readouterr().out
    assert "train_limit: 100  # derived: 100 of the 408 training records, drawn with train.seed=0" in out


def test_a_negative_limit_is_refused(tmp_path, tokenizers_by_kind):
    with pytest.raises(ConfigError, match=r"data.train_limit=-1: expected a number of training records >= 0"):
        _cfg(tmp_path, tokenizers_by_kind, "data.train_limit=-1")


def test_a_resumed_run_keeps_its_limit(tmp_path, tokenizers_by_kind):
    from pretune.io.outputs import prepare_run_folder

    cfg = _cfg(tmp_path, tokenizers_by_kind, "data.train_limit=60")
    prepare_run_folder(tmp_path / "run", cfg.to_dict(), resume=False, overwrite=False, log=lambda *a: None)
    (tmp_path / "run" / "run.yaml").write_text(json.dumps(cfg.to_dict()))
    other = _cfg(tmp_path, tokenizers_by_kind, "data.train_limit=120")
    with pytest.raises(ConfigError, match=r"data.train_limit: 60 -> 120"):
        prepare_run_folder(tmp_path / "run", other.to_dict(), resume=True, overwrite=False, log=lambda *a: None)
