"""The fast wing (model/fast/): each fast module computes what its reference computes — stacked linears, the
written-out backwards, the fast norms — and fast models equal reference models."""

from __future__ import annotations

import pytest
import torch

from pretune import ModelConfig


def test_fused_frozen_linears_under_autocast_equal_separate_layers_and_cache_the_cast():
    """Frozen weights fused under bf16 autocast give exactly what each nn.Linear gives (its own cast per call), and
    the stacked weight is cached in bf16 (one cast, not one per step); a weight update is seen."""
    from torch import nn

    from pretune.model.fast.linears import FusedLinears

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
    from pretune.model.fast.layers import _rms_norm_composite, rms_norm

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
    from pretune.model.fast.layers import FastRMSNorm as RMSNorm
    from pretune.model.fast.layers import rms_norm

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
    from pretune.model.fast.layers import FastFeedForward as FeedForward

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
    from pretune.model.fast import layers
    from pretune.model.layers import ACTIVATIONS, FFNS

    torch.manual_seed(0)
    gate_up = torch.randn(4, 7, 2 * 24, dtype=dtype, requires_grad=True)
    weight = torch.randn(16, 24, dtype=dtype, requires_grad=True)
    g = torch.randn(4, 7, 16, dtype=dtype)
    act = ACTIVATIONS[FFNS[ffn][1]]

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

    from pretune.model.fast.layers import FastFeedForward as FeedForward

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
    from pretune.model.fast import FAST, layers
    from pretune.model.fast.layers import LEAN_NORM_ROWS, rms_norm
    from pretune.model.layers import NORMS

    g = torch.Generator().manual_seed(0)
    norm = FAST[NORMS[cls]](64, 1e-6)
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

    from pretune.io.checkpoint import owned
    from pretune.model.fast.linears import FusedLinears

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
    from pretune.model.fast.linears import FusedLinears

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
    from pretune.model.fast.linears import FusedLinears

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


# ------------------------------------------------------------------------------------------------ fast = reference
def _pair(cfg, peft_setup=None):
    """A fast model and a reference model with the same (perturbed) weights, after the same PEFT injection."""
    from decoder_fixtures import perturbed
    from test_decode_step import PEFT

    from pretune import build_model, peft

    fast = perturbed(cfg)
    ref = build_model(cfg, fast=False)
    for m in (fast, ref):
        if peft_setup is not None:
            peft.inject(m, peft.PeftConfig(**PEFT[peft_setup]), seed=0)
    with torch.no_grad():
        if peft_setup is not None:  # adapters start at 0: make them count
            for p in fast.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.1)
    ref.load_state_dict(fast.state_dict())
    return fast.eval(), ref.eval()


def _decoder_cases():
    from test_decode_step import FAMILIES, PEFT, tiny

    # (lora-bf16-base: a bf16 base runs under autocast, where fast and reference differ by bf16 rounding; the flat
    # step's tests cover it bitwise against the fast forward)
    return ([pytest.param(tiny(**kw), None, id=name) for name, kw in FAMILIES.items()]
            + [pytest.param(tiny(**FAMILIES["qwen2"]), m, id=f"peft:{m}") for m in PEFT if m != "lora-bf16-base"])


def _preset_cases():
    from pretune.presets import get_preset

    return [pytest.param(get_preset(name, dropout=0.0, attn_dropout=0.0, classifier_dropout=0.0), None, id=name)
            for name in
            ("tiny-bert-base", "tiny-t5-small", "tiny-bart-base", "tiny-gpt2", "tiny-llama", "tiny-modernbert-base",
             "tiny-deberta-v3-xsmall", "tiny-albert-base", "tiny-electra-small", "tiny-distilbert-base")]


def _inputs(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1, min(cfg.vocab_size, 100), (3, 9), generator=g)
    mask = torch.ones_like(x)
    mask[1, :2] = 0  # padding (left for decoders, where generation pads)
    if cfg.arch != "decoder":
        mask = mask.flip(-1)
    kw = {}
    if cfg.arch == "encoder-decoder":
        kw["decoder_input_ids"] = torch.randint(1, min(cfg.vocab_size, 100), (3, 5), generator=g)
    labels = (kw.get("decoder_input_ids", x)).clone()
    if cfg.arch == "decoder":
        labels = labels.masked_fill(mask == 0, -100)
    elif cfg.arch == "encoder":
        labels = labels.masked_fill(torch.rand(labels.shape, generator=g) > 0.4, -100)  # masked-LM rows
    return x, mask, kw, labels


def _rel_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6, scale: float | None = None):
    """Equal to fp32 rounding: within ``rtol`` of ``scale`` (default: b's largest value; gradients pass the largest of
    every gradient, since some are rounding noise around 0, such as a key bias's)."""
    scale = max(float(b.detach().abs().max()) if scale is None else scale, 1e-12)
    torch.testing.assert_close(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize(("cfg", "peft_setup"), _decoder_cases() + _preset_cases())
def test_fast_model_equals_the_reference(cfg, peft_setup):
    """fast=True and fast=False give the same logits, loss and fp32 gradients (to rounding), with the same names,
    parameters and buffers in the same order."""
    fast, ref = _pair(cfg, peft_setup)
    assert list(fast.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in fast.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert any(type(m).__module__.startswith("pretune.model.fast") for m in fast.modules())
    assert not any(type(m).__module__.startswith("pretune.model.fast") for m in ref.modules())
    x, mask, kw, labels = _inputs(cfg)
    with torch.no_grad():
        a, b = fast(x, mask, **kw).logits, ref(x, mask, **kw).logits
    _rel_close(a, b, rtol=1e-5)
    if cfg.head not in ("lm", "mlm"):
        return
    fast.train(), ref.train()  # dropout is 0: training mode changes only which paths run
    la, lb = fast(x, mask, labels=labels, **kw).loss, ref(x, mask, labels=labels, **kw).loss
    _rel_close(la, lb, rtol=1e-6)
    params = [(n, p) for n, p in fast.named_parameters() if p.requires_grad]
    ref_params = dict(ref.named_parameters())
    ga = torch.autograd.grad(la, [p for _, p in params], allow_unused=True)
    gb = torch.autograd.grad(lb, [ref_params[n] for n, _ in params], allow_unused=True)
    # all gradients together within 2.5e-6 of their norm (measured: below 1e-6 for every family and preset, 1.7-1.9e-6
    # with LoRA on every linear); each tensor within 1e-5 of its own norm (fp32 sums in another order), or of 1 % of
    # the largest one's for a gradient that is rounding noise around 0 (a key bias's: softmax ignores it)
    assert all((g1 is None) == (g2 is None) for g1, g2 in zip(ga, gb)), [n for n, _ in params]
    pairs = [(n, g1, g2) for (n, _), g1, g2 in zip(params, ga, gb) if g1 is not None]
    total = sum(float((g1 - g2).norm()) ** 2 for _, g1, g2 in pairs) ** 0.5
    norm = sum(float(g2.norm()) ** 2 for _, _, g2 in pairs) ** 0.5
    assert total <= 2.5e-6 * norm, f"|fast - reference| = {total / norm:.3g} of |reference| over every gradient"
    scale = max(float(g2.norm()) for _, _, g2 in pairs)
    for name, g1, g2 in pairs:
        err, ref = float((g1 - g2).norm()), max(float(g2.norm()), 1e-2 * scale)
        assert err <= 1e-5 * ref, f"{name}: |fast - reference| = {err:.3g}, {err / ref:.3g} of |reference|"


@pytest.mark.parametrize(("cfg", "peft_setup"), _decoder_cases() + [
    pytest.param(*p.values, id=p.id) for p in _preset_cases() if p.id in ("tiny-t5-small", "tiny-bart-base")])
def test_fast_model_generates_the_reference_tokens(cfg, peft_setup):
    """Greedy decoding (the fast model through the flat step and fused caches) gives the reference's tokens."""
    from pretune.generation import generate

    fast, ref = _pair(cfg, peft_setup)
    x, mask, _, _ = _inputs(cfg)
    kw = dict(max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(generate(fast, x, mask, **kw), generate(ref, x, mask, **kw))


def test_the_fast_paths_are_taken():
    """A fast model's training step runs the fast wing's functions (stacked q/k/v, the written-out RMSNorm and gated
    FFN backwards, the fused LM head + cross-entropy); the reference's runs none of them."""
    from test_decode_step import tiny

    fast, ref = _pair(tiny())
    x, mask, _, labels = _inputs(fast.config)

    def graph_nodes(model):
        seen, todo = set(), [model.train()(x, mask, labels=labels).loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
        return {type(f).__name__ for f in seen}

    wanted = {"_StackedLinearBackward", "_RMSNormFunctionBackward", "_GatedDownBackward",
              "_FusedLinearCrossEntropyBackward"}
    assert wanted <= graph_nodes(fast)
    assert not wanted & graph_nodes(ref)


def test_accelerate_swaps_every_reference_module_with_a_twin_and_adds_no_state():
    from pretune import build_model
    from pretune.model.fast import FAST, accelerate

    for name in ("tiny-llama", "tiny-t5-small", "tiny-bert-base"):
        ref = build_model(name, fast=False)
        before = [(n, t.data_ptr()) for n, t in ref.state_dict().items()]
        fast = accelerate(ref)
        assert fast is ref and [(n, t.data_ptr()) for n, t in fast.state_dict().items()] == before
        assert not any(type(m) in FAST for m in fast.modules())  # nothing left behind


# Instance attributes of the modules the flat decoding step reads, with what it does about each (fast/decode_step.py:
# _Layer, FlatDecoder, _why_not). A new attribute fails this test until the step handles it or refuses it by name.
FLAT_STEP_UNDERSTANDS = {
    "Block": {"pre_norm", "attn", "attn_norm", "ffn", "ffn_norm", "attn_post_norm", "ffn_post_norm", "cross_attn",
              "cross_norm", "cross_post_norm", "attn_drop", "ffn_drop", "cross_drop"},
    "Stack": {"causal", "n_layers", "embed_scale", "window", "local", "position", "local_position", "token_type",
              "embed_norm", "embed_proj", "drop", "layers", "norm", "extra_inputs", "checkpoint_blocks"},
    "Attention": {"n_heads", "n_kv_heads", "dh", "cross", "scale", "dropout", "softcap", "q_proj", "k_proj", "v_proj",
                  "o_proj", "q_norm", "k_norm", "extra_kv"},
    "FeedForward": {"act", "up_proj", "gate_proj", "down_proj"},
}


def test_the_flat_step_understands_every_attribute_of_the_modules_it_reads():
    from test_decode_step import FAMILIES, tiny

    from pretune import build_model

    seen: dict[str, set] = {k: set() for k in FLAT_STEP_UNDERSTANDS}
    for kw in FAMILIES.values():
        for m in build_model(tiny(**kw), fast=False).modules():
            name = type(m).__name__
            if name in seen:
                seen[name] |= {k for k in vars(m) if not k.startswith("_") and k != "training"} | set(m._modules)
    for name, attrs in seen.items():
        assert attrs <= FLAT_STEP_UNDERSTANDS[name], f"{name}: {sorted(attrs - FLAT_STEP_UNDERSTANDS[name])}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_heads", [None, 1, 6])
def test_one_query_attention_is_sdpa_up_to_rounding(dtype, mask_heads):
    """The one-query kernel (a decoding step in bf16) computes SDPA's attention: grouped query heads, additive masks
    per row or per head with hidden keys, no mask; in fp32 to ~1e-6, in bf16 no further from an fp32 reference than
    SDPA's own bf16 kernel is (x2)."""
    import torch.nn.functional as F

    from pretune.model.fast.attention import attend_one_query

    torch.manual_seed(0)
    B, H, Hkv, S, dh = 3, 6, 2, 9, 8
    q, k, v = torch.randn(B, H, 1, dh), torch.randn(B, Hkv, S, dh), torch.randn(B, Hkv, S, dh)
    mask = None
    if mask_heads is not None:
        mask = torch.randn(B, mask_heads, 1, S)
        mask[0, ..., :4] = torch.finfo(dtype).min  # left padding of the first row
    want = F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    cast = [t.to(dtype) if t is not None else None for t in (q, k, v, mask)]
    got = attend_one_query(*cast, scale=0.3)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        sdpa = F.scaled_dot_product_attention(*cast, scale=0.3, enable_gqa=True)
        assert (got.float() - want).abs().max() <= 2 * (sdpa.float() - want).abs().max() + 1e-3


def test_a_bf16_decoding_step_attends_with_the_one_query_kernel(monkeypatch):
    """Under bf16 autocast a cached decoding step (one query) goes through the one-query kernel, in the forward and
    in the flat step alike; the prompt (many queries) and fp32 steps go through SDPA."""
    import pretune.model.fast.attention as fast_attention

    calls = []
    real = fast_attention.attend_one_query
    monkeypatch.setattr(fast_attention, "attend_one_query", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    from decoder_fixtures import perturbed
    from test_decode_step import tiny

    model = perturbed(tiny(n_layers=2))
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    for autocast in (False, True):
        calls.clear()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model.generate(ids, max_new_tokens=3, do_sample=False)
        # two decoding steps after the prompt, two layers each
        assert calls == ([(2, 4, 1, 8)] * 4 if autocast else [])


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_token_logprobs_equal_the_heads_logits_values_and_gradients(bias):
    """The fast head's per-token log-probabilities (row chunks, logits computed again in the backward) equal the
    reference's log-softmax of the full logits at a temperature: values, and gradients to h and to a trainable
    head weight for an arbitrary upstream gradient; under bf16 autocast as close as the reference's own bf16."""
    from pretune.model.fast.fused_ce import fused_linear_token_logprobs

    torch.manual_seed(0)
    N, d, V = 37, 16, 50
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    b = torch.randn(V) if bias else None
    t = torch.randint(0, V, (N,))
    up = torch.randn(N)

    def reference():
        z = (torch.nn.functional.linear(h, w, b).float()) / 0.7
        return z.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(z, 1)

    want = reference()
    gh, gw = torch.autograd.grad((want * up).sum(), (h, w))
    got = fused_linear_token_logprobs(h, w, t, temperature=0.7, chunk=8, bias=b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    fh, fw = torch.autograd.grad((got * up).sum(), (h, w))
    torch.testing.assert_close(fh, gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fw, gw, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref16, got16 = reference(), fused_linear_token_logprobs(h, w, t, temperature=0.7, chunk=8, bias=b)
        assert got16.dtype == torch.float32
        assert (got16 - want).abs().max() <= 2 * (ref16 - want).abs().max() + 1e-3
        f16 = torch.autograd.grad((got16 * up).sum(), h)[0]
        assert f16.dtype == torch.float32 and (f16 - gh).abs().max() < 0.05 * gh.abs().max()


def test_a_frozen_head_gives_no_weight_gradient_and_the_fast_head_takes_the_chunks(monkeypatch):
    """LoRA's frozen tied head: only h gets a gradient; FastLMHead.token_logprobs goes through the chunked
    function (the reference's LMHead through its full logits)."""
    from decoder_fixtures import perturbed
    from test_decode_step import tiny

    import pretune.model.fast.fused_ce as fused_ce

    model = perturbed(tiny())
    calls = []
    real = fused_ce._FusedLinearTokenLogprobs.apply
    monkeypatch.setattr(fused_ce._FusedLinearTokenLogprobs, "apply", lambda *a: calls.append(1) or real(*a))
    model.head.weight.requires_grad_(False)
    h = torch.randn(5, model.config.dim, requires_grad=True)
    t = torch.randint(0, model.config.vocab_size, (5,))
    got = model.head.token_logprobs(h, t, 0.5)
    got.sum().backward()
    assert calls == [1] and model.head.weight.grad is None and h.grad is not None
    from pretune.model.heads import LMHead
    torch.testing.assert_close(got, LMHead.token_logprobs(model.head, h, t, 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masking", ["none", "causal", "padding", "per-head", "keys-only"])
def test_short_training_attention_is_sdpa_up_to_rounding_forward_and_backward(masking):
    """The bf16 training attention for short rows (probabilities kept in bf16, batched matmuls over a kv head's
    query heads) gives SDPA's output and gradients: no further from an fp32 reference than SDPA's own bf16 kernel
    is (x2, + a small floor), for each kind of mask the model builds."""
    import torch.nn.functional as F

    from pretune.model.fast.attention import _causal_bias, _ShortAttention

    torch.manual_seed(0)
    B, H, Hkv, T, dh = 3, 6, 2, 7, 8
    q, k, v = torch.randn(B, H, T, dh), torch.randn(B, Hkv, T, dh), torch.randn(B, Hkv, T, dh)
    up = torch.randn(B, H, T, dh)
    mask = {"none": None, "causal": _causal_bias(T, T, torch.float32, "cpu")[None, None].expand(B, 1, T, T),
            "padding": torch.zeros(B, 1, T, T), "per-head": torch.randn(B, H, T, T),
            "keys-only": torch.zeros(B, 1, 1, T)}[masking]
    if masking in ("padding", "keys-only"):
        mask[1, ..., :3] = torch.finfo(torch.bfloat16).min

    def run(fn, dtype):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        m = mask.to(dtype) if mask is not None else None
        out = fn(*ins, m)
        grads = torch.autograd.grad((out.float() * up).sum(), ins)
        return [out.float(), *(g.float() for g in grads)]

    def sdpa(a, b, c, m):
        return F.scaled_dot_product_attention(a, b, c, m, scale=0.3, enable_gqa=True)

    want = run(sdpa, torch.float32)
    theirs = run(sdpa, torch.bfloat16)
    ours = run(lambda a, b, c, m: _ShortAttention.apply(a, b, c, m, 0.3), torch.bfloat16)
    for o, t, w in zip(ours, theirs, want):
        assert (o - w).abs().max() <= 2 * (t - w).abs().max() + 2e-2
    f32 = run(lambda a, b, c, m: _ShortAttention.apply(a, b, c, m, 0.3), torch.float32)
    for o, w in zip(f32, want):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)


def test_bf16_training_takes_the_short_attention_only_for_short_rows(monkeypatch):
    """A bf16 autocast training step of a tiny decoder attends through the short path (its loss and gradients close
    to the fp32 step's), and so does a forward without autograd, bitwise (a policy and its reference must agree);
    above SHORT_ATTENTION_ELEMENTS it keeps SDPA."""
    from decoder_fixtures import perturbed
    from test_decode_step import tiny

    import pretune.model.fast.attention as fast_attention

    calls = []
    real = fast_attention._ShortAttention.apply
    monkeypatch.setattr(fast_attention._ShortAttention, "apply", lambda *a: calls.append(a[0].shape) or real(*a))
    model = perturbed(tiny(n_layers=2)).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert calls == [(2, 4, 6, 8)] * 2
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss32 = model(ids, labels=ids).loss  # fp32: SDPA (causal, no mask)
    loss32.backward()
    assert len(calls) == 2 and abs(float(loss) - float(loss32)) < 2e-2 * float(loss32)
    worst = max(float((g - p.grad).norm() / p.grad.norm().clamp(min=1e-12)) for g, p in zip(grads, model.parameters()))
    assert worst < 0.05  # bf16 autocast against fp32: relative gradient error
    model.zero_grad()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the same kernel without autograd
        assert torch.equal(model.eval()(ids).logits, model.train()(ids).logits.detach())
    assert len(calls) == 6
    calls.clear()
    monkeypatch.setattr(fast_attention, "SHORT_ATTENTION_ELEMENTS", 2 * 4 * 6 * 6 - 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, labels=ids).loss.backward()
    assert calls == []
