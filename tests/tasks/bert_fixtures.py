"""Shared by the embedding and rerank task tests: a tiny random-weight BERT saved as a Hugging Face folder that
pretune and sentence-transformers both read, and pretune's model of it."""

from __future__ import annotations

from pathlib import Path


def tiny_bert_folder(d: Path, words, build, **config) -> Path:
    """``build(BertConfig)`` (a transformers BERT class: dim 32, 2 layers, 4 heads, no dropout; ``config``: more
    BertConfig fields) with every parameter perturbed, and a word-level WordPiece vocabulary of the special tokens and
    ``words``, saved in ``d``; returns ``d``."""
    import torch
    import transformers

    vocab = list(dict.fromkeys(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    tok = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, **config)
    torch.manual_seed(0)
    hf = build(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.2 * torch.randn_like(p))
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def load_tiny(folder: Path):
    """(model, tokenizer) as pretune loads ``folder``, checked to read the tests' words as words (no [UNK])."""
    from pretune.loading import load_pretrained

    loaded = load_pretrained(folder)
    assert loaded.tokenizer.unk_id not in loaded.tokenizer.encode("the cat sat on the mat")  # real words, no [UNK]
    return loaded.model, loaded.tokenizer
