"""The NSP/SOP pair head (``pair_head``): a 2-way classifier on the pooler output beside the MLM head (ALBERT's
sentence-order head, AlbertForPreTraining's ``sop_classifier``). Off by default; it needs the pooler and the MLM head;
its logits read only the real tokens; a task head replaces it; checkpoints keep it; and the nsp/sop objectives train
the model's own head instead of a pretraining-only one when the model has it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pretune
from pretune import ConfigError, ModelConfig, build_model
from pretune.objectives import build_objective, objective_settings
from pretune.presets import PRESETS

V = 64


def tiny(**kw) -> ModelConfig:
    base = dict(arch="encoder", vocab_size=V, dim=32, n_layers=3, n_heads=4, ffn_dim=48, max_seq_len=32,
                embed_dim=16, share_layers=True, ffn="gelu_tanh", head_act="gelu_tanh", dropout=0.0,
                attn_dropout=0.0, pooler=True, pair_head=True)
    return ModelConfig(**{**base, **kw})


def perturbed(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def test_off_by_default_and_only_albert_presets_have_it():
    assert ModelConfig().pair_head is False
    assert build_model("tiny-bert-base").pair_head is None
    assert {n for n, p in PRESETS.items() if p.get("pair_head")} == {
        f"{t}albert-{s}" for t in ("", "tiny-") for s in ("base", "large", "xlarge", "xxlarge")}


@pytest.mark.parametrize("change,match", [(dict(pooler=False), "pooler=True"),
                                          (dict(head="none"), "head='mlm'"),
                                          (dict(head="classification", num_labels=2), "head='mlm'")])
def test_needs_the_pooler_and_the_mlm_head(change, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**change)


def test_pair_logits_are_the_pair_head_on_the_pooler_output():
    model = perturbed(build_model(tiny()))
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(1))
    without = build_model(tiny(pair_head=False)).eval()
    without.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("pair_head.")})
    with torch.no_grad():
        out = model(ids)
        off = without(ids)
    assert out.pair_logits.shape == (3, 2) and off.pair_logits is None
    torch.testing.assert_close(out.pair_logits, model.pair_head(out.pooler_output))
    torch.testing.assert_close(out.pooler_output, torch.tanh(model.pooler.dense(out.last_hidden_state[:, 0])))
    # the body and the MLM head are the same with or without the pair head (same weights)
    torch.testing.assert_close(off.logits, out.logits)


def test_padding_does_not_leak_into_the_pair_logits():
    model = perturbed(build_model(tiny()))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 10), generator=g)
    types = (torch.arange(10) >= 5).long().expand(2, -1)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, token_type_ids=types).pair_logits
        alone = model(ids[1:, :6], token_type_ids=types[1:, :6]).pair_logits
        noisy = model(ids.masked_fill(mask == 0, 7), attention_mask=mask, token_type_ids=types).pair_logits
    torch.testing.assert_close(batch[1:], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(noisy, batch, atol=1e-6, rtol=1e-6)


def test_a_task_head_replaces_it_and_keeps_the_pooler():
    model = perturbed(build_model(tiny()))
    assert model.with_head(head="mlm") is model
    clf = model.with_head(head="classification", num_labels=3)
    assert not clf.config.pair_head and clf.pair_head is None
    assert torch.equal(clf.pooler.dense.weight, model.pooler.dense.weight)
    assert clf.config.sentence_pooling == "pooler"


def test_checkpoints_keep_it(tmp_path):
    from pretune.io.checkpoint import save

    model = perturbed(build_model(tiny()))
    save(model, tmp_path / "ckpt")
    again = pretune.load(tmp_path / "ckpt")
    assert again.config.pair_head and torch.equal(again.pair_head.weight, model.pair_head.weight)


def _tokenizer():
    """What the sentence-pair objectives read from a tokenizer: [CLS] 1, [SEP] 2, [MASK] 3, [PAD] 0."""
    return SimpleNamespace(cls_id=1, sep_id=2, mask_id=3, pad_id=0, eos_id=None, vocab_size=V,
                           special_ids={0, 1, 2, 3}, word_start_mask=lambda: None)


@pytest.mark.parametrize("name", ["sop", "nsp"])
def test_the_pair_objectives_train_the_models_own_head(name):
    torch.manual_seed(0)
    model = perturbed(build_model(tiny())).train()
    objective = build_objective(objective_settings({"name": name}), model, _tokenizer())
    assert objective.classifier is None and objective.pooler is None  # no pretraining-only copies
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, V, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = ids.masked_fill(torch.rand(ids.shape, generator=g) > 0.3, -100).masked_fill(mask == 0, -100)
    labels[0, 1] = ids[0, 1]  # at least one masked-LM target
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(12) >= 6).long().expand(4, -1),
             "labels": labels, "pair_labels": torch.tensor([0, 1, 1, 0])}
    totals = {k: float(v) for k, v in objective.counts(batch).items()}
    loss, _ = objective.loss(model, batch, totals)
    out = model(ids, attention_mask=mask, token_type_ids=batch["token_type_ids"], labels=labels)
    want = out.loss + torch.nn.functional.cross_entropy(out.pair_logits, batch["pair_labels"])
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert model.pair_head.weight.grad.abs().sum() > 0 and model.pooler.dense.weight.grad.abs().sum() > 0


def test_without_it_the_objective_keeps_its_own_classifier():
    model = build_model(tiny(pair_head=False))
    objective = build_objective(objective_settings({"name": "sop"}), model, _tokenizer())
    assert isinstance(objective.classifier, torch.nn.Linear) and objective.pooler is None
    assert np.prod(objective.classifier.weight.shape) == 2 * 32
