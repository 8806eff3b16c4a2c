"""bench_finetune: the parent path on a tiny slice of sms_spam (one process per side), the table, the checks."""

import json
from pathlib import Path

import pytest

from pretune.bench import finetune as bf

SMS = Path(__file__).resolve().parents[3] / "shared" / "data" / "tasks" / "sms_spam"


@pytest.fixture(scope="module")
def minilm():
    from pretune.realmodels import minilm_dir

    try:
        return minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """sms_spam with 100 train records (both labels among the first 32) and 16 dev / 16 test records."""
    if not SMS.is_dir():
        pytest.skip(f"{SMS} is missing")
    d = tmp_path_factory.mktemp("sms_tiny")
    for split, n in (("train", 100), ("dev", 16), ("test", 16)):
        lines = (SMS / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:n]
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    labels = {json.loads(x)["label"] for x in (d / "train.jsonl").read_text().splitlines()[:32]}
    assert len(labels) == 2
    return d


def test_bench_finetune_tiny(tiny_data, minilm, tmp_path):
    """--limit 32, batch 16, one round: both sides train 2 steps in their own process and score the test file."""
    lines = []
    rows = bf.bench_finetune(data=tiny_data, model=minilm, rounds=1, limit=32, batch=16, max_len=32, threads=1,
                             show_progress=False, echo=lines.append)
    assert len(rows) == 1 and len(lines) == 2
    row = rows[0]
    assert row["bench"] == "finetune" and row["dtype"] == "fp32"
    assert row["n_train"] == 32 and row["steps"] == 2 and row["warmup_steps"] == 0 and row["threads"] == 1
    for impl in bf.IMPLS:
        runs = row[f"{impl}_runs"]
        assert len(runs) == 1
        assert runs[0]["seconds"] > 0 and runs[0]["peak_rss_mb"] > 0
        assert 0 <= runs[0]["test_accuracy"] <= 1 and 0 <= runs[0]["dev_accuracy"] <= 1
        assert row[f"{impl}_seconds"] == runs[0]["seconds"]
        assert row[f"{impl}_accuracy"] == runs[0]["test_accuracy"]
        assert round(row[f"{impl}_accuracy"] * 16) == pytest.approx(row[f"{impl}_accuracy"] * 16)  # of 16 records
    assert row["ratio"] == pytest.approx(row["transformers_seconds"] / row["pretune_seconds"])
    assert row["accuracy_points"] == pytest.approx(100 * (row["pretune_accuracy"] - row["transformers_accuracy"]))
    assert row["target_met"] == (row["ratio"] >= 1.3 and abs(row["accuracy_points"]) <= 0.5)
    text = bf.format_rows(rows)
    assert "median" in text and "target" in text and "32 train records" in text
    json.dumps(rows)  # --json writes them as they are


def _row(ratio_ours=1.0, acc=(0.98, 0.98)):
    runs = lambda s, a: [{"seconds": s, "test_accuracy": a, "dev_accuracy": a, "peak_rss_mb": 900.0}]  # noqa: E731
    return {"bench": "finetune", "dtype": "fp32", "model": "/x/all-MiniLM-L6-v2", "data": "/x/sms_spam", "limit": 0,
            "n_train": 3627, "epochs": 1.0, "batch": 32, "lr": 5e-5, "warmup_ratio": 0.1, "weight_decay": 0.01,
            "max_len": 128, "seed": 0, "rounds": 1, "steps": 113, "warmup_steps": 11, "threads": 2,
            "pretune_runs": runs(100.0, acc[0]), "transformers_runs": runs(100.0 * ratio_ours, acc[1]),
            "pretune_seconds": 100.0, "transformers_seconds": 100.0 * ratio_ours,
            "pretune_accuracy": acc[0], "transformers_accuracy": acc[1], "ratio": ratio_ours,
            "accuracy_points": 100 * (acc[0] - acc[1]),
            "target_met": ratio_ours >= 1.3 and abs(100 * (acc[0] - acc[1])) <= 0.5}


def test_format_rows():
    text = bf.format_rows([_row(1.45, (0.9824, 0.9802))])
    assert "113 steps of 32" in text and "warmup 11 steps" in text and "2 threads" in text
    assert "1.45" in text and "+0.22" in text and ": met" in text
    assert "NOT met" in bf.format_rows([_row(1.2)])
    assert "NOT met" in bf.format_rows([_row(1.5, (0.97, 0.98))])


def test_arguments_are_checked(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="one batch"):
        bf.bench_finetune(data=tiny_data, model="unused", limit=8, batch=16)
    with pytest.raises(FileNotFoundError, match="--data"):
        bf.bench_finetune(data=tmp_path / "nowhere", model="unused")
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": "x"}\n')
    with pytest.raises(FileNotFoundError, match="no dev file"):
        bf.bench_finetune(data=tmp_path, model="unused")


def test_cli_flags():
    from pretune.cli import build_parser

    args = build_parser().parse_args(["bench", "finetune", "--limit", "64", "--rounds", "1", "--dtypes", "fp32",
                                      "bf16", "--json", "out.json"])
    assert (args.limit, args.rounds, args.dtypes, args.json, args.batch, args.epochs) == (64, 1, ["fp32", "bf16"],
                                                                                          "out.json", 32, 1.0)
    assert Path(args.data) == bf.DEFAULT_DATA and args.func is bf.run_cli
    assert (bf.DEFAULT_DATA / "train.jsonl").is_file()  # the bundled copy, wherever the package is installed
