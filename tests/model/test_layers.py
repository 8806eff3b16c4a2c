"""Dropout (the cheaper keep mask) and the dropout attention path."""

import pytest
import torch
import torch.nn.functional as F

from pretune import ModelConfig
from pretune.model.attention import Attention
from pretune.model.layers import Dropout, dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_and_scale(p):
    x = torch.ones(400_000)
    y = dropout(x, p, training=True)
    kept = y != 0
    # 400k Bernoulli draws: the kept fraction is within 5 standard deviations of 1 - p
    sd = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sd
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    assert abs(y.mean().item() - 1.0) < 0.02  # inverted dropout keeps the expectation


def test_dropout_is_identity_in_eval_and_at_zero():
    x = torch.randn(100)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    m = Dropout(0.3).eval()
    assert m(x) is x


def test_dropout_mask_is_seeded_and_not_constant_across_calls():
    x = torch.ones(1000)
    torch.manual_seed(3)
    a, b = dropout(x, 0.5, True), dropout(x, 0.5, True)
    torch.manual_seed(3)
    a2 = dropout(x, 0.5, True)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


def test_dropout_words_are_independent_of_position():
    """The keep mask uses the four 15-bit words of each 64-bit draw (the high one has a clear sign bit):
    no word position is biased, at p = 0.5 and at a small p."""
    for p in (0.5, 0.1):
        y = dropout(torch.ones(4 * 200_000), p, True).view(-1, 4)
        rates = (y == 0).float().mean(0)
        assert torch.all((rates - p).abs() < 0.005), (p, rates)


def test_dropout_gradient_uses_the_same_mask():
    x = torch.randn(1000, requires_grad=True)
    y = dropout(x, 0.4, True)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y != 0).float() / 0.6)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_dropout_path_equals_sdpa_without_drops(kv_heads, causal):
    """With a dropout rate so small nothing is dropped, the training path is SDPA's maths."""
    cfg = ModelConfig(arch="decoder", dim=32, n_heads=4, n_kv_heads=kv_heads, ffn_dim=64, vocab_size=50,
                      head="lm", token_types=0, attn_dropout=1e-9)
    attn = Attention(cfg)
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 1, 7, 7)
    mask[1, ..., 5:] = torch.finfo(torch.float32).min
    for m in ([None, mask] if causal else [mask]):  # causal alone, causal + padding, padding alone
        train = attn.train()(x, is_causal=causal, mask=m)
        ref = attn.eval()(x, is_causal=causal, mask=m)
        torch.testing.assert_close(train, ref, atol=1e-6, rtol=1e-5)


def test_attention_dropout_drops_probabilities_at_the_rate_and_rescales():
    """With p = 0.5 the training path's output is (keep * softmax) @ v / (1 - p) for the keep mask drawn
    from torch's generator: re-drawing the same mask reproduces the output exactly."""
    from pretune.model.layers import _keep_mask

    cfg = ModelConfig(arch="decoder", dim=32, n_heads=4, ffn_dim=64, vocab_size=50, head="lm", attn_dropout=0.5)
    attn = Attention(cfg).train()
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    torch.manual_seed(3)
    out = attn._attend_eager(q, k, v, None, True)
    torch.manual_seed(3)
    keep = _keep_mask(torch.Size((2, 4, 6, 6)), 0.5, q.device)
    causal = torch.ones(6, 6, dtype=torch.bool).triu_(1)
    probs = ((q @ k.transpose(-1, -2)) * 8 ** -0.5).masked_fill(causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (probs * keep) @ v / 0.5)
    assert 0.4 < keep.float().mean() < 0.6


def test_attention_dropout_actually_drops():
    cfg = ModelConfig(arch="encoder", dim=32, n_heads=4, ffn_dim=64, vocab_size=50, attn_dropout=0.5)
    attn = Attention(cfg).train()
    x = torch.randn(2, 7, 32)
    torch.manual_seed(0)
    a = attn(x)
    torch.manual_seed(1)
    b = attn(x)
    assert (a - b).abs().max() > 1e-3
    ref = F.scaled_dot_product_attention  # noqa: F841 - the eval path stays SDPA
    assert torch.equal(attn.eval()(x), attn.eval()(x))


@pytest.mark.parametrize("position", ["relative", "alibi", "rope"])
def test_attention_dropout_path_gradients_equal_sdpa_without_drops(position):
    """The training path adds masks and learned position biases in place; with nothing dropped its gradients
    (T5's relative bias table included) equal the SDPA path's."""
    import pretune

    torch.manual_seed(0)
    model = pretune.build_model("tiny-t5-small" if position == "relative" else "tiny-llama", dropout=0.0,
                                attn_dropout=1e-9, position=position)
    ids = torch.randint(5, 100, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    kw = {"decoder_input_ids": ids[:, :7]} if position == "relative" else {}
    grads = []
    for train in (True, False):
        model.train(train)
        model.zero_grad()
        out = model(ids, mask, **kw).logits
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    if position == "relative":
        assert any("relative" in n or "bias" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_fused_frozen_linears_under_autocast_equal_separate_layers_and_cache_the_cast():
    """Frozen weights fused under bf16 autocast give exactly what each nn.Linear gives (its own cast per call), and
    the stacked weight is cached in bf16 (one cast, not one per step); a weight update is seen."""
    from torch import nn

    from pretune.model.layers import FusedLinears

    torch.manual_seed(0)
    layers = [nn.Linear(16, n) for n in (16, 8, 8)]
    for layer in layers:
        layer.requires_grad_(False)
    fused, x = FusedLinears(), torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused(x, layers)
        want = [layer(x) for layer in layers]
        assert fused._cache[1].dtype == torch.bfloat16
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16 and torch.equal(g, w)
        cached = fused._cache[1]
        fused(x, layers)
        assert fused._cache[1] is cached  # reused
        with torch.no_grad():
            layers[0].weight.mul_(2.0)
        assert torch.equal(fused(x, layers)[0], layers[0](x))
    assert fused(x, layers)[0].dtype == torch.float32  # outside autocast: the fp32 stack again


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 17, 64)], ids=["one-token", "batch"])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_kernel_equals_the_composite_bitwise_forward_and_backward(shape, weight):
    """RMSNorm runs torch's fused kernel where torch has it (layers.rms_norm); it must give F.rms_norm's values and
    gradients exactly, so that models and parity are unchanged."""
    from pretune.model.layers import _rms_norm_composite, rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, requires_grad=True) if weight else None
    grad = torch.randn(shape, generator=g)
    outs = []
    for fn in (rms_norm, _rms_norm_composite):
        y = fn(x, (shape[-1],), w, 1e-6)
        outs.append((y, *torch.autograd.grad(y, [t for t in (x, w) if t is not None], grad)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("trained_gain", [True, False])
def test_rms_norm_under_autograd_has_torchs_forward_and_gradients_and_keeps_less(trained_gain):
    """In training RMSNorm runs its own autograd function (the backward written out): the forward bitwise torch's
    kernel, the gradients to rounding; it keeps x and one value per row, where autograd through the kernel keeps
    more; a frozen gain gets no gradient computed (PEFT)."""
    from pretune.model.layers import RMSNorm, rms_norm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    norm.weight.requires_grad_(trained_gain)
    x = (3 * torch.randn(4, 33, 64, generator=g)).requires_grad_()
    grad = torch.randn(4, 33, 64, generator=g)
    inputs = [x, norm.weight] if trained_gain else [x]

    def saved(fn):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            y = fn()
        return y, sum(t.numel() for t in kept if t is not norm.weight)

    y, ours = saved(lambda: norm(x))
    ref, theirs = saved(lambda: rms_norm(x, (64,), norm.weight, 1e-6))
    assert y.grad_fn is not None and "RMSNorm" in type(y.grad_fn).__name__
    assert torch.equal(y, ref)
    for a, b in zip(torch.autograd.grad(y, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours == x.numel() + 4 * 33 < theirs
    with torch.no_grad():  # outside autograd: the kernel as before
        assert torch.equal(norm(x), ref)
    if trained_gain:  # an input that needs no gradient (the first block of a model with frozen embeddings)
        x0 = x.detach()
        mine = torch.autograd.grad(norm(x0), norm.weight, grad)[0]
        theirs = torch.autograd.grad(rms_norm(x0, (64,), norm.weight, 1e-6), norm.weight, grad)[0]
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ffn", ["swiglu", "geglu", "reglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_ffn_recomputing_its_inner_activation_gives_the_plain_gradients(ffn, bias):
    """In training a gated FFN keeps only the fused gate/up output for the backward and recomputes act(gate) * up
    there (layers._GatedDown): the output and every gradient equal the plain autograd path's, and the inner
    activation is not among the tensors saved for the backward."""
    from pretune.model.layers import FeedForward

    torch.manual_seed(0)
    ffn_mod = FeedForward(ModelConfig(arch="decoder", head="lm", vocab_size=10, dim=16, n_layers=1, n_heads=2,
                                      ffn_dim=24, ffn=ffn, bias=bias))
    x = torch.randn(3, 5, 16, requires_grad=True)
    g = torch.randn(3, 5, 16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = ffn_mod(x)
    got = torch.autograd.grad(y, [x, *ffn_mod.parameters()], g)
    assert (3, 5, 24) not in saved  # neither act(gate) nor act(gate) * up is kept
    plain = ffn_mod.down_proj(ffn_mod.act(ffn_mod.gate_proj(x)) * ffn_mod.up_proj(x))
    want = torch.autograd.grad(plain, [x, *ffn_mod.parameters()], g)
    torch.testing.assert_close(y, plain, rtol=0, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # low precision: the same casts as the plain path
        y16 = ffn_mod(x)
        plain16 = ffn_mod.down_proj(ffn_mod.act(ffn_mod.gate_proj(x)) * ffn_mod.up_proj(x))
    assert y16.dtype == plain16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), plain16.float(), rtol=0.02, atol=0.02)
    for a, b in zip(torch.autograd.grad(y16, [x, *ffn_mod.parameters()], g.bfloat16()),
                    torch.autograd.grad(plain16, [x, *ffn_mod.parameters()], g.bfloat16())):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("ffn", ["swiglu", "geglu", "geglu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_ffn_backward_written_in_place_is_bitwise_autograds(ffn, dtype, monkeypatch):
    """For SiLU and both GELUs the backward computes d gate and d up with the activation's own backward kernel
    straight into one buffer (no concatenation): bitwise the gradients autograd gives through the recomputed
    activation."""
    from pretune.model import layers

    torch.manual_seed(0)
    gate_up = torch.randn(4, 7, 2 * 24, dtype=dtype, requires_grad=True)
    weight = torch.randn(16, 24, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 7, 16, dtype=dtype)
    act = layers.ACTIVATIONS[layers.FFNS[ffn][1]]

    def grads():
        y = layers._GatedDown.apply(gate_up, weight, None, act)
        return torch.autograd.grad(y, [gate_up, weight], g)

    direct = grads()
    monkeypatch.setattr(layers, "_ACT_BACKWARD", {})
    through_autograd = grads()
    for a, b in zip(direct, through_autograd, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("frozen", [(), ("down_proj",), ("gate_proj", "up_proj", "down_proj")])
def test_gated_ffn_backward_computes_only_the_gradients_asked_for(frozen):
    """A frozen down projection (a LoRA base) gets no weight-gradient product in the backward: of the two
    (N, ffn) x (ffn, dim)-sized products there, only the input gradient's runs (counted with FlopCounterMode).
    Gradients that are asked for equal the plain path's."""
    from torch.utils.flop_counter import FlopCounterMode

    from pretune.model.layers import FeedForward

    torch.manual_seed(0)
    n, dim, f = 15, 16, 24
    ffn_mod = FeedForward(ModelConfig(arch="decoder", head="lm", vocab_size=10, dim=dim, n_layers=1, n_heads=2,
                                      ffn_dim=f, ffn="swiglu"))
    for name in frozen:
        getattr(ffn_mod, name).weight.requires_grad_(False)
    x = torch.randn(n, dim, requires_grad=True)
    y = ffn_mod(x)
    with FlopCounterMode(display=False) as counter:
        got = torch.autograd.grad(y, [x, *(p for p in ffn_mod.parameters() if p.requires_grad)], torch.ones_like(y))
    product = 2 * n * f * dim  # one (n, f) x (f, dim) product
    down_backward = product * (1 + ("down_proj" not in frozen))  # input gradient, and the weight's if it trains
    gate_up_backward = 2 * product * (1 + ("gate_proj" not in frozen))  # (gate and up: twice the size)
    assert counter.get_total_flops() == down_backward + gate_up_backward
    plain = ffn_mod.down_proj(ffn_mod.act(ffn_mod.gate_proj(x)) * ffn_mod.up_proj(x))
    want = torch.autograd.grad(plain, [x, *(p for p in ffn_mod.parameters() if p.requires_grad)],
                               torch.ones_like(y))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cls", ["rmsnorm", "rmsnorm_plus_one"])
def test_rms_norm_on_few_rows_outside_autograd_is_the_kernel_up_to_rounding(cls, monkeypatch):
    """A decoding step's RMSNorm (a few fp32 rows on the CPU, no autograd) runs as one layer_norm over (x, -x): the
    kernel's values up to rounding; many rows and training keep the kernel itself; an in-place change of the gain
    reaches the next call (its stacked copy is rebuilt)."""
    from pretune.model import layers
    from pretune.model.layers import LEAN_NORM_ROWS, NORMS, rms_norm

    g = torch.Generator().manual_seed(0)
    norm = NORMS[cls](64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.5)

    def kernel(x):
        gain = norm.weight if cls == "rmsnorm" else 1.0 + norm.weight
        return rms_norm(x, (64,), gain, 1e-6)

    few, many = torch.randn(4, 1, 64, generator=g), torch.randn(LEAN_NORM_ROWS + 1, 1, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(norm(few), kernel(few), rtol=2e-6, atol=1e-6)  # one token per row
        tokens = torch.randn(2, 3, 64, generator=g)  # a few rows of several tokens, and flat rows
        for x in (tokens, tokens.view(6, 64), tokens[0, 0]):
            y = norm(x)
            assert y.shape == x.shape
            torch.testing.assert_close(y, kernel(x), rtol=2e-6, atol=1e-6)
        with torch.inference_mode():
            torch.testing.assert_close(norm(few * 3), kernel(few * 3), rtol=2e-6, atol=1e-6)
        norm.weight.mul_(-2.0)  # an in-place update: the next call must see it
        torch.testing.assert_close(norm(few), kernel(few), rtol=2e-6, atol=1e-6)
        assert torch.equal(norm(many), kernel(many))
    y = norm(few)  # autograd (the weight trains): the kernel, gradients and all
    assert y.requires_grad and torch.equal(y, kernel(few))
    # the lean path is the one taken for few rows outside autograd (the kernel is not called)
    monkeypatch.setattr(layers, "rms_norm", lambda *a: pytest.fail("the kernel ran on a decoding step's rows"))
    with torch.no_grad():
        norm(few)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Outputs of the same products: a stacked matmul may sum in another order than the separate ones (MKL picks its
    kernel by the output width; on AVX2 CPUs the last bits differ), so equal to fp32 rounding, not bitwise."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _three_linears(bias: bool, frozen: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, n, bias=bias) for n in (16, 8, 8)]
    for m in layers:
        m.requires_grad_(not frozen)
    return layers


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_fused_linears_are_views_of_their_stack_held_once(bias, tmp_path):
    """Frozen weights (a PEFT base, a model only run) become views of the stacked copy FusedLinears keeps, so they
    are held once: the same outputs, one storage, an update seen either way, and still saveable, copyable and usable
    by a training step that needs them for its backward (the stack is built outside inference mode)."""
    import copy

    from safetensors.torch import load_file, save_file

    from pretune.checkpoint import owned
    from pretune.model.layers import FusedLinears

    layers = _three_linears(bias, frozen=True)
    fused, x = FusedLinears(), torch.randn(2, 3, 16)
    want = [m(x) for m in layers]
    with torch.inference_mode():
        got = fused(x, layers)
    assert all(_close(a, b) for a, b in zip(got, want))
    w, b = fused.weights(layers)
    for m in layers:  # one storage: the layers' weights are rows of the stack
        assert m.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert m.weight.is_leaf and not m.weight.is_inference() and not w.is_inference()
        if bias:
            assert m.bias.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    with torch.no_grad():
        layers[1].weight.mul_(2.0)  # an in-place update reaches the stack (it is the same memory)
    assert _close(fused(x, layers)[1], layers[1](x)) and torch.equal(fused.weights(layers)[0][16:24],
                                                                          layers[1].weight)
    # a LoRA-style step: frozen weights, an input that trains: the backward reaches the input
    xg = x.clone().requires_grad_(True)
    sum(y.sum() for y in fused(xg, layers)).backward()
    torch.testing.assert_close(xg.grad, sum(m.weight.sum(0) for m in layers).expand_as(x))
    # saving writes each weight on its own (safetensors refuses shared memory), copying works
    state = {f"{i}.weight": m.weight for i, m in enumerate(layers)}
    save_file({k: owned(v) for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    twin = copy.deepcopy(layers)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(twin, layers))


def test_trainable_fused_linears_keep_their_own_storage_and_drop_a_stale_stack():
    """Weights that may train are not re-pointed (an optimizer, DDP or compile own them); the stack an evaluation
    built for them is a separate, gradient-free copy, dropped by the next training call."""
    from pretune.model.layers import FusedLinears

    layers = _three_linears(True, frozen=False)
    fused, x = FusedLinears(), torch.randn(2, 3, 16)
    with torch.no_grad():
        fused(x, layers)
    w = fused._cache[1]
    assert w.grad_fn is None and not w.requires_grad  # (a stack built with grad on would hold a graph)
    assert all(m.weight.untyped_storage().data_ptr() != w.untyped_storage().data_ptr() for m in layers)
    sum(y.sum() for y in fused(x, layers)).backward()
    assert fused._cache is None and all(m.weight.grad is not None for m in layers)


def test_shared_stack_follows_writes_through_any_handle_and_late_freezing():
    """Once frozen weights are views of the stack, a write through a tensor that shares their memory (a kept
    ``state_dict()`` entry) reaches the model every time, not only until the next rebuild; weights frozen after an
    evaluation already stacked them start sharing; a bf16 base under bf16 autocast shares too (nothing to cast)."""
    from pretune.model.layers import FusedLinears

    layers = _three_linears(False, frozen=True)
    fused, x = FusedLinears(), torch.randn(2, 3, 16)
    with torch.no_grad():
        fused(x, layers)
        kept = layers[2].weight.detach()  # (what state_dict() hands out)
        for scale in (2.0, 3.0):  # two writes through the same handle, a forward after each
            kept.mul_(scale)
            assert _close(fused(x, layers)[2], x @ kept.t())
            assert torch.equal(layers[2].weight, kept)

    late = _three_linears(False, frozen=False)
    fused = FusedLinears()
    with torch.no_grad():
        fused(x, late)  # an evaluation while they may train: a separate copy
        w = fused._cache[1]
        assert all(m.weight.untyped_storage().data_ptr() != w.untyped_storage().data_ptr() for m in late)
        for m in late:
            m.requires_grad_(False)
        fused(x, late)
        w = fused._cache[1]
        assert all(m.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for m in late)

    bf16 = [m.to(torch.bfloat16) for m in _three_linears(False, frozen=True)]
    fused = FusedLinears()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused(x, bf16)
    assert all(m.weight.untyped_storage().data_ptr() == fused._cache[1].untyped_storage().data_ptr() for m in bf16)
