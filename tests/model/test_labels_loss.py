"""``model(..., labels=...).loss`` equals transformers' ``model(**batch).loss`` for every head, computed through the
fused LM head (no logits unless asked) and on the labelled rows only."""

import pytest
import torch

import pretune

transformers = pytest.importorskip("transformers")
T = transformers
V = 97


def _random(hf):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return hf.eval()


def _pair(hf, tmp_path):
    hf = _random(hf)
    hf.save_pretrained(tmp_path / "hf")
    return hf, pretune.from_hf(tmp_path / "hf").eval()


BERT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def _batch(labelled: float, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if labelled < 1:
        labels = labels.masked_fill(torch.rand(ids.shape, generator=g) > labelled, -100)
    return ids, mask, labels


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-tied"])
def test_causal_lm_loss_matches_transformers(name, tmp_path):
    hf_cls = {"gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4)),
              "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA)),
              "llama-tied": lambda: T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, tie_word_embeddings=True))}[name]
    hf, ours = _pair(hf_cls(), tmp_path)
    for labelled in (1.0, 0.3):  # every token, and completion-only style labels
        ids, mask, labels = _batch(labelled)
        want = hf(input_ids=ids, attention_mask=mask, labels=labels)
        got = ours(ids, attention_mask=mask, labels=labels)
        assert got.logits is None  # not asked for: never built
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        both = ours(ids, attention_mask=mask, labels=labels, return_logits=True)
        torch.testing.assert_close(both.logits[mask.bool()], want.logits[mask.bool()], atol=1e-4, rtol=1e-4)


def test_gradients_match_transformers(tmp_path):
    hf, ours = _pair(T.LlamaForCausalLM(T.LlamaConfig(**LLAMA)), tmp_path)
    ids, mask, labels = _batch(0.5)
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ours(ids, attention_mask=mask, labels=labels).loss.backward()
    torch.testing.assert_close(ours.transformer.embed.weight.grad, hf.model.embed_tokens.weight.grad,
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.head.weight.grad, hf.lm_head.weight.grad, atol=1e-5, rtol=1e-4)


def test_masked_lm_loss_on_labelled_rows_matches_transformers(tmp_path):
    hf, ours = _pair(T.BertForMaskedLM(T.BertConfig(**BERT)), tmp_path)
    ids, mask, labels = _batch(0.15)
    assert 0 < int((labels != -100).sum()) < 12
    want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).loss, want, atol=1e-5, rtol=1e-5)


def test_encoder_decoder_loss_shifts_labels_like_transformers(tmp_path):
    cfg = T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=20, decoder_start_token_id=0,
                     pad_token_id=0)
    hf, ours = _pair(T.T5ForConditionalGeneration(cfg), tmp_path)
    ids, mask, _ = _batch(1.0)
    labels = torch.randint(3, V, (3, 5), generator=torch.Generator().manual_seed(2))
    labels[2, 3:] = -100
    want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours(ids, attention_mask=mask, labels=labels).loss, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["single", "regression", "multi_label", "tagging"])
def test_task_head_losses_match_transformers(kind, tmp_path):
    g = torch.Generator().manual_seed(3)
    ids, mask, _ = _batch(1.0)
    if kind == "tagging":
        hf = T.BertForTokenClassification(T.BertConfig(**BERT, num_labels=5))
        labels = torch.randint(0, 5, ids.shape, generator=g).masked_fill(mask == 0, -100)
    elif kind == "regression":
        hf = T.BertForSequenceClassification(T.BertConfig(**BERT, num_labels=1))
        labels = torch.randn(3, generator=g)
    elif kind == "multi_label":
        hf = T.BertForSequenceClassification(T.BertConfig(**BERT, num_labels=4,
                                                          problem_type="multi_label_classification"))
        labels = torch.randint(0, 2, (3, 4), generator=g).float()
    else:
        hf = T.BertForSequenceClassification(T.BertConfig(**BERT, num_labels=3))
        labels = torch.randint(0, 3, (3,), generator=g)
    hf, ours = _pair(hf, tmp_path)
    want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    out = ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=1e-5)
    assert out.logits is None


def test_labels_without_a_head_or_on_qa_are_refused():
    ids = torch.randint(3, V, (2, 5))
    with pytest.raises(ValueError, match="no head"):
        pretune.build_model("tiny-bert-base", vocab_size=V, head="none")(ids, labels=ids)
    qa = pretune.build_model("tiny-bert-base", vocab_size=V, head="qa", num_labels=2)
    with pytest.raises(ValueError, match="start and end positions"):
        qa(ids, labels=ids[:, 0])
