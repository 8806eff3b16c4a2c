"""MetricsLogger (JSONL + TensorBoard), resume truncation, loss plots, durations."""

import json
import sys

import pytest
import torch

from pretune.train import logging as tlog
from pretune.train.logging import MetricsLogger, format_duration, plot_losses, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log_train(logger, steps):
    for s in steps:
        logger.log(s, "train", loss=5.0 / (1 + s), lr=1e-3, tokens_per_s=1000.0)


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path / "run") as log:
        log.log(1, "train", loss=2.5, lr=torch.tensor(1e-3), tokens_per_s=123)
        log.log(2, "eval", loss=2.25, perplexity=9.4877)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "split": "train", "loss": 2.5, "lr": pytest.approx(1e-3), "tokens_per_s": 123},
        {"step": 2, "split": "eval", "loss": 2.25, "perplexity": 9.4877},
    ]
    assert read_metrics(tmp_path / "run") == read_metrics(tmp_path / "run" / "metrics.jsonl")
    (event_file,) = (tmp_path / "run" / "tb").glob("events.out.tfevents.*")
    assert event_file.stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = {"train/loss", "train/lr", "train/tokens_per_s", "eval/loss", "eval/perplexity"}
    assert tags <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(2, 2.25)]


def test_append_drops_records_after_resume_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        _log_train(log, range(0, 60, 10))
        log.log(20, "eval", loss=1.0)
        log.log(40, "eval", loss=0.9)
    with MetricsLogger(tmp_path, tensorboard=False, append=True, resume_step=20) as log:  # checkpoint at 20
        assert [(r["step"], r["split"]) for r in read_metrics(tmp_path)] == [(0, "train"), (10, "train"),
                                                                             (20, "train"), (20, "eval")]
        _log_train(log, [30])
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 10, 20, 20, 30]
    with MetricsLogger(tmp_path, tensorboard=False, append=True) as log:  # no resume_step: keep everything
        _log_train(log, [40])
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 10, 20, 20, 30, 40]
    MetricsLogger(tmp_path, tensorboard=False, resume_step=0).close()  # a fresh run empties the file (step ignored)
    assert read_metrics(tmp_path) == []


def test_append_with_tensorboard_purges_and_fresh_run_clears_events(tmp_path):
    with MetricsLogger(tmp_path) as log:
        _log_train(log, [1, 2, 3])
    with MetricsLogger(tmp_path, append=True, resume_step=2) as log:
        _log_train(log, [3])
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]  # the old step 3 was purged
    MetricsLogger(tmp_path).close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_disabled_logger_is_a_no_op(tmp_path):
    log = MetricsLogger(tmp_path / "rank1", enabled=False)
    log.log(0, "train", loss=1.0)
    log.close()
    assert not (tmp_path / "rank1").exists()


def test_missing_tensorboard_warns_once_and_keeps_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    monkeypatch.setattr(tlog, "_warned_no_tensorboard", False)
    with pytest.warns(UserWarning, match="TensorBoard unavailable"):
        first = MetricsLogger(tmp_path / "a")
    first.log(0, "train", loss=1.0)
    first.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MetricsLogger(tmp_path / "b").close()  # second logger: no second warning
    assert read_metrics(tmp_path / "a") == [{"step": 0, "split": "train", "loss": 1.0}]
    assert not (tmp_path / "a" / "tb").exists()


def test_log_rejects_bad_input(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match=r"step \(-1\)"):
        log.log(-1, "train", loss=1.0)
    with pytest.raises(ValueError, match="split"):
        log.log(0, "", loss=1.0)
    with pytest.raises(TypeError, match="'loss' must be a number, got str"):
        log.log(0, "train", loss="low")
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.log(0, "train", loss=1.0)
    with pytest.raises(ValueError, match=r"resume_step \(-2\)"):
        MetricsLogger(tmp_path, append=True, resume_step=-2)


def test_read_metrics_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 2.0}\n\n{"step": 2, "spl')
    with pytest.warns(UserWarning, match="metrics.jsonl:3"):
        assert read_metrics(path) == [{"step": 1, "split": "train", "loss": 2.0}]


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []  # temp file renamed away


def test_plot_train_only(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        _log_train(log, range(0, 300, 3))  # > 10 points: smoothed line too
    out = plot_losses(tmp_path / "metrics.jsonl", tmp_path / "plots" / "loss.png", title="train only")
    assert out == tmp_path / "plots" / "loss.png"
    _assert_png(out)


def test_plot_train_and_eval_with_perplexity_and_accuracy(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        _log_train(log, range(0, 50))
        for s in (10, 20, 30, 40):
            log.log(s, "eval", loss=2.0 - s / 100, mlm_ppl=7.0 - s / 20, mlm_acc=0.3 + s / 200)
    _assert_png(plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png"))


def test_second_panel_picks_perplexity_then_masked_accuracy():
    def eval_rec(**kw):
        return [{"step": 1, "split": "train", "loss": 1.0, "train_acc": 0.1}, {"step": 1, "split": "eval", **kw}]

    assert tlog._second_panel_key(eval_rec(loss=1.0, mlm_acc=0.5, mlm_ppl=2.7)) == "mlm_ppl"
    assert tlog._second_panel_key(eval_rec(loss=1.0, perplexity=2.7)) == "perplexity"
    assert tlog._second_panel_key(eval_rec(loss=1.0, rtd_acc=0.9, mlm_acc=0.5)) == "mlm_acc"
    assert tlog._second_panel_key(eval_rec(loss=1.0, accuracy=0.5)) == "accuracy"
    assert tlog._second_panel_key(eval_rec(loss=1.0, lm_loss=1.0)) is None  # train-only keys are not looked at


@pytest.mark.parametrize(
    "lines",
    [
        ['{"step": 0, "split": "train", "loss": 3.0}'],  # one point, no lr
        ['{"step": 5, "split": "eval", "loss": 3.0, "mlm_accuracy": 0.4}'],  # eval only
        [],  # nothing logged yet
    ],
)
def test_plot_degenerate_inputs(tmp_path, lines):
    (tmp_path / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    _assert_png(plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png"))


@pytest.mark.parametrize(
    "seconds, want",
    [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (3723, "1h02m"), (2 * 86400 + 3 * 3600 + 59, "2d03h"),
     (-1, "?"), (float("nan"), "?"), (float("inf"), "?")],
)
def test_format_duration(seconds, want):
    assert format_duration(seconds) == want
