"""A Unigram tokenizer (``pretune tokenizer train --kind unigram``) as llama.cpp's SentencePiece-Unigram model:
``tokenizer.ggml.model = "t5"`` (llama-vocab.cpp: LLAMA_VOCAB_TYPE_UGM), written only where llama.cpp's ids are
pretune's, else refused with the reason.

llama.cpp's UGM tokenizer is a port of SentencePiece's: it normalises the text with a precompiled character map
(``tokenizer.ggml.precompiled_charsmap``: SentencePiece's compiled double array, the longest matching prefix replaced
first) and SentencePiece's whitespace rules (``remove_extra_whitespaces``: runs of spaces collapsed, the ends
trimmed; ``add_space_prefix`` and escaped whitespace: ``▁`` before each word), then picks the pieces by Viterbi over
their scores. pretune's recipe normalises with NFKC, whitespace runs -> one space, strip (then lowercase with
``--lowercase``), splits words before each ``▁`` (Metaspace) and runs Viterbi per word. llama.cpp has no NFKC of its
own, so the file carries pretune's normaliser as a character map:

* **The map**: pretune's own normaliser (without its strip, which the whitespace rules do) applied to every code
  point and to the composition sequences of SentencePiece's own NFKC map (a base and its combining marks, Hangul
  jamo, ...), each changed string a map entry; compiled by ``sentencepiece`` (``SentencePieceNormalizer``), never
  packed here by hand.
* **Round-trips** means llama.cpp tokenizes text to pretune's ids. llama.cpp cannot run at export time, so it is
  checked three ways before anything is written, and ``tests/interop/test_gguf_llamacpp.py`` confirms it with
  llama.cpp itself:

  1. by construction: the normaliser is exactly the recipe's and the pre-tokenizer the recipe's Metaspace (anything
     else has no llama.cpp form here); no piece holds ``▁`` after its first character, so Viterbi over the whole
     text (llama.cpp) and per word (pretune) choose the same pieces; no byte fallback and no non-special added
     tokens (llama.cpp's UGM matches those inside its normaliser, pretune's before it);
  2. every code point and composition sequence: SentencePiece's normaliser running the compiled map gives what
     pretune's normaliser gives (a map that lost or changed an entry is refused);
  3. a sample: the bundled text (Wikipedia, Austen, Moby Dick, the Gospels) and NFKC-sensitive strings
     (``_TRICKY``) tokenize to pretune's ids through llama.cpp's pipeline as SentencePiece itself runs it: its
     normaliser with the file's map and flags, then Viterbi on the scores as the file stores them (float32). This
     catches what (1) and (2) cannot: NFKC composing a sequence the map does not list, a score rounded to float32
     that changes a segmentation.

  What stays unchecked: text outside the sample that composes in a way the map does not list (combining marks in
  non-canonical order, say), where llama.cpp's ids may differ from pretune's.
"""

from __future__ import annotations

import functools
import gzip
import json

import numpy as np

from .tokenization import Tokenizer, TokenizerError

__all__ = ["UGM_WHITESPACE", "unigram_keys"]

# the recipe's normaliser (io/tokenization.py, _pipeline("unigram")): nmt_nfkc's NFKC and whitespace, then lowercase
_NFKC = {"type": "NFKC"}
_WS = {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}
_STRIP = {"type": "Strip", "strip_left": True, "strip_right": True}
_LOWER = {"type": "Lowercase"}
_METASPACE = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
# llama.cpp's UGM whitespace keys (tokenizer.ggml.*): ▁ before the text, runs of spaces collapsed, the ends trimmed
UGM_WHITESPACE = {"add_space_prefix": True, "remove_extra_whitespaces": True}

_SEP = "\x01"  # never composes nor changes (a stable code point): strings joined by it normalise one by one
_SAMPLE_FILES = ("enwiki_sample.txt.gz", "austen_emma_pride.txt.gz", "mobydick_ch1-20.txt.gz",
                 "web_bible_gospels.txt.gz")
_SAMPLE_CHARS = 40_000  # of each bundled file: 160k characters, ~0.3 s of tokenizing
_TRICKY = ("ﬁne ﬂour, ½ cup… “quoted” — ‘single’", "Ｆｕｌｌ－ｗｉｄｔｈ ｶﾀｶﾅ and ㍻ ㎏ ™ №",
           "e\u0301 a\u0308 n\u0303 (decomposed) é ä ñ (composed)",
           "tabs\tand\nnew\r\nlines \u00a0nbsp\u3000ideographic", "  leading, trailing and   inner   runs  ",
           "Ⅻ ① ⁵ ₂ ℌ 𝐛𝐨𝐥𝐝 ǅ Ǉ ĳ", "한국어 텍스트 and 日本語", "naïve café 😀 ▁lit")


class UnigramExportError(TokenizerError):
    """A Unigram tokenizer llama.cpp would tokenize differently (the reason in the message)."""


def _refuse(why: str, hint: str = "") -> UnigramExportError:
    hint = hint or ("retrain it with `pretune tokenizer train --kind bpe` (byte-level BPE, which llama.cpp runs "
                    "exactly), or run the model in pretune")
    return UnigramExportError(f"a Unigram tokenizer is not written into GGUF: {why}; {hint}")


def _check_pipeline(data: dict, tok: Tokenizer) -> bool:
    """Step 1: the recipe's normaliser and pre-tokenizer, no byte fallback, no non-special added tokens, no piece
    spanning words. Returns whether the normaliser lowercases."""
    norm = data.get("normalizer") or {}
    steps = norm.get("normalizers") if norm.get("type") == "Sequence" else [norm]
    if steps not in ([_NFKC, _WS, _STRIP], [_NFKC, _WS, _STRIP, _LOWER]):
        raise _refuse(f"its normaliser {json.dumps(norm)} is not the recipe's (NFKC, whitespace runs -> ' ', strip, "
                      "optionally lowercase): llama.cpp's UGM tokenizer applies a character map and SentencePiece's "
                      "whitespace rules, which reproduce that one only",
                      "retrain it with `pretune tokenizer train --kind unigram` (or --kind bpe)")
    pre = data.get("pre_tokenizer") or {}
    if {k: pre.get(k) for k in _METASPACE} != _METASPACE:
        raise _refuse(f"its pre-tokenizer {json.dumps(pre)} is not Metaspace('▁', prepend always, split), the only "
                      "one llama.cpp's UGM tokenizer has")
    if data["model"].get("byte_fallback"):
        raise _refuse("it has byte fallback (<0xNN> pieces), which llama.cpp's UGM tokenizer lacks")
    added = tok.tk.get_added_tokens_decoder()
    plain = sorted(t.content for t in added.values() if not t.special)
    if plain:
        raise _refuse(f"it has non-special added tokens ({', '.join(map(repr, plain[:3]))}): llama.cpp's UGM "
                      "tokenizer matches them inside its normaliser, pretune before normalising")
    for i, (piece, _) in enumerate(data["model"]["vocab"]):
        if i not in added and "▁" in piece[1:]:
            raise _refuse(f"piece {piece!r} (id {i}) holds '▁' after its first character: llama.cpp's UGM tokenizer "
                          "would use it across a word boundary, pretune's Metaspace never does")
    return steps[-1] == _LOWER


def _per_char(lowercase: bool):
    """The recipe's normaliser without its strip (SentencePiece's whitespace rules trim the ends instead)."""
    from tokenizers import Regex, normalizers

    steps = [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")]
    return normalizers.Sequence(steps + ([normalizers.Lowercase()] if lowercase else []))


def _spm_normalizer(charsmap: bytes, *, whitespace: bool):
    """SentencePiece's own normaliser running ``charsmap`` (with llama.cpp's UGM whitespace rules, or none)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    spec = sentencepiece_model_pb2.NormalizerSpec(name="pretune", precompiled_charsmap=charsmap,
                                                  add_dummy_prefix=whitespace, escape_whitespaces=whitespace,
                                                  remove_extra_whitespaces=whitespace)
    return spm.SentencePieceNormalizer(normalizer_spec=spec.SerializeToString())


@functools.lru_cache(maxsize=2)
def _charsmap(lowercase: bool) -> bytes:
    """The compiled character map of the recipe's normaliser (``lowercase``: the --lowercase variant), checked entry
    by entry (step 2); about a second, cached per process."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    spm.set_min_log_level(2)  # its builder logs each compile to stderr
    composed = [k for k, _ in spm.SentencePieceNormalizer(rule_name="nfkc").Decompile() if len(k) > 1]
    points = [chr(c) for c in range(1, 0x110000) if not 0xD800 <= c < 0xE000 and chr(c) != _SEP]  # 0: ends text
    keys = points + composed  # Decompile lists each sequence once
    want = _per_char(lowercase).normalize_str(_SEP.join(keys)).split(_SEP)
    assert len(want) == len(keys), "the separator composed or changed"
    pairs = [(k, v) for k, v in zip(keys, want) if k != v]
    spec = sentencepiece_model_pb2.NormalizerSpec()
    spec.ParseFromString(spm.SentencePieceNormalizer(norm_map=pairs).serialized_normalizer_spec())
    compiled = spec.precompiled_charsmap
    got = _spm_normalizer(compiled, whitespace=False).Normalize(_SEP.join(keys)).split(_SEP)
    wrong = [(k, w, g) for k, w, g in zip(keys, want, got) if w != g]
    if wrong:
        shown = ", ".join(f"{k!r} -> {g!r} (pretune {w!r})" for k, w, g in wrong[:3])
        raise _refuse(f"the character map compiled for its NFKC normalisation changes {len(wrong)} strings otherwise "
                      f"than pretune does: {shown}")
    return compiled


def _sample() -> list[str]:
    from .. import bundled

    texts = list(_TRICKY)
    for name in _SAMPLE_FILES:
        with gzip.open(bundled.path(f"corpus/{name}"), "rt", encoding="utf-8") as f:
            texts += [p for p in f.read(_SAMPLE_CHARS).split("\n\n") if p.strip()]
    return texts


def _check_sample(tok: Tokenizer, data: dict, compiled: bytes, scores: np.ndarray) -> None:
    """Step 3: the sample tokenizes to pretune's ids through SentencePiece's normaliser with the file's map and
    whitespace flags, then Viterbi (``tokenizers``' port of SentencePiece's) on the float32 scores."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = [(piece, float(s)) for (piece, _), s in zip(data["model"]["vocab"], scores)]
    ugm = tokenizers.Tokenizer(models.Unigram(vocab, unk_id=data["model"].get("unk_id"), byte_fallback=False))
    ugm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    spm_norm = _spm_normalizer(compiled, whitespace=True)
    texts = _sample()
    theirs = [e.ids for e in ugm.encode_batch_fast(spm_norm.Normalize(texts), add_special_tokens=False)]
    ours = tok.encode_batch(texts)
    for text, a, b in zip(texts, theirs, ours):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            theirs_at, ours_at = (" ".join(tok.tk.id_to_token(i) or f"[{i}]" for i in ids[at:at + 3]) for ids in (a, b))
            raise _refuse(f"llama.cpp's UGM tokenizer (its character map, whitespace rules and float32 scores) "
                          f"would tokenize {text[:60]!r} otherwise than pretune, from token {at}: "
                          f"{theirs_at!r} there, {ours_at!r} in pretune")


def unigram_keys(tok: Tokenizer, data: dict) -> dict:
    """What the GGUF file holds beyond the token list for Unigram ``tok`` (its parsed tokenizer.json ``data``):
    ``scores`` (float32, by id), ``charsmap`` (bytes) and llama.cpp's whitespace keys; raises a TokenizerError
    naming why llama.cpp would tokenize differently (the checks in the module docstring)."""
    lowercase = _check_pipeline(data, tok)
    try:
        import sentencepiece  # noqa: F401  (compiles and runs the character map)
    except ImportError:
        raise _refuse("its NFKC is written as a character map, which needs the sentencepiece package",
                      "install it (pip install 'pretune[hf]')") from None
    scores = np.asarray([s for _, s in data["model"]["vocab"]], dtype=np.float32)
    compiled = _charsmap(lowercase)
    _check_sample(tok, data, compiled, scores)
    return {"scores": scores, "charsmap": compiled, **UGM_WHITESPACE}
