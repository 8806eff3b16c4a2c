"""A tiny random decoder with a tiny byte-level BPE tokenizer and a ChatML chat template, saved as a pretune
checkpoint folder: what the server and batching tests serve (seconds to build, milliseconds a token)."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife.", "The capital of France is Paris. What is the capital of Spain? Madrid, said she.",
        "Once upon a time there was a little model that wrote random words, and everyone was very pleased."] * 20


def tiny_tokenizer():
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from pretune.io.tokenization import Tokenizer

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(TEXT, trainer)
    tok = Tokenizer(tk, roles={"eos": "<|im_end|>", "pad": "<|endoftext|>"})
    tok.chat_template = TEMPLATE
    return tok


def tiny_chat_model(folder: Path, *, seed: int = 0, max_seq_len: int = 128):
    """Save a random tiny-llama with the tiny tokenizer in ``folder``; returns (model, tokenizer)."""
    import torch

    import pretune
    from pretune.io.checkpoint import save
    from pretune.presets import get_preset

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = get_preset("tiny-llama", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id,
                     max_seq_len=max_seq_len)
    model = pretune.build_model(cfg).eval()
    with torch.no_grad():  # larger weights than the init's: peaked distributions, no near-ties between tokens
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    save(model, folder, tokenizer=tok)
    return model, tok
