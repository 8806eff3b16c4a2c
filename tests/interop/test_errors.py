"""Bad Hugging Face folders give errors that name the file, key or tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import pretune
from pretune import CheckpointError, InteropError

transformers = pytest.importorskip("transformers")


@pytest.fixture
def gpt2_dir(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                              n_positions=16))
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_missing_config(tmp_path):
    with pytest.raises(InteropError, match="no config.json"):
        pretune.from_hf(tmp_path)


def test_unsupported_model_type(gpt2_dir):
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (gpt2_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="'mamba' is not supported"):
        pretune.from_hf(gpt2_dir)


def test_unsupported_option_is_named(gpt2_dir):
    cfg = json.loads((gpt2_dir / "config.json").read_text())
    cfg["scale_attn_by_inverse_layer_idx"] = True
    (gpt2_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="scale_attn_by_inverse_layer_idx"):
        pretune.from_hf(gpt2_dir)


def test_unknown_tensor_is_named_not_dropped(gpt2_dir):
    tensors = load_file(gpt2_dir / "model.safetensors")
    tensors["transformer.h.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, gpt2_dir / "model.safetensors")
    with pytest.raises(InteropError, match="transformer.h.0.mystery.weight|h.0.mystery.weight"):
        pretune.from_hf(gpt2_dir)


def test_missing_tensor_is_named(gpt2_dir):
    tensors = load_file(gpt2_dir / "model.safetensors")
    del tensors["transformer.ln_f.weight"]
    save_file(tensors, gpt2_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="transformer.decoder.norm.weight"):
        pretune.from_hf(gpt2_dir)


def test_wrong_shape_is_named(gpt2_dir):
    tensors = load_file(gpt2_dir / "model.safetensors")
    tensors["transformer.wpe.weight"] = torch.zeros(8, 16)
    save_file(tensors, gpt2_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"position.weight.*\(8, 16\).*\(16, 16\)"):
        pretune.from_hf(gpt2_dir)


def test_corrupt_weights_file_is_named(gpt2_dir):
    (gpt2_dir / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        pretune.from_hf(gpt2_dir)


def test_from_hf_casts_half_precision_checkpoints(gpt2_dir):
    tensors = {k: v.half() for k, v in load_file(gpt2_dir / "model.safetensors").items()}
    save_file(tensors, gpt2_dir / "model.safetensors")
    model = pretune.from_hf(gpt2_dir)
    assert model.transformer.embed.weight.dtype == torch.float32
    torch.testing.assert_close(model.transformer.embed.weight, tensors["transformer.wte.weight"].float())
    assert pretune.from_hf(gpt2_dir, dtype=torch.bfloat16).transformer.embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("cls,config", [("BertLMHeadModel", "BertConfig"), ("RobertaForCausalLM", "RobertaConfig")])
def test_causal_bert_and_roberta_are_refused_not_loaded_as_encoders(cls, config, tmp_path):
    """BertLMHeadModel / RobertaForCausalLM have the masked LM's tensors and is_decoder=true: loaded as pretune's
    bidirectional encoder they would silently attend to later tokens."""
    hf_cfg = getattr(transformers, config)(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32, is_decoder=True)
    getattr(transformers, cls)(hf_cfg).save_pretrained(tmp_path / "hf")
    with pytest.raises(InteropError, match=f"{cls} is not supported.*attend causally"):
        pretune.from_hf(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())  # is_decoder alone says it too
    cfg.pop("architectures")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="is_decoder=true"):
        pretune.from_hf(tmp_path / "hf")
