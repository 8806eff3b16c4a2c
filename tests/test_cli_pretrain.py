"""The pretraining commands of the ``pretune`` CLI: tokenizer train/encode, data clean/tokenize, pretrain
(artifacts, overrides, --print-config, --resume), and bad input as clear errors (exit code 2, stderr
naming the problem). Tiny models, a few steps, the shared real-text corpus."""

import json

import numpy as np
import pytest
import yaml

from pretune.cli import main
from pretune.data.store import TokenStore
from pretune.io.tokenization import Tokenizer

RUN_ARGS = ["--preset", "tiny-bert-base", "--objective", "mlm", "--steps", "6", "--quiet", "train.batch_size=8",
            "data.block_size=32", "train.save_every=3", "train.eval_every=3", "train.tensorboard=false"]


def _pretrain(tok, data, out, *extra):
    return main(["pretrain", "--tokenizer", str(tok), "--out", str(out), "--data", *map(str, data), *RUN_ARGS,
                 *extra])


def _error(capsys, rc: int) -> str:
    """stderr of a command that must fail cleanly: exit code 2, one message, no traceback."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("pretune ") and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# -- tokenizer, data -------------------------------------------------------------------------------------


def test_tokenizer_train_then_encode(small_corpus, tmp_path, capsys):
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", str(small_corpus), "--kind", "wordpiece", "--vocab-size", "500",
                 "--out", str(out), "--quiet"]) == 0
    assert "wordpiece tokenizer, 500 tokens" in capsys.readouterr().out
    assert Tokenizer.load(out).vocab_size == 500

    assert main(["tokenizer", "encode", str(out), "some text"]) == 0
    tokens, ids = capsys.readouterr().out.splitlines()
    assert tokens.replace(" ##", "").split() == ["some", "text"]  # WordPiece pieces of the two words
    assert [int(i) for i in ids.split()] == Tokenizer.load(out).encode("some text")


def test_data_clean_prints_the_rule_table_and_writes_text_and_report(small_corpus, tmp_path, capsys):
    out, report = tmp_path / "out.jsonl", tmp_path / "r.json"
    assert main(["data", "clean", str(small_corpus), "--out", str(out), "--report", str(report), "--quiet"]) == 0
    table = capsys.readouterr().out
    for rule in ("require_terminal_punct", "require_min_words", "require_min_sentences", "dedup"):
        assert f"- {rule}" in table
    rep = json.loads(report.read_text())
    kept = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert rep["pages_in"] == 950 and rep["pages_out"] == len(kept) > 0


def test_data_clean_no_switches_a_rule_off(tmp_path, capsys):
    long = "This sentence has plenty of words in it. Another sentence with enough words follows. A third one too."
    src = tmp_path / "pages.txt"
    src.write_text(f"{long}\nShort line here.\n{long.replace('This', 'That')}\n", encoding="utf-8")

    def clean(*extra):
        out, report = tmp_path / f"out{len(extra)}.jsonl", tmp_path / f"r{len(extra)}.json"
        assert main(["data", "clean", str(src), "--out", str(out), "--report", str(report), "--quiet",
                     "--no-unwrap", *extra]) == 0
        return json.loads(report.read_text()), out.read_text()

    rep, text = clean()
    assert rep["lines_removed"]["require_min_words"] == 1 and "Short line here." not in text  # 3 words < 5
    rep, text = clean("--no", "require_min_words")
    assert rep["lines_removed"]["require_min_words"] == 0 and "Short line here." in text
    capsys.readouterr()


def test_data_tokenize_writes_a_store(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    store = tmp_path / "store"
    assert main(["data", "tokenize", str(small_corpus), "--tokenizer", str(tokenizers_by_kind["wordpiece"]),
                 "--out", str(store), "--quiet"]) == 0
    assert "token store ->" in capsys.readouterr().out
    opened = TokenStore.open(store)
    assert opened.n_docs == 950
    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    first = np.asarray(opened.tokens[opened.sent_offsets[0]:opened.sent_offsets[1]]).tolist()
    assert tok.decode(first).split()[:3] == small_corpus.read_text().lower().split()[:3]


# -- pretrain ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(small_corpus, tokenizers_by_kind, tmp_path_factory):
    """One finished 6-step MLM run through the CLI (checkpoints at steps 3 and 6)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    tok = tokenizers_by_kind["wordpiece"]
    assert _pretrain(tok, [small_corpus], out, "--train.lr=1e-3") == 0
    return out, tok, small_corpus


def test_pretrain_writes_model_metrics_plot_and_checkpoints(run):
    out, _, _ = run
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / "model" / name).is_file()
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [3, 6]
    assert [r["step"] for r in rows if r["split"] == "train"] == [6]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    saved = yaml.safe_load((out / "run.yaml").read_text())
    assert saved["train"]["lr"] == 1e-3  # the --train.lr=1e-3 override
    assert saved["train"]["steps"] == 6 and saved["data"]["block_size"] == 32


def test_pretrain_again_into_the_same_folder_needs_resume(run, capsys):
    out, tok, corpus = run
    err = _error(capsys, _pretrain(tok, [corpus], out))
    assert str(out) in err and "--resume" in err


def test_resume_of_a_finished_run_exits_0_without_training(run, capsys):
    out, tok, corpus = run
    before = (out / "metrics.jsonl").read_text()
    assert _pretrain(tok, [corpus], out, "--train.lr=1e-3", "--resume") == 0
    printed = capsys.readouterr().out
    assert "resumed from step 6" in printed
    assert "precision: " in printed and ("auto; CPU" in printed or "as set" in printed)  # every run says it
    assert (out / "metrics.jsonl").read_text() == before  # nothing trained, nothing logged twice
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]


def test_print_config_prints_yaml_and_exits(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    out = tmp_path / "never"
    assert _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], out, "objective.rate=0.2", "--train.lr=2e-3",
                     "--print-config") == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"] == {"preset": "tiny-bert-base"} and cfg["objective"]["name"] == "mlm"
    assert cfg["train"]["lr"] == 2e-3 and cfg["train"]["steps"] == 6 and cfg["objective"]["rate"] == 0.2
    assert cfg["data"]["train"] == [str(small_corpus)]
    assert not out.exists()  # printing trains nothing


@pytest.mark.parametrize("order", ["after_data", "split_by_option"])
def test_overrides_anywhere_on_the_command_line(small_corpus, tokenizers_by_kind, capsys, order):
    tok, data = str(tokenizers_by_kind["wordpiece"]), str(small_corpus)
    argv = {  # after_data is `pretune pretrain --help`'s example: ... --data corpus/*.txt.gz train.steps=200
        "after_data": ["--tokenizer", tok, "--data", data, "train.steps=7"],
        "split_by_option": ["train.steps=7", "--tokenizer", tok, "--train.lr=2e-3", "train.eval_every=5", "--data",
                            data],
    }[order]
    assert main(["pretrain", *argv, "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7 and cfg["data"]["train"] == [data]


def test_command_line_beats_the_yaml_file(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    """preset -> YAML -> command line (STYLE.md): a flag beats the file, a section.key=value beats both."""
    conf = tmp_path / "run.yaml"
    conf.write_text("model: {preset: tiny-gpt2, n_layers: 3}\nobjective: {name: clm}\n"
                    "train: {out: runs/from-yaml, steps: 50, lr: 1e-4}\n")
    out = tmp_path / "from-flag"
    assert main(["pretrain", "--config", str(conf), "--tokenizer", str(tokenizers_by_kind["wordpiece"]),
                 "--data", str(small_corpus), "--out", str(out), "--steps", "9", "--preset", "tiny-bert-base",
                 "--objective", "mlm", "train.steps=11", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["out"] == str(out) and cfg["train"]["steps"] == 11 and cfg["train"]["lr"] == 1e-4
    assert cfg["model"] == {"preset": "tiny-bert-base", "n_layers": 3} and cfg["objective"]["name"] == "mlm"


# -- bad input: exit code 2 and a message naming the problem ---------------------------------------------


def test_empty_data_file(tokenizers_by_kind, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _error(capsys, _pretrain(tokenizers_by_kind["wordpiece"], [empty], tmp_path / "run"))
    assert str(empty) in err and "no documents" in err


@pytest.mark.parametrize("command", ["pretrain", "tokenize"])
def test_non_utf8_file_names_the_file_and_byte_offset(tokenizers_by_kind, tmp_path, capsys, command):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("A first paragraph.\n\nCaf\u00e9 in Latin-1.\n".encode("latin-1"))  # é = 0xe9 at byte 23
    tok = tokenizers_by_kind["wordpiece"]
    if command == "pretrain":
        rc = _pretrain(tok, [bad], tmp_path / "run")
    else:
        rc = main(["data", "tokenize", str(bad), "--tokenizer", str(tok), "--out", str(tmp_path / "st"), "--quiet"])
    err = _error(capsys, rc)
    assert f"{bad}:3" in err and "byte offset 23" in err and "UTF-8" in err


def test_jsonl_without_the_text_field(tokenizers_by_kind, tmp_path, capsys):
    data = tmp_path / "x.jsonl"
    data.write_text('{"body": "no text field here"}\n{"body": "nor here"}\n')
    err = _error(capsys, _pretrain(tokenizers_by_kind["wordpiece"], [data], tmp_path / "run"))
    assert str(data) in err and "'text'" in err and "'body'" in err


def test_tokenizer_vocab_too_small_for_the_specials(small_corpus, tmp_path, capsys):
    out = tmp_path / "tok.json"
    rc = main(["tokenizer", "train", str(small_corpus), "--kind", "wordpiece", "--vocab-size", "3", "--out",
               str(out), "--quiet"])
    err = _error(capsys, rc)
    assert "vocab_size (3) is too small" in err and "5 special tokens" in err
    assert not out.exists()


def test_block_size_above_the_models_max_positions(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    rc = _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], tmp_path / "run", "data.block_size=200")
    err = _error(capsys, rc)
    assert "data.block_size=200" in err and "max_seq_len is 128" in err and "at most 126" in err


def test_unknown_override_key_suggests_the_nearest(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    err = _error(capsys, _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], tmp_path / "run", "train.lrr=1"))
    assert "train.lrr" in err and "did you mean 'lr'" in err
    assert not (tmp_path / "run").exists()


def test_objective_the_architecture_cannot_serve(small_corpus, tokenizers_by_kind, tmp_path, capsys):
    rc = _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], tmp_path / "run", "--preset", "tiny-gpt2")
    err = _error(capsys, rc)
    assert "'mlm'" in err and "decoder-only" in err and "encoder" in err


def test_resume_for_more_steps_keeps_the_record_of_the_first_part(run, tmp_path, capsys):
    import shutil

    src, tok, corpus = run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    assert main(["pretrain", "--tokenizer", str(tok), "--out", str(out), "--data", str(corpus), *RUN_ARGS,
                 "--train.lr=1e-3", "--resume", "--steps", "8"]) == 0
    printed = capsys.readouterr().out
    assert "resume: train.steps: 6 -> 8 (the schedule is recomputed for the new length)" in printed
    assert yaml.safe_load((out / "run.until-step-00000006.yaml").read_text())["train"]["steps"] == 6
    assert yaml.safe_load((out / "run.yaml").read_text())["train"]["steps"] == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 8
    # --overwrite removes what the runs wrote, the kept config included, and nothing else
    (out / "notes.txt").write_text("mine")
    assert _pretrain(tok, [corpus], out, "--overwrite") == 0
    assert not (out / "run.until-step-00000006.yaml").exists() and (out / "notes.txt").read_text() == "mine"


def test_a_full_disk_during_a_checkpoint_is_one_message_and_keeps_the_earlier_checkpoint(small_corpus,
                                                                                          tokenizers_by_kind,
                                                                                          tmp_path, capsys,
                                                                                          monkeypatch):
    import torch

    save = torch.save

    import shutil

    usage = shutil.disk_usage

    def full_disk(obj, f, *a, **k):  # what torch's writer raises on a full disk
        if isinstance(obj, dict) and obj.get("step") == 6:
            monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=4096))
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0; "
                               "PytorchStreamWriter failed writing file data/0: file write failed")
        return save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    err = _error(capsys, _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], out))
    assert "no space left on the device" in err and "checkpoints/step-00000006" in err and "--resume" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]  # no temp folder, step 3 intact
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert _pretrain(tokenizers_by_kind["wordpiece"], [small_corpus], out, "--resume") == 0
    assert "resumed from step 3" in capsys.readouterr().out
