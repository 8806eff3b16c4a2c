"""BART's model-core options by their properties: a fixed bias on the LM logits (``logit_bias``: a buffer, saved but
never trained, that the fused loss includes), task heads that read the decoder fed the input shifted right
(``task_stack="decoder"``), the sentence vector at each row's last EOS (``pooling="eos"``), the forced first and last
generated tokens (``forced_bos_token_id``, ``forced_eos_token_id``) and the positions a learned table with an offset
leaves (``max_positions``). Parity with transformers' BART: tests/parity/test_bart.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decoder_fixtures import V, ids, perturbed

from pretune import ConfigError, ModelConfig, build_model, count_parameters
from pretune.generation import generate
from pretune.model.heads import last_eos
from pretune.objectives.lm import lm_loss_sum

EOS, PAD, START = 2, 1, 2


def tiny(**kw) -> ModelConfig:
    """A small BART-shaped encoder-decoder (post-norm, learned positions 2 rows in)."""
    base = dict(arch="encoder-decoder", head="lm", vocab_size=V, dim=32, n_layers=2, n_decoder_layers=3, n_heads=4,
                ffn_dim=48, max_seq_len=40, dropout=0.0, attn_dropout=0.0, norm_eps=1e-5, position="learned",
                position_offset=2, token_types=0, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=START)
    return ModelConfig(**{**base, **kw})


def with_bias(cfg: ModelConfig, seed: int = 0):
    model = perturbed(cfg, seed)
    if model.head is not None and getattr(model.head, "bias", None) is not None and cfg.head == "lm":
        with torch.no_grad():
            model.head.bias.copy_(torch.randn(V, generator=torch.Generator().manual_seed(seed + 7)))
    return model


def rows_with_eos(lengths=(9, 6, 4), T: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows that each end with EOS (ids 3.. elsewhere), padded with PAD."""
    x = ids(len(lengths), T).clamp(min=3)
    mask = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        x[i, n - 1] = EOS
    return x.masked_fill(mask == 0, PAD), mask


def shift_right(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full_like(x[:, :1], START), x[:, :-1]], 1)


# --- logit_bias ------------------------------------------------------------------------------------------
def test_logit_bias_adds_a_fixed_vector_to_every_lm_logit():
    model = with_bias(tiny(logit_bias=True))
    plain = build_model(tiny()).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "head.bias"})
    x, mask = rows_with_eos()
    dec = ids(3, 5, seed=2)
    with torch.no_grad():
        got = model(x, attention_mask=mask, decoder_input_ids=dec).logits
        want = plain(x, attention_mask=mask, decoder_input_ids=dec).logits + model.head.bias
    torch.testing.assert_close(got, want)


def test_logit_bias_is_a_saved_buffer_that_training_leaves_alone():
    model = with_bias(tiny(logit_bias=True))
    assert "head.bias" in model.state_dict() and "head.bias" not in dict(model.named_parameters())
    assert count_parameters(model) == count_parameters(build_model(tiny()))  # transformers counts no buffer either
    before = model.head.bias.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, mask = rows_with_eos()
    model.train()
    model(x, attention_mask=mask, labels=ids(3, 5, seed=2)).loss.backward()
    opt.step()
    assert torch.equal(model.head.bias, before)


def test_the_fused_loss_includes_the_logit_bias():
    """model(labels=...) and the objectives' lm_loss_sum fuse the head with the cross-entropy: the same loss and
    gradients as the cross-entropy of the biased logits."""
    model = with_bias(tiny(logit_bias=True))
    x, mask = rows_with_eos()
    labels = ids(3, 6, seed=3)
    labels[2, 4:] = -100
    out = model(x, attention_mask=mask, labels=labels, return_logits=True)
    want = F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want)
    h = torch.randn(7, 32, requires_grad=True, generator=torch.Generator().manual_seed(4))
    targets = torch.tensor([1, 5, -100, 9, 2, 2, 40])
    fused, _ = lm_loss_sum(model, h, targets, 6)
    (g_fused,) = torch.autograd.grad(fused, h)
    direct = F.cross_entropy(model.head(h), targets, ignore_index=-100, reduction="sum")
    (g_direct,) = torch.autograd.grad(direct, h)
    torch.testing.assert_close(fused, direct)
    torch.testing.assert_close(g_fused, g_direct)


# --- task heads on the decoder ----------------------------------------------------------------------
@pytest.mark.parametrize("head", ["classification", "qa", "tagging"])
def test_decoder_task_heads_read_the_decoder_fed_the_input_shifted_right(head):
    num_labels = {"classification": 3, "qa": 2, "tagging": 4}[head]
    model = perturbed(tiny(head=head, num_labels=num_labels, task_stack="decoder"))
    x, mask = rows_with_eos()
    with torch.no_grad():
        got = model(x, attention_mask=mask).logits
        h = model.transformer.decode(shift_right(x), memory=model.transformer.encode(x, mask), memory_mask=mask)
        want = model.head(h, mask, input_ids=x)
        explicit = model(x, attention_mask=mask, decoder_input_ids=shift_right(x)).logits
        encoder_side = perturbed(tiny(head=head, num_labels=num_labels))(x, attention_mask=mask).logits
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(explicit, got)
    assert not torch.allclose(encoder_side, got)  # the default (T5-style) reads the encoder


@pytest.mark.parametrize("head", ["classification", "qa"])
def test_padding_does_not_leak_into_decoder_task_heads(head):
    """Whatever the padded positions hold, the real positions' outputs (and the state at each last EOS) stay."""
    model = perturbed(tiny(head=head, num_labels=2, task_stack="decoder"))
    x, mask = rows_with_eos()
    other = torch.where(mask.bool(), x, ids(3, 9, seed=5).clamp(min=3))
    with torch.no_grad():
        a, b = model(x, attention_mask=mask).logits, model(other, attention_mask=mask).logits
    if head == "qa":
        a, b = a[mask.bool()], b[mask.bool()]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_decoder_task_heads_train_every_parameter():
    model = perturbed(tiny(head="classification", num_labels=3, task_stack="decoder"))
    model.train()
    x, mask = rows_with_eos()
    model(x, attention_mask=mask, labels=torch.tensor([0, 2, 1])).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


# --- pooling at the last EOS ----------------------------------------------------------------------------
def test_eos_pooling_classifies_the_state_at_each_rows_last_eos():
    model = perturbed(tiny(head="classification", num_labels=3, task_stack="decoder"))
    assert model.config.sentence_pooling == "eos"  # the default of task_stack='decoder'
    x, mask = rows_with_eos()
    x[0, 2] = EOS  # a second EOS earlier in row 0: the last one counts
    assert last_eos(x, EOS).tolist() == [8, 5, 3]
    with torch.no_grad():
        h = model.transformer.decode(shift_right(x), memory=model.transformer.encode(x, mask), memory_mask=mask)
        v = h[torch.arange(3), torch.tensor([8, 5, 3])]
        head = model.head
        want = head.out(torch.tanh(head.dense(v)))
        got = model(x, attention_mask=mask).logits
    torch.testing.assert_close(got, want)


def test_eos_pooling_names_a_row_without_eos():
    model = perturbed(tiny(head="classification", num_labels=2, task_stack="decoder"))
    x, mask = rows_with_eos()
    x[1] = x[1].masked_fill(x[1] == EOS, 5)
    with pytest.raises(ValueError, match=r"row 1 of input_ids has no EOS token \(id 2\)"):
        model(x, attention_mask=mask)


def test_eos_pooling_on_an_encoder_reads_the_encoder():
    model = perturbed(tiny(arch="encoder", head="classification", num_labels=2, pooling="eos", n_decoder_layers=None))
    x, mask = rows_with_eos()
    with torch.no_grad():
        h = model.transformer.encode(x, mask)
        want = model.head.out(torch.tanh(model.head.dense(h[torch.arange(3), last_eos(x, EOS)])))
        torch.testing.assert_close(model(x, attention_mask=mask).logits, want)


# --- the options are checked ------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,message", [
    (dict(arch="decoder", task_stack="decoder", n_decoder_layers=None), "task_stack='decoder' applies to "
                                                                        "arch='encoder-decoder' only"),
    (dict(head="classification", num_labels=2, task_stack="decoder", eos_token_id=None), "pooling='eos'.*needs "
                                                                                          "eos_token_id"),
    (dict(forced_bos_token_id=V), f"forced_bos_token_id={V} is not a token id"),
    (dict(forced_eos_token_id=-1), "forced_eos_token_id=-1 is not a token id"),
    (dict(task_stack="both"), r"task_stack='both' is not one of \['encoder', 'decoder'\]"),
])
def test_bad_values_are_refused_with_the_key(fields, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**fields)


def test_max_positions_leave_out_the_offset_rows():
    assert tiny().max_positions == 38
    assert tiny(position="sinusoidal", position_offset=0).max_positions == 40
    model = build_model(tiny()).eval()
    x = ids(1, 38)
    with torch.no_grad():
        model(x, decoder_input_ids=x)  # 38 positions fit
        with pytest.raises(ValueError, match="learned position table has 40 rows"):
            model(ids(1, 39), decoder_input_ids=x)


# --- forced first and last tokens in generation -------------------------------------------------------
@pytest.mark.parametrize("options", [{}, dict(num_beams=3), dict(do_sample=True, seed=1)],
                         ids=["greedy", "beam3", "sample"])
def test_forced_tokens_open_and_close_every_row(options):
    model = with_bias(tiny(logit_bias=True, forced_bos_token_id=0, forced_eos_token_id=EOS))
    x, mask = rows_with_eos()
    out = generate(model, x, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=PAD, **options)
    assert out.shape == (3, 7)
    assert (out[:, 0] == START).all() and (out[:, 1] == 0).all() and (out[:, -1] == EOS).all()
    free = generate(model, x, mask, max_new_tokens=6, eos_token_id=[], forced_bos_token_id=7, **options)
    assert (free[:, 1] == 7).all()  # an argument overrides the config


def test_forced_bos_needs_a_one_token_start():
    """transformers forces it when the sequence so far is one token: a decoder's longer prompt is left alone."""
    cfg = ModelConfig(arch="decoder", head="lm", vocab_size=V, dim=32, n_layers=2, n_heads=4, ffn_dim=48,
                      max_seq_len=40, dropout=0.0, attn_dropout=0.0, token_types=0, forced_bos_token_id=0)
    model = perturbed(cfg)
    one = generate(model, ids(2, 1), max_new_tokens=3, eos_token_id=[])
    assert (one[:, 1] == 0).all()
    prompt = ids(2, 4)
    longer = generate(model, prompt, max_new_tokens=3, eos_token_id=[])
    plain = generate(perturbed(cfg.replace(forced_bos_token_id=None)), prompt, max_new_tokens=3, eos_token_id=[])
    assert torch.equal(longer, plain)
