"""The pretune command: show, presets, convert in both directions, errors with exit code 2."""

import json

import pytest
import torch

import pretune
from pretune.cli import main


def test_show_preset_prints_parameter_counts(capsys):
    assert main(["show", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "decoder-only" in out and "124,439,808" in out


def test_show_json_and_checkpoint_folder(tmp_path, capsys):
    model = pretune.build_model("tiny-t5-small")
    pretune.save(model, tmp_path / "ck")
    assert main(["show", str(tmp_path / "ck"), "--json"]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out[out.index("{"):])
    assert payload["parameters"]["total"] == model.num_parameters()
    assert payload["config"]["arch"] == "encoder-decoder"


def test_show_prints_the_decoder_family_options(tmp_path, capsys):
    """A Gemma 2-style checkpoint: the window and its layers, the soft caps, the scaled embeddings, sandwich norms."""
    model = pretune.build_model("tiny-llama", norm="rmsnorm_plus_one", norm_placement="sandwich", ffn="geglu_tanh",
                                scale_embeddings=True, sliding_window=16, sliding_layers=[0], attn_softcap=50.0,
                                logit_softcap=30.0)
    pretune.save(model, tmp_path / "ck")
    assert main(["show", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    for text in ("sliding window 16 on layers 0", "scores soft-capped at 50", "logits soft-capped at 30",
                 "scaled by sqrt(dim)", "rmsnorm_plus_one (sandwich-norm"):
        assert text in out, text


def test_show_unknown_preset_suggests_nearest(capsys):
    assert main(["show", "gtp2"]) == 2
    assert "did you mean 'gpt2'" in capsys.readouterr().err


def test_presets_lists_names(capsys):
    assert main(["presets"]) == 0
    names = capsys.readouterr().out.split()
    assert {"bert-base", "t5-base", "llama", "modernbert-base", "tiny-electra-small"} <= set(names)


def test_convert_round_trip(tmp_path, capsys):
    pytest.importorskip("transformers")
    model = pretune.build_model("tiny-llama").eval()
    pretune.save(model, tmp_path / "ours")
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = pretune.load(tmp_path / "back")
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)


def test_convert_needs_exactly_one_direction(tmp_path, capsys):
    assert main(["convert", "--out", str(tmp_path / "x")]) == 2
    assert "exactly one of --from-hf DIR, --to-hf DIR, --from-gguf FILE or --to-gguf MODEL" in capsys.readouterr().err


def test_convert_of_a_config_without_hf_equivalent_is_a_clear_error(tmp_path, capsys):
    # a ModernBERT with an attention norm on layer 0: no transformers class has that
    pretune.save(pretune.build_model("tiny-modernbert-base", first_attn_norm=True), tmp_path / "mb")
    assert main(["convert", "--to-hf", str(tmp_path / "mb"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face equivalent" in err
    assert not (tmp_path / "hf").exists()


def test_finetune_print_config_shows_the_steps_the_run_takes(tmp_path, capsys):
    """``finetune --epochs 1 --print-config`` reads the data and prints the values the run will use, derived ones
    marked: steps = ceil(epochs x train examples // batch), warmup, evaluation interval, the method's learning rate."""
    import json

    import yaml

    from conftest import SHARED
    from pretune.realmodels import minilm_dir

    try:
        model = minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    train = tmp_path / "train.jsonl"
    rows = [json.loads(x) for x in open(f"{SHARED}/tasks/sms_spam/train.jsonl", encoding="utf-8")][:200]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["finetune", "--model", str(model), "--task", "classification", "--train", str(train),
                 "--epochs", "1", "--batch-size", "16", "--print-config"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    n_train = 200 - round(200 * 0.1)  # data.dev_fraction of train held out as dev
    assert cfg["train"]["steps"] == n_train // 16 and cfg["train"]["warmup_steps"] == int(0.1 * (n_train // 16))
    assert cfg["train"]["lr"] == 5e-5 and cfg["train"]["eval_every"] == n_train // 16
    assert f"steps: {n_train // 16}  # derived: tune.epochs=1 x {n_train // 16} steps per epoch" in out
    assert "lr: 5.0e-05  # derived: the default of full finetuning" in out
    assert main(["finetune", "--model", str(model), "--task", "classification", "--train", str(train),
                 "--epochs", "1", "--peft", "bitfit", "--print-config"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["train"]["lr"] == 1e-3 and cfg["tune"]["head_lr"] == 1e-2  # BitFit's rate; a PEFT run's head rate
    assert "head_lr: 0.01  # derived: the task head's default next to peft bitfit" in out
    assert cfg["train"]["save_every"] == cfg["train"]["eval_every"]  # a checkpoint at every dev evaluation
    assert main(["finetune", "--model", str(model), "--task", "classification", "--train", str(train),
                 "--epochs", "1", "--peft", "prompt", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 3e-2 and cfg["tune"]["head_lr"] == 0  # the head at the method's own, higher rate
    assert main(["finetune", "--model", str(model), "--task", "classification", "--train", str(train),
                 "--epochs", "1", "--freeze-body", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["train"]["lr"] == 1e-2 and cfg["tune"]["head_lr"] == 0  # a linear probe: the head is all that trains
    assert cfg["task"]["pooling"] == ""  # the model's own: MiniLM was trained with mean pooling
    from pretune import load

    assert load(model).config.pooling == "mean"
    assert not (tmp_path / "runs").exists()  # nothing written


def test_every_flag_is_a_config_key():
    """The flag tables: each flag's help names its key, and the flags given become exactly those keys."""
    from pretune.cli import build_parser
    from pretune.cli.flags import DISTILL_FLAGS, FINETUNE_FLAGS, PRETRAIN_FLAGS, config_layer

    parser = build_parser()
    for command, flags in (("pretrain", PRETRAIN_FLAGS), ("distill", DISTILL_FLAGS), ("finetune", FINETUNE_FLAGS)):
        sub = parser._subparsers._group_actions[0].choices[command]
        text = sub.format_help()
        for f in flags:
            assert f.flag in text and f"({f.key})" in " ".join(text.split())
    args = parser.parse_args(["finetune", "--lr", "0.01", "--peft", "lora", "--freeze-body", "--train", "t.jsonl"])
    assert config_layer(args, FINETUNE_FLAGS) == {"train": {"lr": 0.01}, "peft": {"method": "lora"},
                                                 "tune": {"freeze_body": True}, "data": {"train": "t.jsonl"}}
    args = parser.parse_args(["pretrain", "--data", "a.txt", "b.txt", "--steps", "5"])
    assert config_layer(args, PRETRAIN_FLAGS) == {"data": {"train": ["a.txt", "b.txt"]}, "train": {"steps": 5}}
    assert main(["finetune", "--model", "x", "--preset", "tiny-bert-base", "--print-config"]) == 2  # one or other


HELP_SCRIPT = """
import sys, contextlib, io
from pretune.cli import build_parser, main
parser = build_parser()
sub = next(a for a in parser._actions if a.dest == "command")
commands = [[c] for c in sub.choices]
for name, p in sub.choices.items():  # the nested ones: tokenizer train, peft merge, bench model, ...
    for a in p._actions:
        if getattr(a, "choices", None) and isinstance(a.choices, dict):
            commands += [[name, c] for c in a.choices]
for argv in [[]] + commands:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            assert e.code == 0, argv
heavy = ("torch.", "numpy", "transformers")
print(len(commands), sorted(m for m in sys.modules if m == "torch" or m.startswith(heavy)))
"""


def test_help_of_every_command_imports_no_torch():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", HELP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n, loaded = out.stdout.split(" ", 1)
    assert int(n) >= 20 and loaded.strip() == "[]", out.stdout


def test_the_cli_method_help_is_the_registrys():
    """The CLI lists the methods from pretune.catalog (importing the registry would import torch for --help)."""
    from pretune.catalog import PEFT_METHODS as cli_help
    from pretune.peft import METHOD_HELP

    assert cli_help == METHOD_HELP


def test_show_prints_a_decoder_sized_apart(tmp_path, capsys):
    """A BART checkpoint whose decoder has its own head count and FFN width shows both stacks' sizes."""
    model = pretune.build_model("tiny-bart-base", decoder_heads=2, decoder_ffn_dim=40)
    pretune.save(model, tmp_path / "ck")
    assert main(["show", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert f"; decoder 2 heads x {model.config.dim // 2}" in out and "; decoder inner 40" in out


def _leaf_commands(parser, path=()):
    """(argv prefix, parser) of every command that runs: pretune finetune, pretune tokenizer train, ..."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield list(path), parser
        return
    for name, p in subs[0].choices.items():
        yield from _leaf_commands(p, (*path, name))


def _typo(flag: str) -> str:
    """``--epochs`` -> ``--peochs``: two letters after the dashes swapped."""
    return flag[:2] + flag[3] + flag[2] + flag[4:]


def test_a_mistyped_flag_names_the_nearest_option_in_every_command(capsys):
    """Issue 32: `pretune finetune --epohcs 3` got a bare argparse error; every command names the nearest option."""
    from pretune.cli import build_parser

    commands = list(_leaf_commands(build_parser()))
    assert len(commands) >= 20
    for path, parser in commands:
        options = [o for o in parser._option_string_actions if o.startswith("--") and o != "--help"]
        flag = max(options, key=len) if options else "--help"  # `pretune presets` has no other
        argv = [*path, _typo(flag), "3"]
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, argv
        assert f"usage: {parser.prog}" in err and f"{parser.prog}: error:" in err, (argv, err)  # demo: quickstart
        assert f"did you mean {flag}" in err, (argv, err)


def test_a_mistyped_flag_with_a_required_argument_missing_names_both(capsys):
    with pytest.raises(SystemExit):
        main(["predict", "model", "data.jsonl", "--otu", "p.jsonl"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "pretune predict: error: the following arguments are required: --out (did you mean --out for --otu?)"
    with pytest.raises(SystemExit):
        main(["finetune", "--epohcs", "3"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "pretune finetune: error: unrecognized arguments: --epohcs (did you mean --epochs?)"


def test_evaluate_set_values_take_the_settings_types():
    """``--set chat=true`` used to reach the task as the text 'true' and be refused as not a boolean."""
    import argparse

    from pretune.cli.finetune import _task_overrides

    args = argparse.Namespace(task="sft", set=["chat=true", "task.max_target_len=4", "threshold=0.7",
                                               "prompt_template=Q: {text} true?", "text_field=1"])
    assert _task_overrides(args) == {"name": "sft", "chat": True, "max_target_len": 4, "threshold": 0.7,
                                     "prompt_template": "Q: {text} true?", "text_field": 1}
    from pretune.tasks import task_settings

    settings = task_settings({"name": "sft", "chat": True, "text_field": 1})
    assert settings.chat is True and settings.text_field == "1"  # a text setting keeps a number as its text
