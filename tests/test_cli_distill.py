"""``pretune distill`` end to end: a tiny teacher pretrained with ``pretune pretrain``, then distilled into a
half-depth student initialised from its layers 0, 2, ...; the run evaluates the hard MLM loss and the KL term, its
checkpoints hold no copy of the teacher, ``--resume`` reloads it; bad input is one clear line (exit 2)."""

import json

import pytest

from pretune.cli import main
from pretune.io.checkpoint import load

COMMON = ["--steps", "4", "--quiet", "train.batch_size=8", "data.block_size=32", "train.save_every=2",
          "train.eval_every=2", "train.tensorboard=false", "train.plot=false"]


@pytest.fixture(scope="module")
def teacher(small_corpus, tokenizers_by_kind, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["pretrain", "--preset", "tiny-bert-base", "model.n_layers=3", "--objective", "mlm", "--tokenizer",
                 str(tokenizers_by_kind["wordpiece"]), "--data", str(small_corpus), "--out", str(out),
                 *COMMON]) == 0
    return out / "model"


def test_distill_a_half_depth_student(teacher, small_corpus, tmp_path, capsys):
    out = tmp_path / "distil"
    args = ["distill", "--teacher", str(teacher), "--preset", "tiny-bert-base", "model.n_layers=2",
            "--init-from-teacher", "every_other", "--alpha-cos", "1.0", "--temperature", "3",
            "--data", str(small_corpus), "--out", str(out), *COMMON]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "student:" in printed and "kd_loss" in printed and "mlm_loss" in printed
    student = load(out / "model")
    assert student.config.n_layers == 2 and student.config.head == "mlm"
    assert (out / "model" / "tokenizer.json").is_file()  # the teacher's tokenizer, by default
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["split"] == "eval"]
    assert evals and all({"mlm_loss", "kd_loss", "cos_loss", "mlm_ppl"} <= set(r) for r in evals)
    ckpts = sorted((out / "checkpoints").iterdir())
    assert ckpts and not any((c / "objective.safetensors").exists() for c in ckpts)  # no copy of the teacher
    assert main(args + ["--resume"]) == 0  # the checkpoint loads with the teacher read again from its folder
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("extra,message", [
    ([], "no teacher: give --teacher FOLDER"),
    (["--teacher", "no/such/folder"], "no/such/folder"),
    (["--teacher", "TEACHER", "--init", "TEACHER", "--init-from-teacher", "every_other"],
     "init_from_teacher='every_other' initialises the student from the teacher, but model.init="),
    (["--teacher", "TEACHER", "--preset", "tiny-bert-base", "model.n_layers=3", "--init-from-teacher", "every_other"],
     "a student of 3 layers needs a teacher of at least 5"),
    (["--teacher", "TEACHER", "--preset", "tiny-gpt2"], "student has head='lm' and the teacher head='mlm'"),
    (["--teacher", "TEACHER", "--alpha-kl", "-1"], "objective.alpha_kl=-1.0 must be >= 0"),
])
def test_bad_input_is_one_line(extra, message, teacher, small_corpus, tmp_path, capsys):
    extra = [str(teacher) if a == "TEACHER" else a for a in extra]
    rc = main(["distill", *extra, "--data", str(small_corpus), "--out", str(tmp_path / "run"), *COMMON])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("pretune distill: ") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
