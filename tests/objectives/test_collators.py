"""Objectives checked by their invariants *through* ``objective.example`` / ``collate`` / ``counts`` /
``loss``, on real text (Austen + Wikipedia) tokenized into a token store and packed into blocks, with
fixed seeds. The pure corruption functions (masking.py, t5.py, bart.py) have their own tests; these
check that each objective wires them up right: special tokens, segments, EOS, decoder inputs, the
Trainer's dynamic/static randomness, ELECTRA's shared embeddings and the loss normalisation."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pretune
from pretune.data.packing import Block, pack_blocks
from pretune.data.readers import iter_documents
from pretune.data.store import build_store
from pretune.io.tokenization import Tokenizer
from pretune.objectives import IGNORE, build_objective, objective_settings, t5
from pretune.objectives.encoder import Electra
from pretune.runconfig import TrainConfig
from pretune.train.loop import ExampleSet, Trainer

MAX_SEQ_LEN = 64  # tiny models read at most 64 positions, so NSP/SOP pairs get truncated
N_BLOCKS = 300


@pytest.fixture(scope="module")
def wp(small_corpus, tokenizers_by_kind, tmp_path_factory):
    """The wordpiece tokenizer and a token store of the small corpus; ``blocks(size, mode)`` packs it."""
    tok = Tokenizer.load(tokenizers_by_kind["wordpiece"])
    store = build_store(iter_documents([small_corpus]), tok.tk, tmp_path_factory.mktemp("store"),
                        show_progress=False)

    def blocks(size: int, mode: str = "full", n: int = N_BLOCKS, sep: int | None = None) -> list[Block]:
        index = pack_blocks(store, block_size=size, mode=mode, doc_sep_id=sep if mode == "full" else None)
        ids = np.flatnonzero(index.lengths >= 4)  # as pretrain: 1-3 token tails carry no signal
        ids = ids[np.linspace(0, len(ids) - 1, min(n, len(ids))).astype(int)]  # spread over both sources
        return [index[int(i)] for i in ids]

    return SimpleNamespace(tok=tok, store=store, blocks=blocks)


def _model(preset: str, tok: Tokenizer, **kw):
    return pretune.build_model(preset, vocab_size=tok.vocab_size, max_seq_len=MAX_SEQ_LEN, dropout=0.0,
                               attn_dropout=0.0, **kw).eval()


def _objective(name: str, preset: str, tok: Tokenizer, **cfg):
    model = _model(preset, tok)
    return build_objective(objective_settings(name=name, **cfg), model, tok), model


def _rng(i: int, epoch: int = 0, seed: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, i])  # the Trainer's per-example generator


def _original(ex: dict):
    """The uncorrupted input of an example (numpy) or batch (torch): labels where selected, the input elsewhere."""
    labels = ex["labels"]
    if isinstance(labels, torch.Tensor):
        return torch.where(labels != IGNORE, labels, ex["input_ids"])
    return np.where(labels != IGNORE, labels, ex["input_ids"])


# -- masked LM --------------------------------------------------------------------------------------


def test_mlm_selects_15_percent_of_non_special_tokens_split_80_10_10(wp):
    tok = wp.tok
    objective, _ = _objective("mlm", "tiny-bert-base", tok)
    blocks = wp.blocks(objective.block_size(MAX_SEQ_LEN), sep=objective.doc_separator())
    special = np.array(sorted(tok.special_ids))
    n_maskable = n_selected = n_mask = n_kept = n_random = 0
    for i, block in enumerate(blocks):
        ex = objective.example(block, _rng(i), None)
        ids, labels = ex["input_ids"], ex["labels"]
        original = np.concatenate([[tok.cls_id], block.tokens, [tok.sep_id]])
        assert len(ids) == len(block.tokens) + 2 <= MAX_SEQ_LEN
        assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id  # [CLS] at 0, [SEP] at the end, never selected
        sel = labels != IGNORE
        maskable = ~np.isin(original, special)
        assert not (sel & ~maskable).any()  # no special token (incl. document separators) is ever selected
        np.testing.assert_array_equal(labels[sel], original[sel])  # labels are the uncorrupted tokens
        np.testing.assert_array_equal(ids[~sel], original[~sel])  # only selected positions change
        assert not np.isin(ids[sel & (ids != tok.mask_id)], special).any()  # random tokens are never special
        assert (ex["attention_mask"] == 1).all()
        n_maskable += maskable.sum()
        n_selected += sel.sum()
        n_mask += (ids[sel] == tok.mask_id).sum()
        n_kept += (ids[sel] == original[sel]).sum()
        n_random += ((ids[sel] != tok.mask_id) & (ids[sel] != original[sel])).sum()
    assert abs(n_selected / n_maskable - 0.15) < 0.005, n_selected / n_maskable
    assert n_selected > 2000  # enough for the shares below to be within ±1.5% (≥ 2.5 standard errors)
    for share, want in ((n_mask, 0.8), (n_random, 0.1), (n_kept, 0.1)):
        assert abs(share / n_selected - want) < 0.015, (share / n_selected, want)


@pytest.mark.parametrize("dynamic", [True, False])
def test_trainer_masks_dynamically_per_epoch_or_statically(wp, tmp_path, dynamic):
    objective, model = _objective("mlm", "tiny-bert-base", wp.tok, dynamic=dynamic)
    blocks = wp.blocks(objective.block_size(MAX_SEQ_LEN), n=32, sep=objective.doc_separator())
    data = ExampleSet(get=blocks.__getitem__, train_ids=np.arange(len(blocks)), eval_ids=np.arange(0))
    trainer = Trainer(model=model, objective=objective, data=data, cfg=TrainConfig(batch_size=8, seed=3),
                      run_dir=tmp_path, show_progress=False)
    ids = np.arange(16)
    e0, e0_again, e1 = trainer.make_batch(ids, 0), trainer.make_batch(ids, 0), trainer.make_batch(ids, 1)
    for a, b in zip(e0.values(), e0_again.values()):
        assert torch.equal(a, b)  # a pure function of (seed, epoch, id)
    torch.testing.assert_close(_original(e0).float(), _original(e1).float(), rtol=0, atol=0)  # same blocks
    same_rows = [torch.equal(e0["labels"][r], e1["labels"][r]) and torch.equal(e0["input_ids"][r], e1["input_ids"][r])
                 for r in range(len(ids))]
    if dynamic:
        assert not any(same_rows)  # RoBERTa: a new mask every time a block is seen
    else:
        assert all(same_rows)  # BERT: the same mask every epoch


def test_whole_word_masking_never_splits_a_word(wp):
    tok = wp.tok
    objective, _ = _objective("mlm", "tiny-bert-base", tok, whole_word=True)
    blocks = wp.blocks(objective.block_size(MAX_SEQ_LEN), sep=objective.doc_separator())
    continuation = np.array([t.startswith("##") for t in (tok.id_to_token(i) for i in range(tok.vocab_size))])
    special = np.array(sorted(tok.special_ids))
    n_maskable = n_selected = n_pieces = 0
    for i, block in enumerate(blocks):
        ex = objective.example(block, _rng(i), None)
        original = _original(ex)
        sel = ex["labels"] != IGNORE
        maskable = ~np.isin(original, special)
        inside = continuation[original[1:]] & maskable[:-1]  # token t+1 continues the word of token t
        np.testing.assert_array_equal(sel[1:][inside], sel[:-1][inside])  # a word is all in or all out
        n_maskable += maskable.sum()
        n_selected += sel.sum()
        n_pieces += (sel[1:] & inside).sum()
    assert n_pieces > 50  # multi-piece words were selected, so the check above had something to check
    assert 0.14 < n_selected / n_maskable <= 0.155, n_selected / n_maskable  # whole words fill the 15% budget


# -- NSP / SOP ----------------------------------------------------------------------------------------


def _contains(haystack: np.ndarray, needle: np.ndarray) -> bool:
    if len(needle) > len(haystack):
        return False
    windows = np.lib.stride_tricks.sliding_window_view(haystack, len(needle))
    return bool((windows == needle).all(axis=1).any())


@pytest.mark.parametrize("task", ["nsp", "sop"])
def test_sentence_pair_objectives(wp, task):
    tok = wp.tok
    objective, _ = _objective(task, "tiny-bert-base", tok)
    size = objective.block_size(MAX_SEQ_LEN)
    assert size == MAX_SEQ_LEN - 3  # [CLS] A [SEP] B [SEP]
    blocks = wp.blocks(size, mode="doc", n=1000)
    random_block = lambda r: blocks[int(r.integers(len(blocks)))]
    labels, lengths, examples = [], [], []
    for i, block in enumerate(blocks):
        ex = objective.example(block, _rng(i), random_block)
        ids, types, label = ex["input_ids"], ex["token_type_ids"], int(ex["pair_labels"])
        seps = np.flatnonzero(ids == tok.sep_id)
        assert ids[0] == tok.cls_id and len(seps) == 2 and seps[1] == len(ids) - 1
        a_end = seps[0]
        assert 1 < a_end < len(ids) - 2  # both segments non-empty
        np.testing.assert_array_equal(types[: a_end + 1], 0)  # [CLS] A [SEP]
        np.testing.assert_array_equal(types[a_end + 1:], 1)  # B [SEP]
        original = _original(ex)
        a, b = original[1:a_end], original[a_end + 1:-1]
        if label == 0:  # IsNext / in order: the block itself (it fits, so nothing was truncated)
            np.testing.assert_array_equal(np.concatenate([a, b]), block.tokens)
        elif task == "sop":  # swapped: B then A is the block
            np.testing.assert_array_equal(np.concatenate([b, a]), block.tokens)
        else:  # NotNext: A is a (possibly truncated) piece of the block, B another block's text
            assert _contains(block.tokens, a)
        labels.append(label)
        lengths.append(len(ids))
        examples.append(ex)
    assert abs(np.mean(labels) - 0.5) < 0.05, np.mean(labels)
    assert max(lengths) <= MAX_SEQ_LEN
    if task == "nsp":
        assert max(lengths) == MAX_SEQ_LEN  # a long random B was truncated to fit

    batch = objective.collate(examples[:8])
    width = max(lengths[:8])
    assert batch["input_ids"].shape == batch["token_type_ids"].shape == (8, width)
    torch.testing.assert_close(batch["pair_labels"], torch.tensor(labels[:8]))
    pad = batch["attention_mask"] == 0
    assert (batch["input_ids"][pad] == tok.pad_id).all() and (batch["labels"][pad] == IGNORE).all()
    assert (batch["token_type_ids"][pad] == 0).all()
    assert objective.counts(batch) == {"mlm": int((batch["labels"] != IGNORE).sum()), task: 8}


# -- ELECTRA ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def electra(wp):
    objective, model = _objective("electra", "tiny-electra-small", wp.tok)
    blocks = wp.blocks(objective.block_size(MAX_SEQ_LEN), n=12, sep=objective.doc_separator())
    batch = objective.collate([objective.example(b, _rng(i), None) for i, b in enumerate(blocks)])
    return SimpleNamespace(objective=objective, model=model, batch=batch)


def test_electra_replaced_labels_equal_corrupted_differs_from_original(electra):
    objective, batch = electra.objective, electra.batch
    selected = batch["labels"] != IGNORE
    with torch.no_grad():
        h = objective.generator.transformer.encode(batch["input_ids"], batch["attention_mask"])
        logits = objective.generator.head(h[selected])  # (N, vocab)
    logits[::2] = -1e4
    logits[::2].scatter_(1, batch["labels"][selected][::2, None], 1e4)  # every other sample is the original
    torch.manual_seed(0)
    original, corrupted, is_replaced = Electra.replace(batch, logits)
    torch.testing.assert_close(original, _original(batch), rtol=0, atol=0)
    torch.testing.assert_close(is_replaced, (corrupted != original).float(), rtol=0, atol=0)
    assert torch.equal(corrupted[~selected], batch["input_ids"][~selected])  # unmasked positions never change
    assert not is_replaced[~selected].any()
    forced = torch.zeros_like(selected)
    forced[selected.nonzero()[::2].unbind(1)] = True
    assert not is_replaced[forced].any()  # sampling the original token counts as original
    assert is_replaced[selected & ~forced].mean() > 0.9  # a random-init generator rarely guesses right


def test_electra_generator_shares_the_discriminator_embeddings(electra):
    gen, disc = electra.objective.generator, electra.model
    assert gen.transformer.embed.weight.data_ptr() == disc.transformer.embed.weight.data_ptr()
    assert gen.head.weight is disc.transformer.embed.weight  # the generator's tied output layer too
    for part in ("position", "token_type"):  # Clark et al. 2020 §3.2: all input embeddings are shared
        assert getattr(gen.transformer.input_stack, part) is getattr(disc.transformer.input_stack, part)
    assert gen.config.dim < disc.config.dim  # ELECTRA: a smaller generator
    own = {id(p) for p in disc.parameters()}
    assert any(id(p) not in own for p in gen.parameters())  # ... with layers of its own


def test_electra_one_loss_backpropagates_into_generator_and_discriminator(electra):
    objective, model, batch = electra.objective, electra.model, electra.batch
    model.zero_grad()
    objective.zero_grad()
    loss, stats = objective.loss(model, batch, objective.counts(batch))
    loss.backward()
    assert stats["replaced"] > 0 and stats["mlm_loss"] > 0 and stats["rtd_loss"] > 0

    def has_grad(module):
        return all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())

    assert has_grad(objective.generator.transformer.encoder)  # the MLM term
    assert has_grad(model.transformer.encoder)  # the replaced-token-detection term
    assert has_grad(model.head)  # the discriminator's own RTD head (saved with it: ElectraForPreTraining)
    assert model.transformer.embed.weight.grad.abs().sum() > 0  # shared: both terms reach it


# -- T5 span corruption, BART denoising ---------------------------------------------------------------

T5_SENTENCE = "Thank you for inviting me to your party last week ."


@pytest.fixture(scope="module")
def unigram(tokenizers_by_kind):
    tok = Tokenizer.load(tokenizers_by_kind["unigram"])
    ids = np.array(tok.encode(T5_SENTENCE), dtype=np.int64)
    return SimpleNamespace(tok=tok, ids=ids, block=Block(tokens=ids, sent_starts=np.array([0]), doc_id=0))


@pytest.mark.parametrize("name", ["span", "iid_spans"])
def test_t5_span_example_round_trips_to_the_sentence(unigram, name):
    tok, ids = unigram.tok, unigram.ids
    objective, model = _objective(name, "tiny-t5-small", tok)
    start = model.config.decoder_start_token_id
    decoder_only, _ = _objective(name, "tiny-gpt2", tok)
    corrupted = 0
    for seed in range(20):
        ex = objective.example(unigram.block, _rng(seed), None)
        src, labels = ex["input_ids"], ex["labels"]
        assert src[-1] == tok.eos_id and labels[-1] == tok.eos_id
        assert tok.eos_id not in src[:-1] and tok.eos_id not in labels[:-1]
        np.testing.assert_array_equal(ex["decoder_input_ids"], np.concatenate([[start], labels[:-1]]))
        assert (ex["attention_mask"] == 1).all() and len(ex["decoder_attention_mask"]) == len(labels)
        assert labels[0] == tok.sentinel_ids[0]
        corrupted += np.isin(src, tok.sentinel_ids).any()
        np.testing.assert_array_equal(t5.merge_span_corruption(src[:-1], labels[:-1], tok.sentinel_ids), ids)

        dec = decoder_only.example(unigram.block, _rng(seed), None)  # same rng: same corruption
        n = len(src)
        np.testing.assert_array_equal(dec["input_ids"], np.concatenate([src, labels]))  # source EOS target EOS
        assert int(dec["prefix_lengths"]) == n
        assert (dec["labels"][:n] == IGNORE).all()
        np.testing.assert_array_equal(dec["labels"][n:], labels)
    assert corrupted == 20 if name == "span" else corrupted >= 15  # i.i.d. noise may leave 22 tokens untouched
    assert tok.decode(ids) == T5_SENTENCE  # the unigram tokenizer keeps the paper's sentence intact


@pytest.mark.parametrize("noise", [
    {},  # BART's defaults here: infilling (30%, Poisson 3) + sentence permutation
    {"mask_ratio": 0.1, "delete_ratio": 0.1, "rotate": True, "permute_sentences": False},
])
@pytest.mark.parametrize("preset", ["tiny-t5-small", "tiny-gpt2"])
def test_bart_denoise_targets_are_the_original_block(wp, noise, preset):
    tok = wp.tok
    objective, model = _objective("denoise", preset, tok, **noise)
    decoder_only = preset == "tiny-gpt2"
    blocks = wp.blocks(objective.block_size(MAX_SEQ_LEN), n=50, sep=objective.doc_separator())
    changed = 0
    for i, block in enumerate(blocks):
        ex = objective.example(block, _rng(i), None)
        if decoder_only:
            prefix = int(ex["prefix_lengths"])
            assert (ex["labels"][:prefix] == IGNORE).all() and len(ex["input_ids"]) <= MAX_SEQ_LEN
            source, labels = ex["input_ids"][:prefix], ex["labels"][prefix:]
        else:
            source, labels = ex["input_ids"], ex["labels"]
            np.testing.assert_array_equal(ex["decoder_input_ids"],
                                          np.concatenate([[model.config.decoder_start_token_id], labels[:-1]]))
        assert source[-1] == tok.eos_id and labels[-1] == tok.eos_id
        np.testing.assert_array_equal(labels[:-1], block.tokens)
        changed += not np.array_equal(source[:-1], block.tokens)
    assert changed > 0.9 * len(blocks)


# -- causal LM, loss normalisation ---------------------------------------------------------------------


def test_causal_lm_labels_come_from_the_input_and_counts_are_real_targets(wp):
    tok = wp.tok
    objective, model = _objective("clm", "tiny-gpt2", tok)
    blocks = wp.blocks(MAX_SEQ_LEN, mode="doc", n=8)
    assert len({len(b.tokens) for b in blocks}) > 1  # ragged, so the batch is padded
    batch = objective.collate([objective.example(b, _rng(i), None) for i, b in enumerate(blocks)])
    assert set(batch) == {"input_ids", "attention_mask"}  # no labels: targets are the next input tokens
    assert objective.counts(batch) == {"lm": sum(len(b.tokens) - 1 for b in blocks)}
    for row, b in zip(batch["input_ids"], blocks):
        assert row[: len(b.tokens)].tolist() == b.tokens.tolist()
        assert (row[len(b.tokens):] == tok.pad_id).all()

    with torch.no_grad():
        loss, _ = objective.loss(model, batch, objective.counts(batch))
        logits = model(batch["input_ids"], batch["attention_mask"]).logits
        targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 sums in another order: ~1e-7 relative
        pad = batch["attention_mask"] == 0
        other = dict(batch, input_ids=batch["input_ids"].masked_fill(pad, tok.mask_id))  # other ids under the pads
        assert abs(objective.loss(model, other, objective.counts(other))[0].item() - loss.item()) < 1e-6


def test_mlm_loss_is_the_mean_over_masked_tokens_of_the_whole_step(wp):
    objective, model = _objective("mlm", "tiny-bert-base", wp.tok)
    blocks = wp.blocks(MAX_SEQ_LEN - 2, mode="doc", n=8)
    examples = [objective.example(b, _rng(i), None) for i, b in enumerate(blocks)]
    batch = objective.collate(examples)
    totals = objective.counts(batch)
    with torch.no_grad():
        loss, stats = objective.loss(model, batch, totals)
        logits = model(batch["input_ids"], batch["attention_mask"]).logits  # (B, T, vocab)
        ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 sums in another order: ~1e-7 relative
        assert abs(stats["mlm_loss"] - ref.item() * totals["mlm"]) < 1e-3  # logged as a sum
        # two micro-batches, each divided by the whole step's count, add up to the one-batch loss
        parts = [objective.collate(examples[:3]), objective.collate(examples[3:])]
        assert sum(objective.counts(p)["mlm"] for p in parts) == totals["mlm"]
        split = sum(objective.loss(model, p, totals)[0].item() for p in parts)
        assert abs(split - loss.item()) < 1e-5


def test_seq2seq_loss_is_the_mean_over_target_tokens(unigram, wp):
    objective, model = _objective("span", "tiny-t5-small", unigram.tok)
    tok = unigram.tok
    texts = [T5_SENTENCE, "It is a truth universally acknowledged .", "The party was last week , not this one ."]
    blocks = [Block(tokens=np.array(tok.encode(t)), sent_starts=np.array([0]), doc_id=0) for t in texts]
    batch = objective.collate([objective.example(b, _rng(i), None) for i, b in enumerate(blocks)])
    n_targets = int(batch["decoder_attention_mask"].sum())
    assert objective.counts(batch) == {"lm": n_targets}
    with torch.no_grad():
        loss, _ = objective.loss(model, batch, objective.counts(batch))
        logits = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=batch["decoder_input_ids"],
                       decoder_attention_mask=batch["decoder_attention_mask"]).logits
        ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # fp32 sums in another order: ~1e-7 relative
