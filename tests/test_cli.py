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


def test_show_unknown_preset_suggests_nearest(capsys):
    assert main(["show", "gtp2"]) == 2
    assert "did you mean 'gpt2'" in capsys.readouterr().err


def test_presets_lists_names(capsys):
    assert main(["presets"]) == 0
    names = capsys.readouterr().out.split()
    assert {"bert-base", "t5-base", "llama", "modernbert", "tiny-electra-small"} <= set(names)


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


def test_convert_needs_exactly_one_direction(tmp_path):
    with pytest.raises(SystemExit):
        main(["convert", "--out", str(tmp_path / "x")])


def test_convert_of_a_config_without_hf_equivalent_is_a_clear_error(tmp_path, capsys):
    pretune.save(pretune.build_model("tiny-modernbert"), tmp_path / "mb")
    assert main(["convert", "--to-hf", str(tmp_path / "mb"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "no Hugging Face equivalent" in err
    assert not (tmp_path / "hf").exists()
