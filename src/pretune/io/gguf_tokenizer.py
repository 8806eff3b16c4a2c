"""A tokenizer in a GGUF file's ``tokenizer.*`` keys, both ways: llama.cpp's "gpt2" (byte-level BPE) and "t5"
(SentencePiece Unigram) models.

What llama.cpp can run as byte-level BPE is one whose pre-tokenizer it knows by name (``tokenizer.ggml.pre``): GPT-2's
regex alone (``pretune tokenizer train --kind bpe``: "gpt-2") or digits split one by one before it (SmolLM2,
StarCoder: "smollm"). Its BPE has no normaliser, so a BPE tokenizer that lowercases (``--lowercase``) and the
WordPiece recipe are refused by name rather than written into a file whose ids would differ from pretune's. A
Unigram tokenizer (``--kind unigram``: NFKC, which llama.cpp lacks) is written as llama.cpp's UGM model with its
normaliser as a precompiled character map, only where that round-trips (``io/gguf_unigram.py`` says how that is
checked), and with its tokenizer.json as ``tokenizer.huggingface.json`` so pretune reads it back exactly. Tokens are
written by id (ids the model has beyond the tokenizer's as ``[PADn]``: type UNUSED as llama.cpp's converter pads
them; CONTROL for Unigram, whose llama.cpp tokenizer would otherwise match the text "[PADn]"), added special tokens
as CONTROL, other added tokens as USER_DEFINED; no BOS or EOS is added when llama.cpp tokenizes (pretune's
``encode`` adds none either).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .tokenization import Tokenizer, TokenizerError

__all__ = ["GGUFTokenizerError", "tokenizer_keys", "write_tokenizer", "read_tokenizer", "tokenizer_folder"]

# tokenizer.json's pre-tokenizer -> llama.cpp's name for it (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_*)
_GPT2_BYTELEVEL = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}
_DIGITS = {"type": "Digits", "individual_digits": True}
_PRE_NAMES = ("gpt-2", "smollm", "starcoder")  # what read_tokenizer rebuilds ("starcoder": smollm's regex)

_HF_JSON = "tokenizer.huggingface.json"  # gguf.Keys.Tokenizer.HF_JSON: the Unigram tokenizer.json, read back exactly

# gguf.TokenType values (llama.h: LLAMA_TOKEN_TYPE_*)
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


class GGUFTokenizerError(TokenizerError):
    """A tokenizer llama.cpp cannot run the same way, or a GGUF file's tokenizer keys pretune cannot rebuild."""


def _subset(step: dict, want: dict) -> bool:
    return all(step.get(k, v if k == "add_prefix_space" else None) == v for k, v in want.items())


def _pre_name(data: dict) -> str:
    """llama.cpp's pre-tokenizer name for a tokenizer.json (raises naming what it is when llama.cpp has none)."""
    if data.get("normalizer") is not None:
        raise GGUFTokenizerError(f"the tokenizer has a normaliser ({data['normalizer'].get('type')}, e.g. "
                                 "--lowercase), which llama.cpp's BPE tokenizer does not apply: its ids would differ")
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and _subset(steps[0], _GPT2_BYTELEVEL):
        return "gpt-2"
    if len(steps) == 2 and _subset(steps[0], _DIGITS) and _subset(steps[1], _GPT2_BYTELEVEL):
        return "smollm"
    raise GGUFTokenizerError(f"pre-tokenizer {json.dumps(pre)} has no llama.cpp equivalent (known: GPT-2's "
                             "ByteLevel regex, or single digits then ByteLevel as SmolLM2's)")


def _merges(model: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _model_keys(tok: Tokenizer, data: dict) -> dict:
    """The keys of llama.cpp's tokenizer model for ``tok``: "gpt2" (pre-tokenizer name, merges) or "t5" (scores,
    character map, whitespace keys)."""
    from .gguf_unigram import unigram_keys

    model = data["model"]["type"]
    if model == "Unigram":
        try:
            return {"model": "t5", **unigram_keys(tok, data)}
        except TokenizerError as e:
            raise GGUFTokenizerError(str(e)) from None
    if model != "BPE":
        raise GGUFTokenizerError(f"a {model} tokenizer is not written into GGUF: llama.cpp runs pretune's byte-level "
                                 "BPE tokenizers (pretune tokenizer train --kind bpe), SmolLM2's, and Unigram ones "
                                 "(--kind unigram) whose ids it reproduces")
    pre = _pre_name(data)
    if data["model"].get("byte_fallback"):
        raise GGUFTokenizerError("a byte-fallback BPE (<0xNN> tokens) is a SentencePiece tokenizer, not byte-level")
    return {"model": "gpt2", "pre": pre, "merges": _merges(data["model"])}


def tokenizer_keys(tok: Tokenizer, vocab_size: int) -> dict:
    """What a GGUF file holds of ``tok`` (model, tokens, types, merges or scores, pre-tokenizer or character map,
    special ids, chat template) for a model with ``vocab_size`` ids; raises GGUFTokenizerError naming why llama.cpp
    would tokenize differently."""
    data = tok._parsed()
    if tok.vocab_size > vocab_size:
        raise GGUFTokenizerError(f"the tokenizer has {tok.vocab_size} tokens, the model {vocab_size} ids")
    keys = _model_keys(tok, data)
    filler = _CONTROL if keys["model"] == "t5" else _UNUSED
    added = tok.tk.get_added_tokens_decoder()
    by_id = {i: t for t, i in tok.tk.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(filler)
        elif i in added:
            tokens.append(by_id[i])
            types.append(_CONTROL if added[i].special else _USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(_NORMAL)
    ids = {role: getattr(tok, f"{role}_id") for role in ("bos", "eos", "unk", "pad")}
    if keys["model"] == "t5":  # fillers score 0 as the special pieces do; llama.cpp reads one score per token
        keys["scores"] = np.concatenate([keys["scores"], np.zeros(vocab_size - len(keys["scores"]), np.float32)])
        keys["json"] = tok.tk.to_str()
    return {**keys, "tokens": tokens, "types": types, "ids": {k: v for k, v in ids.items() if v is not None},
            "chat_template": tok.chat_template}


def write_tokenizer(writer, tok: Tokenizer, vocab_size: int) -> None:
    """Add ``tok``'s keys (:func:`tokenizer_keys`) to a ``gguf.GGUFWriter``."""
    keys = tokenizer_keys(tok, vocab_size)
    writer.add_tokenizer_model(keys["model"])
    writer.add_token_list(keys["tokens"])
    writer.add_token_types(keys["types"])
    if keys["model"] == "gpt2":
        writer.add_tokenizer_pre(keys["pre"])
        writer.add_token_merges(keys["merges"])
        writer.add_add_space_prefix(False)
    else:
        writer.add_token_scores(keys["scores"].tolist())
        writer.add_precompiled_charsmap(keys["charsmap"])
        writer.add_add_space_prefix(keys["add_space_prefix"])
        writer.add_remove_extra_whitespaces(keys["remove_extra_whitespaces"])
        writer.add_string(_HF_JSON, keys["json"])
    for role, i in keys["ids"].items():
        getattr(writer, {"bos": "add_bos_token_id", "eos": "add_eos_token_id", "unk": "add_unk_token_id",
                         "pad": "add_pad_token_id"}[role])(i)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if keys["chat_template"]:
        writer.add_chat_template(keys["chat_template"])


def _value(fields: dict, key: str, default=None):
    field = fields.get(key)
    return default if field is None else field.contents()


def _bpe(tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: str):
    """llama.cpp's "gpt2" model as a ``tokenizers`` byte-level BPE."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    tk = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.pre_tokenizer = byte_level if pre == "gpt-2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
    tk.decoder = decoders.ByteLevel()
    # control and user-defined tokens are matched in the text before BPE, at the ids they already have in the vocab
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for i, t in enumerate(tokens) if types[i] == _CONTROL])
    tk.add_tokens([AddedToken(t, normalized=False) for i, t in enumerate(tokens) if types[i] == _USER_DEFINED])
    return tk


def _unigram(tokens: list[str], text: str, source: str):
    """llama.cpp's "t5" model as pretune wrote it: the tokenizer.json it carries, its pieces checked against the
    file's token list (the ids llama.cpp uses)."""
    import tokenizers

    try:
        tk = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception for a malformed tokenizer.json
        raise GGUFTokenizerError(f"{source}: {_HF_JSON} is not a tokenizer.json ({e})") from None
    by_id = {i: t for t, i in tk.get_vocab(with_added_tokens=True).items()}
    wrong = next((i for i, t in enumerate(tokens) if i in by_id and by_id[i] != t), None)
    if wrong is not None or len(by_id) > len(tokens):
        raise GGUFTokenizerError(f"{source}: {_HF_JSON} does not match tokenizer.ggml.tokens (token {wrong}: "
                                 f"{by_id.get(wrong)!r} there, {tokens[wrong] if wrong is not None else None!r} in "
                                 "the list)")
    return tk


def read_tokenizer(fields: dict, *, source: str) -> Tokenizer:
    """The tokenizer a GGUF file holds (``GGUFReader.fields``): llama.cpp's "gpt2" model with a pre-tokenizer named in
    ``_PRE_NAMES``, or its "t5" model as pretune writes it (with ``tokenizer.huggingface.json``); anything else raises
    GGUFTokenizerError naming it and ``source`` (the file)."""
    kind, pre = _value(fields, "tokenizer.ggml.model"), _value(fields, "tokenizer.ggml.pre", "default")
    if kind is None:
        raise GGUFTokenizerError(f"{source}: no tokenizer in the file (no tokenizer.ggml.model key)")
    unigram = kind == "t5" and _HF_JSON in fields
    if not unigram and (kind != "gpt2" or pre not in _PRE_NAMES):
        raise GGUFTokenizerError(f"{source}: tokenizer model {kind!r} with pre-tokenizer {pre!r} is not read (pretune "
                                 f"reads llama.cpp's byte-level 'gpt2' model with pre-tokenizer "
                                 f"{', '.join(map(repr, _PRE_NAMES))}, and the 't5' (Unigram) model with the "
                                 f"{_HF_JSON} key pretune writes)")
    tokens = _value(fields, "tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.tokens repeats a token ({len(tokens) - len(set(tokens))} "
                                 "repeats)")
    if unigram:
        tk = _unigram(tokens, _value(fields, _HF_JSON), source)
    else:
        types = _value(fields, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        tk = _bpe(tokens, types, [tuple(m.split(" ", 1)) for m in _value(fields, "tokenizer.ggml.merges", [])], pre)
    roles = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        i = _value(fields, f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            roles[role] = tokens[int(i)]
    tok = Tokenizer(tk, roles=roles)
    tok.chat_template = _value(fields, "tokenizer.chat_template")
    return tok


def tokenizer_folder(tok: Tokenizer) -> Path:
    """A folder holding ``tok`` as a model folder keeps it (tokenizer.json, its roles in tokenizer_config.json,
    chat_template.jinja), so that what reads a model's folders (chat templates, special-token strings) reads a GGUF
    file's tokenizer too: ``$PRETUNE_CACHE/tokenizers/gguf-<hash>`` (beside the converted SentencePiece models),
    written once, keyed by the tokenizer, its roles and its template."""
    from .spm import cache_root
    from .tokenization import tokenizer_sha

    key = hashlib.sha256(json.dumps([tokenizer_sha(tok), tok.roles, tok.chat_template]).encode()).hexdigest()[:16]
    folder = cache_root() / f"gguf-{key}"
    if not (folder / "tokenizer.json").is_file():
        tok.save(folder / "tokenizer.json")
    return folder
