"""Finetuning settings chosen from the data (jobs/finetune/defaults.py): the batch size and epochs from the number of
training examples, said in the run's first lines and marked in run.yaml; whatever the user sets wins."""

import json

import pytest

from pretune.cli import main
from pretune.config import ConfigError
from pretune.jobs.finetune import defaults as d
from pretune.jobs.finetune import finetune, load_finetune_config, prepare


@pytest.mark.parametrize("n, batch, epochs", [(40, 8, 20), (100, 8, 20), (300, 8, 7), (499, 8, 5), (500, 16, 9),
                                              (1000, 16, 5), (1999, 16, 3), (2000, 32, 5), (3000, 32, 3),
                                              (20000, 32, 3)])
def test_the_rule_gives_small_data_small_batches_and_at_least_min_steps(n, batch, epochs):
    c = d.choose(n, batch_size=0, epochs="auto", steps=0)
    assert (c.batch_size, c.epochs) == (batch, epochs)
    steps = epochs * (n // batch)
    assert steps >= d.MIN_STEPS or epochs == d.MAX_EPOCHS  # enough updates, or the most epochs
    assert epochs == d.MIN_EPOCHS or (epochs - 1) * (n // batch) < d.MIN_STEPS  # and no epoch more than needed
    assert set(c.why) == {"train.batch_size", "tune.epochs"}


def test_what_the_user_sets_is_not_chosen():
    assert d.choose(300, batch_size=32, epochs="auto", steps=0).batch_size is None
    assert d.choose(300, batch_size=32, epochs="auto", steps=0).epochs == 20  # 9 steps an epoch of the user's 32
    assert d.choose(300, batch_size=0, epochs=2.0, steps=0).epochs is None
    assert d.choose(300, batch_size=0, epochs="auto", steps=50).epochs is None  # train.steps decides the length
    assert d.choose(300, batch_size=0, epochs="auto", steps=0, grad_accum=3).batch_size == 6  # divisible by 3
    assert d.choose(5, batch_size=0, epochs="auto", steps=0).batch_size == 5  # never more than the data
    assert d.choose(300, batch_size=16, epochs=3.0, steps=0).line(300, steps=54) == ""


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("defaults")
    words = ["river", "stone", "cloud", "field", "light", "storm", "night", "green", "quiet", "bright"]
    rows = [{"text": f"{words[i % 10]} {words[(3 * i) % 10]} {words[(7 * i + 1) % 10]}", "label": "ab"[i % 2]}
            for i in range(140)]
    return {"train": _write(root / "train.jsonl", rows[:120]), "dev": _write(root / "dev.jsonl", rows[120:])}


def _cfg(tokenizers_by_kind, data, out, *extra):
    return load_finetune_config(None, ["model.preset=tiny-bert-base", f"tokenizer={tokenizers_by_kind['wordpiece']}",
                                       "task.name=classification", f"data.train={data['train']}",
                                       f"data.dev={data['dev']}", f"train.out={out}", "task.max_len=16",
                                       "train.plot=false", *extra])


def test_prepare_chooses_batch_and_epochs_and_says_why(tokenizers_by_kind, data, tmp_path):
    said = []
    job = prepare(_cfg(tokenizers_by_kind, data, tmp_path / "run"), show_progress=False, log=said.append)
    tr, tune = job.cfg.train, job.cfg.tune
    assert (tr.batch_size, tune.epochs, tr.steps) == (8, 17.0, 17 * 15)  # 120 examples: 15 steps an epoch
    assert tr.warmup_steps == 25 and tr.lr == 5e-5
    line = next(x for x in said if x.startswith("defaults for 120 training examples:"))
    assert "batch 8" in line and "17 epochs = 255 optimizer steps" in line and "lr 5e-05 (full finetuning's)" in line
    assert "warmup 25 steps (10%)" in line and "--batch-size, --epochs and --lr" in line
    assert job.cfg.derived["train.batch_size"].startswith("chosen for 120 training examples")
    assert job.cfg.derived["tune.epochs"].startswith("chosen: at least 250 optimizer steps")
    text = job.cfg.to_yaml()
    assert "  batch_size: 8  # derived: chosen for 120 training examples" in text
    assert "  epochs: 17.0  # derived: chosen: at least 250" in text


@pytest.mark.parametrize("extra, want", [
    (("train.batch_size=30",), (30, 20.0, 80)),  # the user's batch: epochs chosen for it (4 steps an epoch)
    (("tune.epochs=2",), (8, 2.0, 30)),  # the user's epochs: the batch chosen
    (("train.steps=40",), (8, 0.0, 40)),  # the user's length in steps: no epochs
    (("train.batch_size=12", "tune.epochs=3"), (12, 3.0, 30)),
])
def test_what_the_user_sets_wins(tokenizers_by_kind, data, tmp_path, extra, want):
    said = []
    job = prepare(_cfg(tokenizers_by_kind, data, tmp_path / "run", *extra), show_progress=False, log=said.append)
    assert (job.cfg.train.batch_size, job.cfg.tune.epochs, job.cfg.train.steps) == want
    line = [x for x in said if x.startswith("defaults for")]
    if len(extra) == 2:
        assert line == [] and "train.batch_size" not in job.cfg.derived and "tune.epochs" not in job.cfg.derived
    else:
        assert len(line) == 1 and ("batch 8" in line[0]) == ("train.batch_size=30" not in extra)


def test_a_run_records_the_choice_in_run_yaml_and_resumes_longer(tokenizers_by_kind, data, tmp_path):
    said = []
    cfg = _cfg(tokenizers_by_kind, data, tmp_path / "run", "data.train_limit=40", "train.lr=1e-3")
    res = finetune(cfg, show_progress=False, log=said.append)
    first = said.index(next(x for x in said if x.startswith("pretune finetune:")))
    assert any(x.startswith("defaults for 40 training examples: batch 8 (") and "20 epochs = 100 optimizer steps" in x
               for x in said[:first])  # before the run's first line
    assert "100 steps of 8 (20 epochs)" in said[first]
    assert res.steps == 100
    stored = (res.run_dir / "run.yaml").read_text()
    assert "batch_size: 8  # derived: chosen for 40" in stored and "epochs: 20.0  # derived: chosen" in stored
    assert "# derived" in (res.model_dir / "run.yaml").read_text()
    longer = finetune(_cfg(tokenizers_by_kind, data, tmp_path / "run", "data.train_limit=40", "train.lr=1e-3",
                           "tune.epochs=22"), resume=True, show_progress=False, log=lambda *a: None)
    assert longer.steps == 110  # the chosen batch kept, the user's longer run on top


def test_epochs_auto_on_the_command_line_and_bad_values(tokenizers_by_kind, data, tmp_path, capsys):
    common = ["finetune", "--preset", "tiny-bert-base", "--tokenizer", str(tokenizers_by_kind["wordpiece"]),
              "--task", "classification", "--train", str(data["train"]), "--dev", str(data["dev"]), "--print-config",
              "task.max_len=16"]
    assert main([*common, "--epochs", "auto"]) == 0
    assert "epochs: 17.0  # derived: chosen" in capsys.readouterr().out
    assert main([*common, "tune.epochs=4"]) == 0  # a number given as an override is a number
    out = capsys.readouterr().out
    assert "  epochs: 4.0\n" in out and "steps: 60  # derived: tune.epochs=4 x 15" in out
    with pytest.raises(ConfigError, match=r"tune.epochs='many': expected a number or 'auto'"):
        load_finetune_config(None, ["tune.epochs=many"])
    with pytest.raises(ConfigError, match=r"tune.epochs=0 trains for train.steps"):
        load_finetune_config(None, ["tune.epochs=0"])
    with pytest.raises(SystemExit):
        main([*common, "--epochs", "lots"])
    assert "argument --epochs: expected a number or auto, got 'lots'" in capsys.readouterr().err
