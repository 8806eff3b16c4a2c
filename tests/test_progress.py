"""Progress bars outside a terminal (issue 32): a log gets a few plain lines per bar, not a carriage-return redraw
every 0.1 s (a ``make demo`` log ran to megabytes); on a terminal the bar is tqdm's."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

import pretune.io.progress as P
from pretune.io.progress import LogBar, progress


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(P, "_now", c)
    return c


def _counts(text: str) -> list[int]:
    return [int(line.split("|")[2].split("/")[0]) for line in text.splitlines()]


def test_a_fast_bar_writes_its_first_and_last_line(clock):
    f = io.StringIO()
    bar = progress(total=10_000, desc="train", unit="step", file=f, dynamic_ncols=True)
    assert isinstance(bar, LogBar)
    for i in range(10_000):
        bar.update(1)
        bar.set_postfix(loss=f"{i:.4f}")  # refreshes at every step, as the training loop's bar does
    bar.close()
    out = f.getvalue()
    assert "\r" not in out and out.endswith("\n")
    assert _counts(out) == [0, 10_000] and "loss=9999.0000" in out


def test_at_most_a_line_per_5_percent_and_per_30_seconds(clock):
    f = io.StringIO()
    for _ in progress(range(1000), desc="x", file=f, mininterval=0):  # 1 s an item: 1000 s
        clock.t += 1.0
    counts = _counts(f.getvalue())
    assert counts[0] == 0 and counts[-1] == 1000 and len(counts) <= 22
    assert all(b - a >= 50 for a, b in zip(counts, counts[1:]))  # 5 % of 1000 (30 s: 30 items) between two
    f = io.StringIO()
    bar = progress(desc="y", file=f, mininterval=0)  # no total: a line per 30 s
    for _ in range(300):
        clock.t += 1.0
        bar.update(1)
    bar.close()
    assert 10 <= len(f.getvalue().splitlines()) <= 12


def test_tqdm_write_and_a_bar_that_does_not_stay(clock):
    f = io.StringIO()
    with progress(range(5), desc="eval", file=f, leave=False) as bar:
        for _ in bar:
            tqdm.write("a message", file=f)
    lines = f.getvalue().splitlines()
    assert "\r" not in f.getvalue() and lines.count("a message") == 5
    assert [line for line in lines if line.startswith("eval")][-1].split("|")[2].startswith(" 5/5")


def test_on_a_terminal_the_bar_is_tqdms():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = progress(range(3), file=Terminal())
    assert not isinstance(bar, LogBar) and isinstance(bar, tqdm)
    bar.close()


def test_a_pretraining_run_logs_a_few_lines(tmp_path, small_corpus, tokenizers_by_kind, capsys):
    """stderr captured by pytest is no terminal: the token store's and the training loop's bars, a few lines."""
    from pretune.jobs.pretrain import load_run_config, pretrain

    cfg = load_run_config(overrides=[
        "model.preset=tiny-bert-base", "objective.name=mlm", f"tokenizer={tokenizers_by_kind['wordpiece']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", f"data.store={tmp_path / 'store'}",
        "data.block_size=40", "model.max_seq_len=64", "train.steps=40", "train.batch_size=4", "train.eval_every=0",
        "train.save_every=0", "train.tensorboard=false", "train.plot=false"])
    pretrain(cfg, show_progress=True, log=lambda *_: None)
    err = capsys.readouterr().err
    train = [line for line in err.splitlines() if line.startswith("train")]
    assert "\r" not in err and len(err.splitlines()) <= 8, err
    assert _counts("\n".join(train)) == [0, 40]


def test_every_bar_goes_through_progress():
    """No module draws a tqdm bar of its own (``tqdm.write`` is fine): a new one would redraw into logs again."""
    import re
    from pathlib import Path

    src = Path(P.__file__).resolve().parents[1]
    direct = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py")) if p != Path(P.__file__).resolve()
              for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\btqdm\(", line)]
    assert not direct, f"tqdm bars outside pretune.io.progress (use progress(...)): {direct}"
