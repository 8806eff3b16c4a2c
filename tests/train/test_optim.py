"""AdamW groups, the update rule against the seeds' pseudo-code, schedules, and resumable state."""

import math

import pytest
import torch
from torch import nn

import pretune
from pretune.train.optim import (
    SCHEDULES,
    SeedsAMSGradAdamW,
    build_optimizer,
    build_scheduler,
    lr_lambda,
    param_groups,
)

# ---------------------------------------------------------------- parameter groups


def test_param_groups_tiny_gpt2_excludes_biases_and_norms_and_dedups_tied_embeddings():
    model = pretune.build_model("tiny-gpt2")
    assert model.head.weight is model.transformer.embed.weight  # the preset ties input and output embeddings
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    assert all(n.endswith(".bias") or "norm" in n for n in no_decay["names"])
    assert "transformer.decoder.layers.0.attn_norm.weight" in no_decay["names"]
    assert "transformer.decoder.norm.weight" in no_decay["names"]
    assert "transformer.decoder.layers.0.attn.q_proj.bias" in no_decay["names"]
    # embeddings are decayed (GPT-2 / HF Trainer practice); the tied head is listed once, under its first name
    assert "transformer.embed.weight" in decay["names"] and "head.weight" not in decay["names"]
    assert "transformer.decoder.position.weight" in decay["names"]
    params = decay["params"] + no_decay["params"]
    assert len({id(p) for p in params}) == len(params) == len(list(model.parameters()))  # parameters() dedups
    assert len(decay["names"]) == len(decay["params"]) and len(no_decay["names"]) == len(no_decay["params"])


def test_param_groups_sequential_frozen_and_shared_across_modules():
    body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4, bias=False), nn.RMSNorm(4))
    head = nn.Linear(4, 8)
    head.weight = body[0].weight  # shared between the two modules: listed once
    body[2].weight.requires_grad_(False)  # frozen: left out
    decay, no_decay = param_groups([body, head], weight_decay=0.01)
    assert decay["names"] == ["0.0.weight"]
    assert no_decay["names"] == ["0.0.bias", "0.1.weight", "0.1.bias", "0.3.weight", "1.bias"]
    assert decay["params"][0] is body[0].weight and no_decay["params"][-1] is head.bias


def test_param_groups_drops_empty_groups_and_rejects_bad_input():
    (group,) = param_groups(nn.LayerNorm(4), weight_decay=0.1)
    assert group["weight_decay"] == 0.0 and group["names"] == ["weight", "bias"]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(frozen, weight_decay=0.1)
    with pytest.raises(ValueError, match=r"weight_decay \(-0.1\)"):
        param_groups(nn.Linear(2, 2), weight_decay=-0.1)


# ---------------------------------------------------------------- update rule


def seeds_adamw(theta, grads, *, lr, betas, eps, weight_decay, amsgrad):
    """The seeds' AdamW pseudo-code (seeds/000, "Adam(W) from now on"), line by line, maximize=False."""
    beta1, beta2 = betas
    m, v, v_hat_max = torch.zeros_like(theta), torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        theta = theta - lr * weight_decay * theta
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        if amsgrad:
            v_hat_max = torch.maximum(v_hat_max, v_hat)
            theta = theta - lr * m_hat / (torch.sqrt(v_hat_max) + eps)
        else:
            theta = theta - lr * m_hat / (torch.sqrt(v_hat) + eps)
    return theta


def _grads_with_large_first_step(shape):
    # a large first gradient then smaller ones: v̂ peaks early, so AMSGrad's max is what sets the step
    gen = torch.Generator().manual_seed(1)
    return [scale * torch.randn(shape, generator=gen, dtype=torch.float64) for scale in (5.0, 1.0, 0.3)]


def _run(opt_params, grads_per_param, opt):
    for step in range(3):
        for p, grads in zip(opt_params, grads_per_param):
            p.grad = grads[step].clone()
        opt.step()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_build_optimizer_matches_seeds_pseudo_code(amsgrad):
    hp = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6)
    layer = nn.Linear(3, 4).double()  # weight (4, 3) decayed, bias (4,) not
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    gw, gb = _grads_with_large_first_step(w0.shape), _grads_with_large_first_step(b0.shape)
    opt = build_optimizer(layer, weight_decay=0.1, amsgrad=amsgrad, **hp)
    assert isinstance(opt, torch.optim.AdamW)
    assert type(opt) is (SeedsAMSGradAdamW if amsgrad else torch.optim.AdamW)
    _run([layer.weight, layer.bias], [gw, gb], opt)
    want_w = seeds_adamw(w0, gw, weight_decay=0.1, amsgrad=amsgrad, **hp)
    want_b = seeds_adamw(b0, gb, weight_decay=0.0, amsgrad=amsgrad, **hp)
    torch.testing.assert_close(layer.weight.detach(), want_w, atol=1e-7, rtol=0)
    torch.testing.assert_close(layer.bias.detach(), want_b, atol=1e-7, rtol=0)
    assert not torch.allclose(want_w, w0, atol=1e-3)  # the three steps moved the weights


def test_torch_amsgrad_differs_from_seeds_which_is_why_the_subclass_exists():
    # torch bias-corrects max(v) after the max (pytorch/pytorch#142323); the seeds take max(v̂)
    hp = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0)
    p = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    grads = _grads_with_large_first_step(p.shape)
    _run([p], [grads], torch.optim.AdamW([p], amsgrad=True, **hp))
    assert (p.detach() - seeds_adamw(torch.zeros_like(p), grads, amsgrad=True, **hp)).abs().max() > 1e-4


def test_seeds_amsgrad_subclass_equals_torch_adamw_when_amsgrad_off():
    hp = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, amsgrad=False)
    a, b = (nn.Parameter(torch.ones(6, dtype=torch.float64)) for _ in range(2))
    grads = _grads_with_large_first_step(a.shape)
    _run([a], [grads], torch.optim.AdamW([a], **hp))
    _run([b], [grads], SeedsAMSGradAdamW([b], **hp))
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_fused_with_amsgrad_is_refused():
    with pytest.raises(ValueError, match="fused=True"):
        build_optimizer(nn.Linear(2, 2), lr=1e-3, amsgrad=True, fused=True)


# ---------------------------------------------------------------- schedules
# Expected numbers are the docstring formulas evaluated by hand: warmup k, total T, floor r.


@pytest.mark.parametrize(
    "step, want",
    [(0, 0.0), (5, 0.5), (10, 1.0), (60, 0.5), (85, 0.25), (110, 0.0), (500, 0.0)],  # (T - n) / (T - k)
)
def test_linear_schedule(step, want):
    assert lr_lambda("linear", warmup_steps=10, total_steps=110)(step) == pytest.approx(want, abs=1e-12)


def test_linear_schedule_min_lr_ratio():
    f = lr_lambda("linear", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [f(n) for n in (10, 60, 110, 1000)] == pytest.approx([1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1])


@pytest.mark.parametrize(
    "step, want",
    [
        (0, 0.0),
        (4, 0.4),  # warmup n / k
        (10, 1.0),  # cos(0)
        (35, 0.5 * (1 + math.cos(math.pi / 4))),  # quarter of the decay: 0.8535533905932737
        (60, 0.5),  # cos(π/2) = 0
        (110, 0.0),  # cos(π) = -1
        (10**6, 0.0),
    ],
)
def test_cosine_schedule(step, want):
    assert lr_lambda("cosine", warmup_steps=10, total_steps=110)(step) == pytest.approx(want, abs=1e-12)


def test_cosine_schedule_min_lr_ratio():
    f = lr_lambda("cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [f(n) for n in (10, 60, 110, 10**6)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_constant_schedule():
    f = lr_lambda("constant", warmup_steps=4, total_steps=10)
    assert [f(n) for n in (0, 1, 2, 3, 4, 5, 10, 10**6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert lr_lambda("constant", warmup_steps=0, total_steps=1)(0) == 1.0


def test_inverse_sqrt_is_t5_rule():
    k = 10_000  # T5: k = 10^4 warmup steps at a constant lr of 1/sqrt(k) = 0.01 (Raffel et al. 2019 §3.1.2)
    f = lr_lambda("inverse_sqrt", warmup_steps=k, total_steps=100)  # warmup > total is fine here
    base_lr = 1 / math.sqrt(k)
    for n in (0, 1, 5_000, 9_999, 10_000, 10_001, 40_000, 524_288, 10**6):
        assert base_lr * f(n) == pytest.approx(1 / math.sqrt(max(n, k)), rel=1e-12)  # lr = 1/sqrt(max(n, k))
    assert [f(n) for n in (0, 9_999, 10_000, 40_000, 10**6)] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.1])
    assert base_lr * f(0) == pytest.approx(0.01)


def test_inverse_sqrt_edge_cases():
    f = lr_lambda("inverse_sqrt", warmup_steps=0, total_steps=10)  # k = 0 read as k = 1
    assert [f(n) for n in (0, 1, 4, 100)] == pytest.approx([1.0, 1.0, 0.5, 0.1])
    g = lr_lambda("inverse_sqrt", warmup_steps=4, total_steps=10, min_lr_ratio=0.25)
    assert [g(n) for n in (4, 16, 64, 10**6)] == pytest.approx([1.0, 0.5, 0.25, 0.25])


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_warmup_equal_to_total(name):
    f = lr_lambda(name, warmup_steps=10, total_steps=10, min_lr_ratio=0.2)
    assert [f(n) for n in (0, 5, 10, 20)] == pytest.approx([0.0, 0.5, 0.2, 0.2])


def test_schedule_errors_name_the_values():
    with pytest.raises(ValueError, match="'cosin'.*linear, cosine, constant, inverse_sqrt"):
        lr_lambda("cosin", warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError, match=r"warmup_steps \(-1\)"):
        lr_lambda("constant", warmup_steps=-1, total_steps=10)
    with pytest.raises(ValueError, match=r"total_steps \(0\)"):
        lr_lambda("inverse_sqrt", warmup_steps=10, total_steps=0)
    for name in ("linear", "cosine"):
        with pytest.raises(ValueError, match=r"warmup_steps \(11\) must be <= total_steps \(10\)"):
            lr_lambda(name, warmup_steps=11, total_steps=10)
    with pytest.raises(ValueError, match=r"min_lr_ratio \(1.5\)"):
        lr_lambda("cosine", warmup_steps=0, total_steps=10, min_lr_ratio=1.5)
    lr_lambda("constant", warmup_steps=11, total_steps=10)  # allowed: no decay phase to squeeze


def test_schedules_match_transformers():
    optimization = pytest.importorskip("transformers.optimization")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = {
        "linear": optimization.get_linear_schedule_with_warmup(opt, 7, 50).lr_lambdas[0],
        "cosine": optimization.get_cosine_schedule_with_warmup(opt, 7, 50).lr_lambdas[0],
        "constant": optimization.get_constant_schedule_with_warmup(opt, 7).lr_lambdas[0],
    }
    for name, fn in theirs.items():  # up to total_steps: past it HF's cosine climbs again, ours stays at the floor
        ours = lr_lambda(name, warmup_steps=7, total_steps=50)
        assert [ours(n) for n in range(51)] == pytest.approx([fn(n) for n in range(51)], abs=1e-12), name


@pytest.mark.parametrize("name", SCHEDULES)
def test_build_scheduler_sets_every_group_lr(name):
    opt = build_optimizer(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), lr=2e-3)
    assert len(opt.param_groups) == 2
    sched = build_scheduler(opt, name, warmup_steps=3, total_steps=8, min_lr_ratio=0.1)
    f = lr_lambda(name, warmup_steps=3, total_steps=8, min_lr_ratio=0.1)
    for n in range(10):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([2e-3 * f(n)] * 2)
        opt.step()
        sched.step()


# ---------------------------------------------------------------- resume


def _train(model, opt, sched, batches):
    lrs = []
    for x, y in batches:
        lrs.append([g["lr"] for g in opt.param_groups])
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return lrs


def _setup(amsgrad):
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    return model, opt, build_scheduler(opt, "cosine", warmup_steps=2, total_steps=8, min_lr_ratio=0.1)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_optimizer_and_scheduler_state_round_trip(tmp_path, amsgrad):
    batches = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(6)]
    model, opt, sched = _setup(amsgrad)
    _train(model, opt, sched, batches[:3])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "s.pt")
    want_lrs = _train(model, opt, sched, batches[3:])
    want_params = [p.detach().clone() for p in model.parameters()]

    model2, opt2, sched2 = _setup(amsgrad)  # build both first, then load (see build_scheduler)
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    assert opt2.param_groups[0]["names"] == ["0.weight", "2.weight"]
    assert sched2.last_epoch == 3
    assert _train(model2, opt2, sched2, batches[3:]) == want_lrs  # identical lrs ...
    for p, want in zip(model2.parameters(), want_params):
        assert torch.equal(p, want)  # ... and bit-identical updates


def test_param_lr_puts_parameters_in_groups_of_their_own_rate_that_the_schedule_scales():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    head = model[2]
    opt = build_optimizer(model, lr=1e-3, param_lr={id(p): 5e-2 for p in head.parameters()})
    by_name = {n: g for g in opt.param_groups for n in g["names"]}
    assert by_name["2.weight"]["lr"] == 5e-2 and by_name["2.bias"]["lr"] == 5e-2
    assert by_name["0.weight"]["lr"] == 1e-3 and by_name["1.weight"]["lr"] == 1e-3
    assert by_name["2.weight"]["weight_decay"] == 0.01 and by_name["2.bias"]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    sched = build_scheduler(opt, "linear", warmup_steps=10, total_steps=100)
    for _ in range(5):
        opt.step()
        sched.step()
    assert math.isclose(by_name["2.weight"]["lr"], 5e-2 * 0.5) and math.isclose(by_name["0.weight"]["lr"], 1e-3 * 0.5)
