"""Continuous batching (pretune.generation.batching): every sequence's tokens equal what it gets alone, whatever
shares its steps, joins or leaves; greedy tokens equal generate's."""

from __future__ import annotations

import threading

import pytest
import torch

import pretune
from pretune.generation import generate
from pretune.generation.batching import Engine, QueueFull, Sequence
from pretune.model.fast.decode_step import _LINEAR_POINTWISE, onednn_linear


@pytest.mark.skipif(_LINEAR_POINTWISE is None, reason="no oneDNN in this torch")
def test_onednn_gives_a_row_the_same_product_for_every_batch_of_two_or_more():
    """What RaggedStep's min_rows = 2 rests on (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(200, 48, generator=g), torch.randn(17, 1, 48, generator=g)
    ref = onednn_linear(x[:2], w)[:1]
    assert all(torch.equal(onednn_linear(x[:m], w)[:1], ref) for m in range(2, 18))
    other = torch.randn(9, 1, 48, generator=g)
    other[5] = x[0]
    assert torch.equal(onednn_linear(other, w)[5], ref[0])  # any other rows, any position


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = pretune.get_preset("tiny-llama", vocab_size=97, eos_token_id=3, max_seq_len=128)
    model = pretune.build_model(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)  # peaked distributions: no near-ties
    return model


def _run(engine, specs, cancel_after=None):
    """Submit sequences (prompt, temperature, seed, max_new) a few ms apart; {index: (tokens, reason)}."""
    out, done = {}, threading.Event()

    def end(s, reason, k):
        out[k] = (list(s.new), reason)
        if len(out) == len(specs):
            done.set()

    seqs = []
    for k, (prompt, temp, seed, n) in enumerate(specs):
        seqs.append(Sequence(prompt=prompt, max_new_tokens=n, temperature=temp, seed=seed, stop_ids=[3],
                             on_token=(lambda s, t: s.cancel() if cancel_after and len(s.new) >= cancel_after
                                       and s.seed == -1 else None),
                             on_end=lambda s, r, k=k: end(s, r, k)))
    for s in seqs:
        engine.submit(s)
        threading.Event().wait(0.002)
    assert done.wait(60)
    return out


@pytest.mark.parametrize("mode", ["ragged-step", "forward-per-row", "bf16"])
def test_every_sequence_equals_itself_alone(tiny, mode):
    """ragged-step: fp32 through oneDNN, any M >= 2; forward-per-row: the reference model (no flat step);
    bf16: the products through F.linear at a fixed M = max_batch."""
    model = tiny
    if mode == "forward-per-row":
        model = pretune.build_model(tiny.config, fast=False).eval().requires_grad_(False)
        model.load_state_dict(tiny.state_dict())
    elif mode == "bf16":
        model = pretune.build_model(tiny.config).eval().requires_grad_(False)
        model.load_state_dict(tiny.state_dict())
        model.to(torch.bfloat16)
    engine = Engine(model, max_batch=6)
    assert (engine.step_fn is not None) == (mode != "forward-per-row")
    if engine.step_fn is not None:
        assert engine.step_fn.min_rows == (2 if mode == "ragged-step" else 6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 97, (n,), generator=g).tolist() for n in (1, 5, 9, 14, 3, 30, 7, 2)]
    specs = [(p, 0.0 if i % 2 else 1.0, i, 6 + 4 * i) for i, p in enumerate(prompts)]
    try:
        together = _run(engine, specs)
        assert engine.peak >= 3  # they shared steps (and the 8 > max_batch 6: some waited in the queue)
        alone = {k: _run(engine, [spec])[0] for k, spec in enumerate(specs)}
        assert together == alone
        for k, (p, temp, _, n) in enumerate(specs):
            if temp == 0.0:
                want = generate(model, torch.tensor([p]), max_new_tokens=n, eos_token_id=3, pad_token_id=0)
                assert want[0, len(p):].tolist()[: len(alone[k][0])] == alone[k][0]
        # a sequence cancelled mid-way leaves, the others are untouched
        cancelled = _run(engine, specs[:3] + [(prompts[5], 0.0, -1, 40)], cancel_after=3)
        assert cancelled[3][1] == "cancelled" and len(cancelled[3][0]) == 3
        assert [cancelled[k] for k in range(3)] == [alone[k] for k in range(3)]
    finally:
        engine.close()


def test_the_queue_and_the_token_budget(tiny):
    engine = Engine(tiny, max_batch=2, max_queue=0, max_tokens=50)
    try:
        def seq(n):
            return Sequence(prompt=[5, 6], max_new_tokens=n, on_token=lambda s, t: None, on_end=lambda s, r: None)
        with pytest.raises(pretune.generation.batching.GenerationError, match="budget is 50"):
            engine.submit(seq(60))
        with pytest.raises(QueueFull):
            engine.submit(seq(5))
    finally:
        engine.close()
