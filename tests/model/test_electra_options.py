"""ELECTRA's model-core options: the replaced-token-detection head (``head="rtd"``: dense + head_act, one logit per
token, transformers' loss) and the classification head's activation (``cls_act``: tanh for RoBERTa, gelu for
ELECTRA). Defaults leave every other model unchanged."""

import pytest
import torch
import torch.nn.functional as F

from pretune import ConfigError, ModelConfig, build_model

V = 50


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="encoder", vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32, dropout=0.0,
                attn_dropout=0.0, head="rtd")
    return ModelConfig(**{**base, **kw})


def _perturbed(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _ids(B=3, T=9, seed=1):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_tanh"])
def test_rtd_head_is_one_logit_per_token_from_dense_and_head_act(act):
    model = _perturbed(build_model(_cfg(head_act=act, ffn=act)))
    ids = _ids()
    with torch.no_grad():
        out = model(ids)
        h = out.last_hidden_state
        fn = {"gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[act]
        want = model.head.out(fn(model.head.dense(h))).squeeze(-1)
    assert out.logits.shape == ids.shape  # (B, T)
    torch.testing.assert_close(out.logits, want)


def test_rtd_padding_does_not_leak_and_backward_reaches_every_parameter():
    model = _perturbed(build_model(_cfg(embed_dim=16)))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    other = ids.clone()
    other[1, 5:] = (other[1, 5:] + 7) % (V - 1) + 1  # change only the padding
    with torch.no_grad():
        a, b = model(ids, mask).logits, model(other, mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-6, rtol=1e-5)
    model.train()
    labels = torch.randint(0, 2, ids.shape)
    model(ids, mask, labels=labels).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_rtd_loss_is_binary_cross_entropy_over_the_real_tokens():
    model = _perturbed(build_model(_cfg()))
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[2, 3:] = 0
    labels = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, mask, labels=labels, return_logits=True)
    real = mask.bool()
    want = F.binary_cross_entropy_with_logits(out.logits[real], labels[real].float())
    torch.testing.assert_close(out.loss, want)
    with torch.no_grad():  # without a mask every token counts
        full = model(ids, labels=labels, return_logits=True)
    torch.testing.assert_close(full.loss, F.binary_cross_entropy_with_logits(full.logits, labels.float()))


@pytest.mark.parametrize("act", ["tanh", "gelu", "swish"])
def test_cls_act_is_the_activation_of_the_cls_classification_head(act):
    model = _perturbed(build_model(_cfg(head="classification", num_labels=3, cls_act=act)))
    ids = _ids()
    with torch.no_grad():
        out = model(ids)
        x = out.last_hidden_state[:, 0]
        fn = {"tanh": torch.tanh, "gelu": F.gelu, "swish": F.silu}[act]
        want = model.head.out(fn(model.head.dense(x)))
    torch.testing.assert_close(out.logits, want)


def test_cls_act_default_is_roberta_tanh_and_leaves_other_poolings_alone():
    assert ModelConfig().cls_act == "tanh"
    gelu = _perturbed(build_model(_cfg(head="classification", num_labels=2, pooling="mean", cls_act="gelu")))
    tanh = build_model(_cfg(head="classification", num_labels=2, pooling="mean"))
    tanh.load_state_dict(gelu.state_dict())
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(gelu(ids).logits, tanh.eval()(ids).logits, rtol=0, atol=0)  # no dense: no act


@pytest.mark.parametrize("bad,match", [
    (dict(arch="decoder"), "head='rtd'.*arch='encoder'"),
    (dict(head="classification", num_labels=2, cls_act="sigmoid"), "cls_act='sigmoid'"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**bad)
