import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)  # tiny test models run fastest (and least noisily) on one thread


def _has_cxx() -> bool:
    """Whether inductor finds a C++ compiler (torch.compile on the CPU needs one)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:
        return False


# tests of generate(compile=True) / torch.compile on the CPU
requires_cxx = pytest.mark.skipif(not _has_cxx(), reason="torch.compile on the CPU needs a C++ compiler (g++)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
CORPUS = os.path.join(SHARED, "corpus")


def corpus_paragraphs(name: str, n: int) -> list[str]:
    """The first ``n`` blank-line separated paragraphs (≥ 40 chars) of a bundled corpus file."""
    import gzip

    out, cur = [], []
    with gzip.open(os.path.join(CORPUS, name), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                cur.append(line.rstrip("\n"))
                continue
            if cur and len(" ".join(cur)) >= 40:
                out.append("\n".join(cur))
                if len(out) >= n:
                    break
            cur = []
    return out


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A small real corpus (Austen + Wikipedia paragraphs) as a .txt file: folder path, file path."""
    d = tmp_path_factory.mktemp("corpus")
    paras = corpus_paragraphs("austen.txt.gz", 700) + corpus_paragraphs("enwiki_sample.txt.gz", 250)
    path = d / "small.txt"
    path.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tokenizers_by_kind(small_corpus, tmp_path_factory):
    """One small trained tokenizer of each kind, saved: {kind: path to tokenizer.json}."""
    from pretune.io.tokenization import train_tokenizer

    d = tmp_path_factory.mktemp("toks")
    out = {}
    for kind, specials, sentinels in (("wordpiece", "bert", 20), ("bpe", "roberta", 20), ("unigram", "t5", 20)):
        tok = train_tokenizer([small_corpus], kind=kind, vocab_size=600 if kind != "bpe" else 700, specials=specials,
                              sentinels=sentinels, show_progress=False)
        out[kind] = tok.save(d / f"{kind}.json")
    return out
