"""Compiled blocks (train.compile) train like eager ones: the fused q/k/v and gate/up matmuls, the fused RMSNorm and
the recomputing gated FFN step aside under torch.compile, and every weight still gets its gradient."""

import torch

from conftest import requires_cxx
from pretune.model import build_model


@requires_cxx
def test_compiled_blocks_give_the_eager_loss_and_gradients():
    torch.manual_seed(0)
    model = build_model("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads():
        loss = model(ids, labels=ids).loss
        return loss, torch.autograd.grad(loss, params, allow_unused=True)

    eager_loss, eager = loss_and_grads()
    for block in model.transformer.decoder.layers:
        block.compile()
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-5)
    for g, e in zip(grads, eager):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert sum(g is not None for g in grads) >= len(params) - 1  # (an untied head's embedding rows: all used)


def test_compiled_training_after_an_evaluation_still_gives_every_weight_its_gradient():
    """An evaluation (no autograd) caches the fused q/k/v and gate/up stacks; a compiled training step after it must
    not pick that gradient-free stack up (the compile-time shortcut is for decoding), or those weights stop
    learning. aot_eager: dynamo's tracing and guards without inductor's C++ compile."""
    torch.manual_seed(0)
    model = build_model("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def grads():
        return torch.autograd.grad(model(ids, labels=ids).loss, params, allow_unused=True)

    eager = grads()
    for block in model.transformer.decoder.layers:
        block.compile(backend="aot_eager")
    grads()  # traced with grad on
    with torch.no_grad():
        model(ids)  # an evaluation: the stacks are cached
    for g, e in zip(grads(), eager):
        assert (g is None) == (e is None)
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
