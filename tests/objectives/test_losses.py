"""LM losses: the fused linear + cross-entropy equals the plain computation; our losses equal
transformers' own losses on imported models."""

import pytest
import torch
import torch.nn.functional as F

import pretune
from pretune.model.fast.fused_ce import fused_linear_cross_entropy
from pretune.objectives import causal_lm_loss, masked_lm_loss


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_fused_linear_cross_entropy_matches_reference(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(150, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (150,), generator=g)
    t[::5] = -100
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    gh, gw = torch.autograd.grad(ref * 3, (h, w))
    out = fused_linear_cross_entropy(h, w, t, chunk=chunk)
    fh, fw = torch.autograd.grad(out * 3, (h, w))  # a non-unit upstream gradient
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(fh, gh)
    torch.testing.assert_close(fw, gw)


@pytest.mark.parametrize("frozen", ["weight", "hidden", "both"])
def test_fused_linear_cross_entropy_with_a_frozen_input(frozen):
    """A frozen output embedding (PEFT) gets no gradient and the hidden states' gradient is unchanged;
    under no_grad (evaluation) only the loss is computed."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(30, 8, generator=g, requires_grad=frozen != "hidden" and frozen != "both")
    w = torch.randn(20, 8, generator=g, requires_grad=frozen == "hidden")
    t = torch.randint(0, 20, (30,), generator=g)
    ref = F.cross_entropy(h @ w.t(), t)
    out = fused_linear_cross_entropy(h, w, t, chunk=7)
    torch.testing.assert_close(out, ref)
    if frozen == "both":
        assert not out.requires_grad
        return
    free = w if frozen == "hidden" else h
    (got,) = torch.autograd.grad(out * 2, free)
    (want,) = torch.autograd.grad(ref * 2, free)
    torch.testing.assert_close(got, want)


def test_fused_linear_cross_entropy_under_bf16_autocast_is_close():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 32, generator=g)
    w = torch.randn(50, 32, generator=g)
    t = torch.randint(0, 50, (64,), generator=g)
    ref = F.cross_entropy(h @ w.t(), t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(h, w, t)
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) < 0.05


transformers = pytest.importorskip("transformers")


def test_causal_lm_loss_equals_transformers_gpt2_loss(tmp_path):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4,
                                                              n_positions=32)).eval()
    hf.save_pretrained(tmp_path)
    ours = pretune.from_hf(tmp_path)
    ids = torch.randint(0, 60, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = causal_lm_loss(ours, ids, attention_mask=mask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_masked_lm_loss_equals_transformers_bert_loss(tmp_path):
    hf = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4, intermediate_size=48)).eval()
    hf.save_pretrained(tmp_path)
    ours = pretune.from_hf(tmp_path)
    ids = torch.randint(0, 60, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, [1, 4]] = ids[0, [1, 4]]
    labels[1, 7] = ids[1, 7]
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=labels).loss
        got = masked_lm_loss(ours, ids, labels)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_fused_linear_cross_entropy_with_no_valid_target_is_zero_with_zero_grads():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    out = fused_linear_cross_entropy(h, w, torch.full((4,), -100))
    out.backward()
    assert out.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0
    empty = fused_linear_cross_entropy(torch.randn(0, 8, requires_grad=True), w, torch.zeros(0, dtype=torch.long))
    assert empty.item() == 0.0


def test_a_frozen_head_is_cast_once_under_autocast_and_an_update_is_seen():
    from pretune.model.fast.fused_ce import _cast_frozen

    w = torch.randn(50, 8)
    h = torch.randn(6, 8, requires_grad=True)
    t = torch.randint(0, 50, (6,))
    first = _cast_frozen(w, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and _cast_frozen(w, torch.bfloat16) is first
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = fused_linear_cross_entropy(h, w, t)
    w.mul_(2.0)  # an in-place update: the cached copy is stale
    assert _cast_frozen(w, torch.bfloat16) is not first
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = fused_linear_cross_entropy(h, w, t)
    ref = torch.nn.functional.cross_entropy((h.bfloat16() @ w.bfloat16().t()).float(), t)
    assert b.item() == pytest.approx(ref.item(), rel=1e-3) and a.item() != b.item()
    trained = torch.randn(50, 8, requires_grad=True)
    assert _cast_frozen(trained, torch.bfloat16) is not _cast_frozen(trained, torch.bfloat16)  # autograd needs it


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_fused_cross_entropy_gradients_follow_the_upstream_gradient(scale):
    """The fused loss hands its forward-computed gradients over as they are when the upstream gradient is 1
    (loss.backward()) and scales them otherwise; both equal F.cross_entropy's over the built logits. Several chunks
    (the weight gradient accumulated in place) and ignored rows."""

    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (10,), generator=g)
    t[3] = -100
    got = torch.autograd.grad(fused_linear_cross_entropy(h, w, t, chunk=4) * scale, (h, w))
    want = torch.autograd.grad(F.cross_entropy(h @ w.t(), t) * scale, (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
