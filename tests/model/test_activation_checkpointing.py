"""Activation checkpointing (``train.activation_checkpointing=blocks``): each block is recomputed in the backward;
the loss and every gradient equal the plain run's (dropout included: the recomputation replays its RNG)."""

import pytest
import torch

from pretune.model import build_model


def _grads(model, batch, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,extra", [("tiny-bert-base", {}), ("tiny-gpt2", {}), ("tiny-t5-small", {}),
                                          ("tiny-llama", {}), ("tiny-bert-base", {"share_layers": True})])
def test_gradients_equal_the_plain_backward(preset, extra):
    torch.manual_seed(0)
    model = build_model(preset, dropout=0.1, attn_dropout=0.1, **extra).train()
    ids = torch.randint(5, 128, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding too
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if model.config.arch == "encoder-decoder":
        batch["labels"] = torch.randint(5, 128, (3, 7))
    loss, grads = _grads(model, batch)
    model.checkpoint_blocks(True)
    loss_ckpt, grads_ckpt = _grads(model, batch)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads_ckpt[n], grads[n], atol=1e-6, rtol=0, msg=n)


def test_it_keeps_fewer_tensors_for_the_backward():
    """What it is for: the autograd graph saves the blocks' inputs only, not their intermediates."""
    torch.manual_seed(0)
    model = build_model("tiny-gpt2", n_layers=4, dropout=0.0, attn_dropout=0.0).train()
    ids = torch.randint(5, 128, (2, 64))

    def saved_bytes():
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids).loss.detach()
        return total

    plain = saved_bytes()
    model.checkpoint_blocks(True)
    assert saved_bytes() < 0.5 * plain


def test_no_recomputation_in_evaluation_or_generation():
    model = build_model("tiny-gpt2").checkpoint_blocks(True).eval()
    ids = torch.randint(5, 128, (1, 6))
    with torch.no_grad():
        a = model(input_ids=ids).logits
    model.checkpoint_blocks(False)
    with torch.no_grad():
        b = model(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("method,targets", [("lora", ["q_proj", "v_proj"]), ("lora", ["all-linear"]), ("ia3", None)])
def test_adapter_gradients_equal_the_plain_backward_on_a_frozen_base(method, targets):
    """The PEFT case (what TRL's SFTTrainer recomputes by default): a frozen base whose blocks' inputs need no
    gradient from the embedding, stacked frozen weights, the gated FFN's own backward; only the adapters train."""
    from pretune import peft

    torch.manual_seed(0)
    model = build_model("tiny-llama", dropout=0.0).train()
    kw = {"targets": targets} if targets is not None else {}
    peft.inject(model, peft.PeftConfig(method=method, **kw))
    for p in model.parameters():  # adapters that start at zero (LoRA's B) would hide a wrong gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(5, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    loss, grads = _grads(model, batch)
    model.checkpoint_blocks(True)
    loss_ckpt, grads_ckpt = _grads(model, batch)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for n in grads:
        torch.testing.assert_close(grads_ckpt[n], grads[n], atol=1e-6, rtol=0, msg=n)
