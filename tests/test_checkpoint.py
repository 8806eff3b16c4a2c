"""Checkpoint folders: exact round trips (shared tensors stay shared), atomic writes, strict loads
whose errors name the file, the tensor and what was expected."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import pretune
import pretune.io.checkpoint
from pretune import CheckpointError, ConfigError, ModelConfig


def _perturbed(model, seed=0):
    """Fresh norms are 1 and biases 0: perturb everything so a tensor that is not restored shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _model(name="tiny-gpt2", seed=0, **overrides):
    torch.manual_seed(seed)
    return _perturbed(pretune.build_model(name, dropout=0.0, attn_dropout=0.0, **overrides), seed)


def _outputs(model):
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(decoder_input_ids=ids[:, :4]) if model.config.arch == "encoder-decoder" else {}
    with torch.no_grad():
        return model(ids, **kw).logits


CASES = {
    "bert": ("tiny-bert-base", {}),
    "gpt2-tied": ("tiny-gpt2", {}),
    "gpt2-untied": ("tiny-gpt2", dict(tie_embeddings=False)),
    "t5-tied-scaled": ("tiny-t5-small", {}),
    "t5-shared-enc-dec": ("tiny-t5-small", dict(share_encoder_decoder=True)),
    "llama-gqa": ("tiny-llama", {}),
    "electra-factorised": ("tiny-electra-small", {"head": "mlm"}),  # the generator: factorised, tied MLM head
    "electra-discriminator": ("tiny-electra-small", {}),  # the replaced-token-detection head
    "albert-shared-layers": ("tiny-bert-base", dict(embed_dim=16, share_layers=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_exact(tmp_path, case):
    name, overrides = CASES[case]
    model = _model(name, **overrides)
    pretune.save(model, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".pretune.json", "config.json",
                                                                       "model.safetensors"]
    loaded = pretune.load(tmp_path / "ckpt")
    assert not loaded.training
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    assert torch.equal(_outputs(loaded), _outputs(model))
    # shared tensors are stored once and shared again after loading
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    t = loaded.transformer
    if loaded.config.head == "rtd":
        assert "head.out.weight" in stored
    elif loaded.config.tie_embeddings:
        assert loaded.head.weight is t.embed.weight
        assert "head.weight" not in stored
    else:
        assert loaded.head.weight is not t.embed.weight
        assert "head.weight" in stored
    if loaded.config.share_encoder_decoder:
        for e, d in zip(t.encoder.layers, t.decoder.layers, strict=True):
            assert d.attn is e.attn and d.ffn is e.ffn
        assert not any(k.startswith("transformer.decoder.layers.0.attn.") for k in stored)
    assert len(stored) == len({id(p) for p in loaded.parameters()})  # each parameter once; no buffer is persistent


def test_load_dtype(tmp_path):
    model = _model()
    pretune.save(model, tmp_path / "ckpt")
    loaded = pretune.load(tmp_path / "ckpt", dtype=torch.float64)
    assert loaded.transformer.embed.weight.dtype == torch.float64
    assert loaded.head.weight is loaded.transformer.embed.weight


def test_save_copies_tokenizer(tmp_path):
    tok = tmp_path / "tok.json"
    tok.write_text('{"version": "1.0"}')
    pretune.save(_model(), tmp_path / "ckpt", tokenizer=tok)
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == '{"version": "1.0"}'


# --- atomic writes -----------------------------------------------------------------------------
def _fail(*args, **kwargs):
    raise OSError("disk full (simulated)")


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _model(seed=0)
    path = tmp_path / "ckpt"
    pretune.save(old, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    new = _model(seed=1, n_layers=3)
    monkeypatch.setattr(pretune.io.checkpoint, "save_file", _fail)
    with pytest.raises(OSError, match="disk full"):
        pretune.save(new, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left behind
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert torch.equal(_outputs(pretune.load(path)), _outputs(old))


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(pretune.io.checkpoint, "save_file", _fail)
    with pytest.raises(OSError):
        pretune.save(_model(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_existing_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    pretune.save(_model(seed=0), path)
    new = _model(seed=1, n_layers=3)
    pretune.save(new, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the old copy is removed
    loaded = pretune.load(path)
    assert loaded.config.n_layers == 3
    assert torch.equal(_outputs(loaded), _outputs(new))


# --- strict loading ----------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    pretune.save(_model("tiny-llama"), path)
    return path


def _rewrite(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


def test_missing_tensor_is_named(ckpt):
    name = "transformer.decoder.layers.1.ffn.gate_proj.weight"
    file = _rewrite(ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}: missing tensor '{re.escape(name)}'$"):
        pretune.load(ckpt)


def test_several_missing_tensors_are_counted(ckpt):
    _rewrite(ckpt, lambda t: [t.pop(k) for k in list(t) if "layers.1." in k])
    with pytest.raises(CheckpointError, match=r"missing tensor 'transformer\.decoder\.layers\.1\..*' \(and \d+ more\)"):
        pretune.load(ckpt)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    name = "transformer.decoder.layers.0.attn.k_proj.weight"  # GQA: (2 kv heads * 8, 32)

    def edit(t):
        t[name] = torch.zeros(32, 32)

    file = _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        pretune.load(ckpt)
    msg = str(e.value)
    assert str(file) in msg and repr(name) in msg
    assert "(32, 32)" in msg and "(16, 32)" in msg


def test_unexpected_tensor_is_named(ckpt):
    def edit(t):
        t["transformer.decoder.layers.2.attn.q_proj.weight"] = torch.zeros(32, 32)

    _rewrite(ckpt, edit)
    name = "transformer.decoder.layers.2.attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"unexpected tensor '{re.escape(name)}' not in the model"):
        pretune.load(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_weights_file_is_named(ckpt, damage):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00not safetensors" * 10,
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}: not a readable safetensors file"):
        pretune.load(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weights file not found"):
        pretune.load(ckpt)


def test_unknown_config_key_is_named(ckpt):
    cfg_file = ckpt / "config.json"
    data = json.loads(cfg_file.read_text())
    data["n_kv_head"] = 2
    cfg_file.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        pretune.load(ckpt)
    assert str(cfg_file) in str(e.value)
    assert "'n_kv_head'" in str(e.value) and "did you mean 'n_kv_heads'" in str(e.value)


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing config\.json"):
        pretune.load(ckpt)


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        pretune.load(tmp_path / "nowhere")


def test_config_from_another_model_is_a_shape_error(ckpt):
    ModelConfig.load(ckpt / "config.json").replace(dim=64).save(ckpt / "config.json")
    with pytest.raises(CheckpointError, match=r"has shape \(\d+, 32\), the model expects \(\d+, 64\)"):
        pretune.load(ckpt)


def test_load_holds_the_weights_once_the_files_tensors_become_the_parameters(tmp_path, monkeypatch):
    """A model is built with its parameters on the meta device and takes the tensors read from the file as they are:
    no random copy beside them (the old way: build, initialise, copy in; twice the model's memory at the peak)."""
    model = _model("tiny-llama")
    pretune.save(model, tmp_path / "ckpt")
    read = {}
    real = pretune.io.checkpoint.read_weights

    def spy(file):
        read.update(real(file))
        return read

    monkeypatch.setattr(pretune.io.checkpoint, "read_weights", spy)
    inits = []
    monkeypatch.setattr(pretune.model.TransformerLM, "_init_weights", staticmethod(lambda m: inits.append(m)))
    loaded = pretune.load(tmp_path / "ckpt")
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    for name, p in loaded.named_parameters():
        assert p.data_ptr() == read[name].data_ptr(), name  # the file's tensor itself
    assert loaded.head.weight is loaded.transformer.embed.weight  # still tied
    assert torch.equal(_outputs(loaded), _outputs(model))
    # the tensors were read into memory, not mapped: writing to a parameter changes neither the file nor a second load
    with torch.no_grad():
        loaded.transformer.embed.weight.add_(1.0)
    again = pretune.load(tmp_path / "ckpt")
    assert torch.equal(again.transformer.embed.weight, model.transformer.embed.weight)


def test_load_state_adopts_meta_parameters_and_never_ties_by_accident():
    from pretune.io.checkpoint import empty_parameters, load_state

    with empty_parameters():
        model = pretune.build_model("tiny-gpt2", tie_embeddings=False)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # buffers are computed, so they stay real
    assert not torch.nn.Linear(2, 2).weight.is_meta  # only inside the context
    state = {k: torch.randn(v.shape) for k, v in pretune.io.checkpoint.unique_state(model).items()}
    state["head.weight"] = state["transformer.embed.weight"]  # one tensor under two keys
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    load_state(model, state, source="test")
    assert model.head.weight is not model.transformer.embed.weight
    assert model.head.weight.data_ptr() != model.transformer.embed.weight.data_ptr()  # a copy: no accidental tie
    assert torch.equal(model.head.weight, model.transformer.embed.weight)
    assert {k: p.requires_grad for k, p in model.named_parameters()} == grads
    with torch.no_grad():
        model.transformer.embed.weight.add_(1.0)
    assert not torch.equal(model.head.weight, model.transformer.embed.weight)


def test_empty_parameters_restores_module_construction_after_an_error():
    from pretune.io.checkpoint import empty_parameters

    normal = torch.nn.init.normal_
    with pytest.raises(RuntimeError), empty_parameters():
        torch.nn.Linear(2, 2)
        real = torch.zeros(50)
        assert torch.nn.init.normal_(real) is real and real.std() > 0.5  # initialisers still work on real tensors
        raise RuntimeError("boom")
    assert not torch.nn.Linear(2, 2).weight.is_meta
    assert torch.nn.init.normal_ is normal
