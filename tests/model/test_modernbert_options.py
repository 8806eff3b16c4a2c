"""ModernBERT's model-core options by their properties: a separate RoPE base for the sliding-window layers
(``rope_local_base``), no norm on layer 0's attention input (``first_attn_norm=False``), the task-head transform
dense + head_act + norm (``head_transform``) and a bias-free dense layer in the MLM head / transform
(``head_dense_bias=False``). Every option is off by default, so no other model changes."""

from __future__ import annotations

import pytest
import torch
from decoder_fixtures import V, ids, perturbed
from torch import nn

from pretune import ConfigError, ModelConfig, build_model, count_parameters
from pretune.model.heads import HeadTransform, MLMHead, SequenceHead, TokenHead


def tiny(**kw) -> ModelConfig:
    """A ModernBERT-shaped encoder: pre-norm, GeGLU, no biases, RoPE, layer 1 local within |i - j| < 3."""
    base = dict(arch="encoder", head="mlm", vocab_size=V, dim=32, n_layers=3, n_heads=4, ffn_dim=24, max_seq_len=64,
                dropout=0.0, attn_dropout=0.0, position="rope", rope_base=500.0, norm="layernorm", norm_eps=1e-5,
                norm_placement="pre", ffn="geglu", bias=False, norm_bias=False, embed_norm=True, token_types=0,
                sliding_window=3, sliding_layers=[1])
    return ModelConfig(**{**base, **kw})


def _logits(model, x, **kw):
    with torch.no_grad():
        return model(x, **kw).logits


def test_the_options_default_to_off():
    cfg = ModelConfig()
    assert (cfg.rope_local_base, cfg.first_attn_norm, cfg.head_transform, cfg.head_dense_bias) == (None, True, False,
                                                                                                    True)


# --- rope_local_base ---------------------------------------------------------------------------------
def test_local_base_equal_to_the_global_one_changes_nothing():
    plain = perturbed(tiny())
    same = build_model(tiny(rope_local_base=500.0)).eval()
    same.load_state_dict(plain.state_dict())
    x = ids(2, 12)
    assert torch.equal(_logits(plain, x), _logits(same, x))


def test_local_layers_rotate_with_the_local_base():
    """Every layer local, the window wider than the rows: the same model as rope_base = the local base."""
    local = perturbed(tiny(sliding_layers=None, sliding_window=40, rope_local_base=77.0))
    plain = build_model(tiny(sliding_layers=None, sliding_window=40, rope_base=77.0)).eval()
    plain.load_state_dict(local.state_dict())
    x = ids(2, 12)
    torch.testing.assert_close(_logits(local, x), _logits(plain, x), atol=0, rtol=0)


def test_each_base_reaches_its_own_layers():
    """Layers 1 and 2 local, layer 0 global: changing either base changes the outputs."""
    model = perturbed(tiny(sliding_layers=[1, 2], rope_local_base=77.0))
    other = build_model(tiny(sliding_layers=[1, 2], rope_local_base=7.0)).eval()
    other.load_state_dict(model.state_dict())
    x = ids(2, 12)
    assert (_logits(model, x) - _logits(other, x)).abs().max() > 1e-4  # the local base matters ...
    glob = build_model(tiny(sliding_layers=[1, 2], rope_base=50.0, rope_local_base=77.0)).eval()
    glob.load_state_dict(model.state_dict())
    assert (_logits(model, x) - _logits(glob, x)).abs().max() > 1e-4  # ... and so does the global one (layer 0)


def test_rope_outputs_depend_on_relative_positions_only_with_two_bases():
    model = perturbed(tiny(rope_local_base=37.0))
    x = ids(2, 12)
    shifted = _logits(model, x, position_ids=torch.arange(12) + 7)
    torch.testing.assert_close(shifted, _logits(model, x), atol=1e-4, rtol=1e-4)


def test_padding_does_not_leak_with_local_layers_and_two_bases():
    """Right-padded rows longer than the window: what the padding holds never reaches a real token."""
    model = perturbed(tiny(rope_local_base=37.0, first_attn_norm=False, head_dense_bias=False))
    x, mask = ids(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    other = x.clone()
    other[1, 7:] = (other[1, 7:] + 5) % V
    a, b = _logits(model, x, attention_mask=mask), _logits(model, other, attention_mask=mask)
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1, :7], _logits(model, x[1:, :7])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(rope_local_base=10.0, sliding_window=None, sliding_layers=None), "with a sliding_window"),
    (dict(rope_local_base=10.0, position="learned"), "position='rope'"),
    (dict(rope_local_base=0.0), "rope_local_base must be > 0"),
    (dict(first_attn_norm=False, norm_placement="post"), "first_attn_norm=False applies to norm_placement='pre'"),
    (dict(first_attn_norm=False, share_layers=True), "cannot be combined with share_layers"),
])
def test_bad_values_name_the_option(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**bad)


# --- first_attn_norm ---------------------------------------------------------------------------------
def test_layer_0_reads_the_embedding_norm_output_as_it_is():
    cfg = tiny(first_attn_norm=False)
    model = perturbed(cfg)
    enc = model.transformer.encoder
    assert isinstance(enc.layers[0].attn_norm, nn.Identity)
    assert all(isinstance(b.attn_norm, nn.LayerNorm) for b in enc.layers[1:])
    assert count_parameters(build_model(tiny()))["total"] - count_parameters(model)["total"] == cfg.dim  # no bias
    seen = {}
    hooks = [layer.attn.register_forward_hook(lambda m, a, kw, out, i=i: seen.setdefault(i, a[0]), with_kwargs=True)
             for i, layer in enumerate(enc.layers)]
    x = ids(2, 10)
    with torch.no_grad():
        model(x)
        first = enc.embed_norm(model.transformer.embed(x))
    for h in hooks:
        h.remove()
    assert torch.equal(seen[0], first)  # layer 0: the embedding norm's output itself
    plain = build_model(tiny()).eval()
    plain.load_state_dict({**model.state_dict(), **{k: v for k, v in plain.state_dict().items()
                                                    if k.endswith("layers.0.attn_norm.weight")}})
    assert (_logits(plain, x) - _logits(model, x)).abs().max() > 1e-4  # a norm there would change the outputs


# --- head_transform / head_dense_bias ----------------------------------------------------------------
def test_mlm_head_dense_without_bias():
    head = build_model(tiny(head_dense_bias=False)).head
    assert isinstance(head, MLMHead) and head.dense.bias is None and head.bias is not None  # the decoder keeps its own
    assert build_model(tiny()).head.dense.bias is not None


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sequence_head_transforms_the_pooled_vector(pooling):
    cfg = tiny(head="classification", num_labels=3, head_transform=True, pooling=pooling, head_act="gelu_tanh",
               head_dense_bias=False)
    model = perturbed(cfg)
    head = model.head
    assert isinstance(head, SequenceHead) and isinstance(head.transform, HeadTransform) and head.dense is None
    assert head.transform.dense.bias is None
    x, mask = ids(2, 9), torch.ones(2, 9, dtype=torch.long)
    mask[1, 5:] = 0
    with torch.no_grad():
        out = model(x, attention_mask=mask)
        h = out.last_hidden_state
        m = mask[..., None].float()
        v = h[:, 0] if pooling == "cls" else (h * m).sum(1) / m.sum(1)
        t = head.transform
        want = head.out(t.norm(nn.functional.gelu(t.dense(v), approximate="tanh")))
    torch.testing.assert_close(out.logits, want)


@pytest.mark.parametrize("kind", ["tagging", "qa"])
def test_token_heads_transform_each_token(kind):
    model = perturbed(tiny(head=kind, num_labels=5 if kind == "tagging" else 2, head_transform=True))
    head = model.head
    assert isinstance(head, TokenHead) and head.transform is not None
    x = ids(2, 9)
    with torch.no_grad():
        out = model(x)
        t = head.transform
        want = head.out(t.norm(nn.functional.gelu(t.dense(out.last_hidden_state))))
    torch.testing.assert_close(out.logits, want)


def test_without_head_transform_the_task_heads_are_bert_s():
    assert build_model(tiny(head="tagging", num_labels=3)).head.transform is None
    seq = build_model(tiny(head="classification", num_labels=3)).head
    assert seq.transform is None and seq.dense is not None  # cls: RoBERTa's dense + tanh


def test_config_round_trips_through_json(tmp_path):
    cfg = tiny(rope_local_base=37.0, first_attn_norm=False, head_transform=True, head_dense_bias=False)
    cfg.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == cfg
