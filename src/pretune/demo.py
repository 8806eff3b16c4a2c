"""``pretune demo``: a short, real run of what the model core does today.

Imports the real MiniLM BERT checkpoint, checks it against transformers, ranks sentence
similarities with mean-pooled embeddings, and round-trips it through both checkpoint formats.
(The full pretrain -> finetune quickstart replaces this once pretraining and finetuning land.)
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

SENTENCES = [
    "A man is playing a guitar on the stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The stock market fell sharply on Monday.",
    "Share prices dropped steeply at the start of the week.",
    "A cat is sleeping on the warm windowsill.",
]


def _embed(model, tok, texts):
    enc = tok.encode_batch(texts)
    width = max(len(e.ids) for e in enc)
    ids = torch.tensor([e.ids + [0] * (width - len(e.ids)) for e in enc])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in enc])
    with torch.no_grad():
        h = model(ids, attention_mask=mask).last_hidden_state  # (B, T, dim)
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # mean over real tokens
    return ids, mask, h, torch.nn.functional.normalize(pooled, dim=-1)


def run_demo(out: Path) -> int:
    from tokenizers import Tokenizer

    from . import from_hf, load, save, to_hf
    from .model import count_parameters
    from .realmodels import minilm_dir

    src = minilm_dir()
    t0 = time.perf_counter()
    model = from_hf(src)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    print(f"[1/4] imported all-MiniLM-L6-v2 (BERT architecture) from {src}: "
          f"{count_parameters(model)['total']:,} parameters in {time.perf_counter() - t0:.1f}s")

    ids, mask, h, emb = _embed(model, tok, SENTENCES)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        ref = transformers.BertModel.from_pretrained(src).eval()
        with torch.no_grad():
            ref_h = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        diff = (h - ref_h)[mask.bool()].abs().max().item()
        print(f"[2/4] parity with transformers.BertModel on {len(SENTENCES)} padded sentences: "
              f"max |diff| = {diff:.2e}")
    except ImportError:
        print("[2/4] transformers not installed: parity check skipped (pip install 'pretune[hf]')")

    print("[3/4] cosine similarity of mean-pooled embeddings, most similar pairs first:")
    sims = emb @ emb.T
    pairs = sorted(itertools.combinations(range(len(SENTENCES)), 2), key=lambda p: -sims[p].item())
    for i, j in pairs:
        print(f"   {sims[i, j]:+.3f}  {SENTENCES[i][:44]:<44} | {SENTENCES[j][:44]}")

    ckpt, hf_dir = out / "minilm", out / "minilm-hf"
    save(model, ckpt, tokenizer=src / "tokenizer.json")
    again = load(ckpt)
    _, _, h2, _ = _embed(again, tok, SENTENCES)
    to_hf(again, hf_dir, tokenizer_dir=src)
    back = from_hf(hf_dir)
    _, _, h3, _ = _embed(back, tok, SENTENCES)
    same = torch.equal(h, h2) and torch.equal(h, h3)
    print(f"[4/4] saved {ckpt} (pretune) and {hf_dir} (Hugging Face); reloaded outputs identical: {same}")
    return 0 if same else 1
