"""The training FLOPs of an objective's step (objectives/flops.py), counted on real text against a direct count
of the matrix products: masked LM exactly (body, attention, the head on the masked positions; the backward twice
the forward), ELECTRA as masked LM's discriminator work plus its generator, T5 objectives by their target lengths;
and counting leaves the caller's gradients and random state as they were."""

import numpy as np
import pytest
import torch
from torch import nn

import pretune
from pretune.data.packing import pack_blocks
from pretune.data.readers import iter_documents
from pretune.data.store import build_store
from pretune.io.tokenization import Tokenizer
from pretune.objectives import IGNORE, build_objective, objective_settings
from pretune.objectives.flops import step_flops

SEQ = 32  # model positions; blocks fill them, so every row is full (no padding)
BATCH = 4


def _batch(kind, small_corpus, tokenizers_by_kind, tmp_path, name, preset, **cfg):
    tok = Tokenizer.load(tokenizers_by_kind[kind])
    model = pretune.build_model(preset, vocab_size=tok.vocab_size, max_seq_len=SEQ, dropout=0.0, attn_dropout=0.0)
    objective = build_objective(objective_settings(name=name, **cfg), model, tok)
    store = build_store(iter_documents([small_corpus]), tok.tk, tmp_path / "store", show_progress=False)
    size = objective.block_size(SEQ)
    index = pack_blocks(store, block_size=size, mode="full", doc_sep_id=objective.doc_separator())
    full = [int(i) for i in np.flatnonzero(index.lengths == size)[:BATCH]]
    rng = np.random.default_rng(0)
    examples = [objective.example(index[i], rng, lambda r: index[full[0]]) for i in full]
    return model, objective, objective.collate(examples)


def _linear_macs(module: nn.Module) -> int:
    """Multiply-adds of one token through every Linear of ``module``."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def test_masked_lm_step_equals_a_direct_count(small_corpus, tokenizers_by_kind, tmp_path):
    model, objective, batch = _batch("wordpiece", small_corpus, tokenizers_by_kind, tmp_path, "mlm", "tiny-bert-base")
    cfg = model.config
    B, T = batch["input_ids"].shape
    assert (B, T) == (BATCH, SEQ) and bool(batch["attention_mask"].all())
    n_masked = int((batch["labels"] != IGNORE).sum())
    body = 2 * B * T * _linear_macs(model.transformer)  # every token through every projection and FFN
    attention = cfg.n_layers * 2 * (2 * B * T * T * cfg.dim)  # scores q k^T and the values, per layer
    head_macs = _linear_macs(model.head) + (0 if any(isinstance(m, nn.Linear) and m.out_features == cfg.vocab_size
                                                     for m in model.head.modules()) else cfg.dim * cfg.vocab_size)
    head = 2 * n_masked * head_macs  # the head runs on the masked positions only (tied decoder included)
    got = step_flops(objective, model, batch)
    assert got.forward == body + attention + head
    # each product's backward: the gradient of its input and of its weight (2x); attention's (torch's SDPA formula)
    # recomputes the scores too: 5 products against the forward's 2
    assert got.backward == 2 * (got.forward - attention) + attention * 5 // 2


def test_electra_counts_its_generator(small_corpus, tokenizers_by_kind, tmp_path):
    model, objective, batch = _batch("wordpiece", small_corpus, tokenizers_by_kind, tmp_path, "electra",
                                     "tiny-electra-base")
    mlm = build_objective(objective_settings(name="mlm"), model.with_head(head="mlm"), objective.tok)
    disc = step_flops(mlm, model.with_head(head="mlm"), batch)  # the same body on the same tokens, an MLM head
    got = step_flops(objective, model, batch)
    B, T = batch["input_ids"].shape
    generator = 3 * 2 * B * T * _linear_macs(objective.generator.transformer)  # forward + backward of its body
    body = 3 * 2 * B * T * _linear_macs(model.transformer)
    assert got.total > body + generator  # discriminator and generator bodies, their heads and attention on top
    assert got.total > disc.total  # ELECTRA's step costs more than masked LM's on the same discriminator
    assert got.total < 2 * disc.total  # ... but the generator is a quarter as wide
    assert step_flops(objective, model, batch) == got  # the count does not depend on the samples drawn


@pytest.mark.parametrize("short,long", [("span", "bert_style"), ("drop_tokens", "deshuffle")])
def test_t5_objectives_cost_by_their_target_length(small_corpus, tokenizers_by_kind, tmp_path, short, long):
    """The decoder reads the target: span corruption and token dropping (targets of ~15-25 % of the block) cost
    less per step than BERT-style and deshuffling (the whole block)."""
    counts = {}
    for name in (short, long):
        model, objective, batch = _batch("unigram", small_corpus, tokenizers_by_kind, tmp_path / name, name,
                                         "tiny-t5-small")
        counts[name] = step_flops(objective, model, batch).total
    assert counts[short] < 0.8 * counts[long]


def test_counting_leaves_gradients_and_random_state(small_corpus, tokenizers_by_kind, tmp_path):
    model, objective, batch = _batch("wordpiece", small_corpus, tokenizers_by_kind, tmp_path, "electra",
                                     "tiny-electra-base")
    p = next(model.parameters())
    p.grad = torch.full_like(p, 0.5)  # a gradient being accumulated
    torch.manual_seed(3)
    state = torch.get_rng_state()
    step_flops(objective, model, batch)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(p.grad, torch.full_like(p, 0.5))
    assert all(q.grad is None for q in objective.generator.parameters() if q is not p)
