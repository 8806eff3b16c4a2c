"""ModelConfig validation: every bad key or value is a ConfigError naming it and what was expected."""

import json
import re

import pytest

import pretune
from pretune import ConfigError, ModelConfig


def test_unknown_key_names_it_and_suggests_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'n_layer'; did you mean 'n_layers'\?"):
        ModelConfig.from_dict({"n_layer": 2})
    with pytest.raises(ConfigError, match=r"'n_haeds'.*did you mean 'n_heads'"):
        ModelConfig().replace(n_haeds=4)
    with pytest.raises(ConfigError, match=r"'ffn_dims'.*did you mean 'ffn_dim'"):
        pretune.build_model("tiny-gpt2", ffn_dims=64)


def test_unknown_key_without_near_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"'zzzz'; valid keys: arch, vocab_size"):
        ModelConfig.from_dict({"zzzz": 1})


@pytest.mark.parametrize("field, value, suggestion", [
    ("position", "rotary", "rope"),
    ("norm", "rms_norm", "rmsnorm"),
    ("arch", "decoder-only", "decoder"),
    ("ffn", "swi_glu", "swiglu"),
])
def test_invalid_literal_names_value_and_suggests(field, value, suggestion):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{field: value})
    msg = str(e.value)
    assert f"{field}={value!r}" in msg
    assert f"did you mean {suggestion!r}" in msg


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match=r"dim='32' should be of type int"):
        ModelConfig(dim="32")
    with pytest.raises(ConfigError, match=r"bias=1 should be of type bool"):
        ModelConfig(bias=1)


def test_n_heads_must_divide_dim():
    with pytest.raises(ConfigError, match=r"n_heads \(5\) must divide dim \(32\)"):
        ModelConfig(dim=32, n_heads=5)
    assert ModelConfig(dim=32, n_heads=5, head_dim=8).dh == 8  # allowed with an explicit head_dim


def test_n_kv_heads_must_divide_n_heads():
    with pytest.raises(ConfigError, match=r"n_kv_heads \(3\) must divide n_heads \(4\)"):
        ModelConfig(dim=32, n_heads=4, n_kv_heads=3)
    assert ModelConfig(dim=32, n_heads=4, n_kv_heads=2).kv_heads == 2


@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_mlm_head_needs_encoder(arch):
    with pytest.raises(ConfigError, match=rf"head='mlm' needs arch='encoder' \(got '{arch}'\)"):
        ModelConfig(arch=arch, head="mlm")
    assert ModelConfig(arch=arch, head="lm").head == "lm"


@pytest.mark.parametrize("bad, match", [
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    (dict(n_layers=0), r"n_layers must be > 0, got 0"),
    (dict(position="rope", dim=36, n_heads=4), r"rope needs an even head_dim, got 9"),
    (dict(arch="decoder", head="lm", share_encoder_decoder=True), r"share_encoder_decoder applies to arch="),
    (dict(arch="encoder-decoder", head="lm", share_encoder_decoder=True, n_decoder_layers=3),
     r"share_encoder_decoder needs n_decoder_layers equal to n_layers"),
    (dict(arch="decoder", head="lm", decoder_heads=2), r"decoder_heads applies to arch='encoder-decoder' only"),
    (dict(arch="encoder", decoder_ffn_dim=64), r"decoder_ffn_dim applies to arch='encoder-decoder' only"),
    (dict(arch="encoder-decoder", head="lm", dim=32, n_heads=4, decoder_heads=5),
     r"decoder_heads \(5\) must divide dim \(32\) unless head_dim is set"),
    (dict(arch="encoder-decoder", head="lm", decoder_heads=-2), r"decoder_heads must be > 0 \(or None: the "
                                                                r"encoder's\), got -2"),
    (dict(arch="encoder-decoder", head="lm", decoder_ffn_dim=0), r"decoder_ffn_dim must be > 0"),
    (dict(arch="encoder-decoder", head="lm", dim=32, n_heads=4, n_kv_heads=2, head_dim=8, decoder_heads=3),
     r"n_kv_heads \(2\) must divide decoder_heads \(3\)"),
    (dict(arch="encoder-decoder", head="lm", share_encoder_decoder=True, n_heads=4, dim=32, decoder_heads=2),
     r"share_encoder_decoder needs the decoder's heads and FFN width equal to the encoder's, got decoder_heads=2"),
    (dict(arch="encoder-decoder", head="lm", position="rope", dim=48, n_heads=4, decoder_heads=16),
     r"the decoder \(decoder_heads=16, decoder_ffn_dim=None\): rope needs an even head_dim, got 3"),
])
def test_cross_field_constraints(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**bad)


def test_json_round_trip(tmp_path):
    cfg = ModelConfig(arch="encoder-decoder", head="lm", dim=32, n_heads=4, n_kv_heads=2, n_decoder_layers=3,
                      position="relative", ffn="swiglu", norm="rmsnorm", attn_scale=1.0, embed_dim=16)
    path = tmp_path / "config.json"
    cfg.save(path)
    data = json.loads(path.read_text())
    assert data["pretune_version"] == 1 and data["n_decoder_layers"] == 3
    assert ModelConfig.load(path) == cfg
    assert ModelConfig.load(path) != cfg.replace(n_decoder_layers=2)


def test_load_names_file_and_unknown_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"dim": 32, "n_heads": 4, "tie_embedding": False}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert str(path) in str(e.value)
    assert "'tie_embedding'" in str(e.value) and "did you mean 'tie_embeddings'" in str(e.value)


def test_load_names_file_for_bad_value_and_bad_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"norm": "batchnorm"}))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: norm='batchnorm' is not one of"):
        ModelConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: not valid JSON \(line 1"):
        ModelConfig.load(path)


def test_derived_values_are_not_stored():
    cfg = ModelConfig(dim=32, n_heads=4, n_layers=3)
    assert (cfg.dh, cfg.kv_heads, cfg.decoder_layers, cfg.embedding_dim) == (8, 4, 3, 32)
    assert not {"dh", "kv_heads", "decoder_layers", "embedding_dim", "final_norm"} & set(cfg.to_dict())


def test_decoder_config_is_the_decoders_own_heads_and_ffn_width():
    """decoder_heads / decoder_ffn_dim (BART's decoder_attention_heads / decoder_ffn_dim): the decoder stack is
    built from decoder_config, the config with those as n_heads / ffn_dim; None keeps the encoder's."""
    cfg = ModelConfig(arch="encoder-decoder", head="lm", dim=32, n_heads=4, ffn_dim=64, decoder_heads=2,
                      decoder_ffn_dim=96)
    dec = cfg.decoder_config
    assert (dec.n_heads, dec.dh, dec.kv_heads, dec.ffn_dim) == (2, 16, 2, 96)
    assert (dec.decoder_heads, dec.decoder_ffn_dim, cfg.n_heads, cfg.dh, cfg.ffn_dim) == (None, None, 4, 8, 64)
    assert dec.replace(n_heads=4, ffn_dim=64) == cfg.replace(decoder_heads=None, decoder_ffn_dim=None)
    same = cfg.replace(decoder_heads=None, decoder_ffn_dim=None)
    assert same.decoder_config is same
    assert cfg.replace(decoder_ffn_dim=None).decoder_config.ffn_dim == 64
    assert "decoder_config" not in cfg.to_dict() and cfg.to_dict()["decoder_heads"] == 2
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_constructor_with_unknown_keyword_suggests_the_nearest_key():
    with pytest.raises(ConfigError, match=r"'n_layer'.*did you mean 'n_layers'"):
        ModelConfig(n_layer=2)


def test_position_offset_without_learned_positions_is_rejected():
    with pytest.raises(ConfigError, match="position_offset"):
        ModelConfig(position="rope", position_offset=2)


def test_text_settings_on_the_command_line_stay_text():
    """"Question: {q}" would be a YAML mapping to OmegaConf's dot-list parser; a str setting keeps it as written."""
    from pretune.jobs.finetune import load_finetune_config

    sft = load_finetune_config(None, ["task.name=sft", "task.prompt_template=Question: {q} Answer:"])
    cfg = load_finetune_config(None, ["task.name=choice", "task.prefix='sst2: '", "task.max_len=64",
                                      "task.labels=[a, b]", "train.lr=1e-3"])  # (each task has its own settings)
    assert sft.task.prompt_template == "Question: {q} Answer:" and cfg.task.prefix == "sst2: "
    assert cfg.task.max_len == 64 and cfg.task.labels == ["a", "b"] and cfg.train.lr == 1e-3
