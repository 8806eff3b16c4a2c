"""SentencePiece folders -> ``tokenizer.json``: ALBERT's and T5's ``spiece.model``, DeBERTa-v2/v3's ``spm.model``.

Hugging Face folders of these encoders often ship only the SentencePiece model. It is converted once into a
``tokenizers`` Unigram model with the pipeline of the family's original ("slow") tokenizer, so that the ids equal
what ``sentencepiece`` itself plus that tokenizer's own steps give:

* ``albert``: whitespace runs -> one space, LaTeX quotes ````/''`` -> ``"``, accents stripped (NFKD) unless
  ``keep_accents``, lowercased when ``do_lower_case`` (default True); pieces ending in digit + comma are
  avoided (score -100), as ALBERT's ``tokenization.py`` re-splits them; ``[CLS] A [SEP] (B [SEP])``.
* ``deberta-v2`` (DeBERTa-v2 and v3): lowercased when ``do_lower_case`` (default False), punctuation split
  off when ``split_by_punct``; ``[CLS] A [SEP] (B [SEP])``.
* ``t5`` (also mT5, UMT5): ``extra_ids`` (default 100) sentinels ``<extra_id_99>`` ... ``<extra_id_0>`` after
  the pieces; ``A </s> (B </s>)``.

Then, as SentencePiece does: the model's own normalization (its precompiled character map, e.g. ``nmt_nfkc``),
runs of spaces collapsed and the ends trimmed, a ``▁`` before each word. Control and unknown pieces and the
folder's role tokens are special added tokens; the folder's ``added_tokens.json`` (DeBERTa-v3's ``[MASK]``) and
``tokenizer_config.json``'s ``added_tokens_decoder`` keep their ids. The family is the folder's
``tokenizer_config.json`` ``tokenizer_class``, else its ``config.json`` ``model_type``.

Reading the model needs the ``sentencepiece`` and ``protobuf`` packages (the ``hf`` extra). The converted file is
cached, never written into the model folder (a user's folder, perhaps a read-only hub snapshot):
``$PRETUNE_CACHE/tokenizers/<key>/tokenizer.json`` (default ``~/.cache/pretune``), the key a hash of the model
file, the settings read from the folder and this converter's version, so an edited folder converts anew.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from .outputs import write_atomic

__all__ = ["FAMILIES", "SPM_FILES", "SentencePieceError", "convert", "find_model"]

SPM_FILES = ("spiece.model", "spm.model")  # ALBERT, T5, mT5 / DeBERTa-v2, DeBERTa-v3
_VERSION = 1  # of the conversion: part of the cache key, so a fix converts cached folders anew
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win, as in transformers
_ROLE_ORDER = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # transformers' order of missing tokens
_UNIGRAM = 1  # sentencepiece_model.proto: TrainerSpec.ModelType
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # ... SentencePiece.Type


class SentencePieceError(ValueError):
    """A SentencePiece folder cannot be converted; the message names the file, key or value."""


def _albert_text(opts: dict) -> list:
    steps = [normalizers.Replace(Regex(r"\s+"), " ")] if opts["remove_space"] else []
    steps += [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
    if not opts["keep_accents"]:
        steps += [normalizers.NFKD(), normalizers.StripAccents()]
    return steps + ([normalizers.Lowercase()] if opts["do_lower_case"] else [])


def _lowercase_text(opts: dict) -> list:
    return [normalizers.Lowercase()] if opts["do_lower_case"] else []


@dataclass(frozen=True)
class Family:
    """How a family's slow tokenizer reads text around its SentencePiece model."""

    roles: dict[str, str]  # role -> token string, transformers' defaults for the family
    options: dict[str, bool | int]  # tokenizer_config.json keys read, with their defaults
    text: Callable[[dict], list]  # normalizers before the model's own, from the options
    single: str  # post-processor template of one text, roles in braces
    pair: str  # ... of a pair
    number_comma: bool = False  # ALBERT: pieces ending in digit + comma scored -100 (never chosen)


_BERT_STYLE = ("{cls}:0 $A:0 {sep}:0", "{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1")
FAMILIES: dict[str, Family] = {
    "albert": Family(roles={"bos": "[CLS]", "eos": "[SEP]", "unk": "<unk>", "sep": "[SEP]", "pad": "<pad>",
                            "cls": "[CLS]", "mask": "[MASK]"},
                     options={"do_lower_case": True, "keep_accents": False, "remove_space": True},
                     text=_albert_text, single=_BERT_STYLE[0], pair=_BERT_STYLE[1], number_comma=True),
    "deberta-v2": Family(roles={"bos": "[CLS]", "eos": "[SEP]", "unk": "[UNK]", "sep": "[SEP]", "pad": "[PAD]",
                                "cls": "[CLS]", "mask": "[MASK]"},
                         options={"do_lower_case": False, "split_by_punct": False},
                         text=_lowercase_text, single=_BERT_STYLE[0], pair=_BERT_STYLE[1]),
    "t5": Family(roles={"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}, options={"extra_ids": 100},
                 text=lambda opts: [], single="$A:0 {eos}:0", pair="$A:0 {eos}:0 $B:0 {eos}:0"),
}
_TOKENIZER_CLASSES = {"AlbertTokenizer": "albert", "DebertaV2Tokenizer": "deberta-v2", "T5Tokenizer": "t5"}
_MODEL_TYPES = {"albert": "albert", "deberta-v2": "deberta-v2", "t5": "t5", "mt5": "t5", "umt5": "t5"}


# --------------------------------------------------------------------------------------------------
# The folder's settings
# --------------------------------------------------------------------------------------------------

def find_model(path: str | os.PathLike) -> Path | None:
    """The SentencePiece model of a folder (``spiece.model`` or ``spm.model``), or ``path`` itself when it is a
    ``*.model`` file; None otherwise."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".model" else None
    return next((path / n for n in SPM_FILES if (path / n).is_file()), None)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SentencePieceError(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise SentencePieceError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _family_of(folder: Path, config: dict) -> str:
    cls = config.get("tokenizer_class")
    if isinstance(cls, str) and cls.removesuffix("Fast") in _TOKENIZER_CLASSES:
        return _TOKENIZER_CLASSES[cls.removesuffix("Fast")]
    model_type = _read_json(folder / "config.json").get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    said = (f"tokenizer_class {cls!r}" if cls is not None else
            f"model_type {model_type!r}" if model_type is not None else "no tokenizer_class and no model_type")
    raise SentencePieceError(
        f"{folder}: cannot tell how to read its SentencePiece model ({said}); pretune converts the tokenizers of "
        f"{', '.join(sorted(_TOKENIZER_CLASSES))} (tokenizer_config.json's tokenizer_class) and of the model types "
        f"{', '.join(sorted(_MODEL_TYPES))} (config.json's model_type)")


def _token(value, where: str) -> AddedToken:
    """A special token written as a string or as {"content": ..., "lstrip": ..., ...}."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: bool(value.get(k, False)) for k in ("lstrip", "rstrip", "single_word", "normalized")}
        return AddedToken(value["content"], special=bool(value.get("special", True)), **flags)
    raise SentencePieceError(f'{where} is {value!r}; expected a string or {{"content": string, ...}}')


@dataclass
class _Settings:
    family: str
    options: dict  # the family's options, from tokenizer_config.json
    roles: dict[str, AddedToken]  # role -> token
    extra: list[AddedToken]  # additional_special_tokens
    fixed: dict[int, AddedToken]  # added tokens whose id the folder fixes

    def key(self, model: bytes) -> str:
        def tok(t: AddedToken) -> list:
            return [t.content, t.special, t.lstrip, t.rstrip, t.single_word, t.normalized]

        what = {"version": _VERSION, "family": self.family, "options": self.options,
                "roles": {r: tok(t) for r, t in self.roles.items()}, "extra": [tok(t) for t in self.extra],
                "fixed": {i: tok(t) for i, t in sorted(self.fixed.items())}}
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode() + b"\0" + model)
        return digest.hexdigest()[:32]


def _settings(folder: Path) -> _Settings:
    files = [(folder / n, _read_json(folder / n)) for n in _SIDE_FILES]
    config = files[0][1]
    family = _family_of(folder, config)
    fam = FAMILIES[family]
    options = {}
    for key, default in fam.options.items():
        value = config.get(key, default)
        if type(value) is not type(default) or (isinstance(value, int) and value < 0):
            raise SentencePieceError(f"{files[0][0]}: {key} is {value!r}; expected "
                                     f"{'true or false' if isinstance(default, bool) else 'an integer >= 0'}")
        options[key] = value
    roles = {r: AddedToken(t, special=True, normalized=False) for r, t in fam.roles.items()}
    extra: list[AddedToken] = []
    for file, data in files:
        for role in _ROLE_ORDER:
            if data.get(f"{role}_token") is not None:
                roles[role] = _token(data[f"{role}_token"], f"{file}: {role}_token")
        listed = data.get("additional_special_tokens")
        if listed is not None:
            if not isinstance(listed, list):
                raise SentencePieceError(f"{file}: additional_special_tokens is {listed!r}; expected a list")
            extra = [_token(v, f"{file}: additional_special_tokens") for v in listed]
    fixed = {}
    specials = {t.content for t in [*roles.values(), *extra]}
    for content, i in _read_json(folder / "added_tokens.json").items():  # {"[MASK]": 128000}
        if isinstance(i, bool) or not isinstance(i, int):
            raise SentencePieceError(f"{folder / 'added_tokens.json'}: {content!r} maps to {i!r}; expected an id")
        fixed[i] = AddedToken(content, special=content in specials, normalized=False)
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise SentencePieceError(f"{files[0][0]}: added_tokens_decoder is {decoder!r}; expected an object")
    for i, value in decoder.items():
        if not str(i).isdigit():
            raise SentencePieceError(f"{files[0][0]}: added_tokens_decoder key {i!r} is not an id")
        fixed[int(i)] = _token(value, f"{files[0][0]}: added_tokens_decoder[{i}]")
    return _Settings(family, options, roles, extra, fixed)


# --------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------

def _read_proto(file: Path, model: bytes):
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise SentencePieceError(f"{file} is a SentencePiece model: reading it needs the sentencepiece and protobuf "
                                 f"packages (pip install sentencepiece protobuf, or pip install 'pretune[hf]'; "
                                 f"missing: {e.name})") from None
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model)
    except Exception as e:  # protobuf's DecodeError, or a RuntimeWarning-free failure of the C implementation
        raise SentencePieceError(f"{file}: not a SentencePiece model ({type(e).__name__}: {e})") from None
    if not proto.pieces:
        raise SentencePieceError(f"{file}: not a SentencePiece model (it holds no pieces)")
    if proto.trainer_spec.model_type != _UNIGRAM:
        raise SentencePieceError(f"{file}: a SentencePiece model of type {proto.trainer_spec.model_type} "
                                 "(2 = BPE, 3 = word, 4 = char); only Unigram models (type 1: ALBERT, T5, DeBERTa) "
                                 "convert")
    if proto.trainer_spec.byte_fallback:
        raise SentencePieceError(f"{file}: a SentencePiece model with byte_fallback; ALBERT, T5 and DeBERTa "
                                 "models have none, and pretune converts only those")
    return proto


def _add(tk: tokenizers.Tokenizer, token: AddedToken, where: str, want: int | None = None) -> None:
    """Add ``token`` (special or not) at the next id, or check it has id ``want`` when already present."""
    have = tk.token_to_id(token.content)
    if want is not None and have is None and want != tk.get_vocab_size(with_added_tokens=True):
        raise SentencePieceError(f"{where}: {token.content!r} has id {want}, but the next free id is "
                                 f"{tk.get_vocab_size(with_added_tokens=True)}")
    if want is not None and have is not None and have != want:
        raise SentencePieceError(f"{where}: {token.content!r} has id {want}, but the model gives it id {have}")
    (tk.add_special_tokens if token.special else tk.add_tokens)([token])


def _build(file: Path, model: bytes, s: _Settings) -> tokenizers.Tokenizer:
    fam = FAMILIES[s.family]
    proto = _read_proto(file, model)
    vocab = [(p.piece, p.score) for p in proto.pieces]
    if fam.number_comma:
        vocab = [(p, v - 100 if len(p) > 1 and p[-1] == "," and p[-2].isdigit() else v) for p, v in vocab]
    tk = tokenizers.Tokenizer(models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id, byte_fallback=False))

    spec = proto.normalizer_spec
    steps = fam.text(s.options)
    if spec.precompiled_charsmap:  # the model's own normalization (nmt_nfkc, ...)
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:  # SentencePiece: runs of spaces -> one, none at either end
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    tk.normalizer = normalizers.Sequence(steps)
    prepend = "always" if spec.add_dummy_prefix else "never"
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)
    punct = [pre_tokenizers.Punctuation(behavior="isolated")] if s.options.get("split_by_punct") else []
    tk.pre_tokenizer = pre_tokenizers.Sequence([*punct, metaspace])
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)

    for p in proto.pieces:  # control pieces and the unknown piece are special, user-defined ones are not
        if p.type in (_UNKNOWN, _CONTROL, _USER_DEFINED):
            _add(tk, AddedToken(p.piece, special=p.type != _USER_DEFINED, normalized=False), str(file))
    sentinels = s.options.get("extra_ids", 0)  # T5: <extra_id_99> first, <extra_id_0> last
    for n in range(sentinels - 1, -1, -1):
        _add(tk, AddedToken(f"<extra_id_{n}>", special=True, normalized=False), str(file))
    for i, token in sorted(s.fixed.items()):
        _add(tk, token, str(file.parent / "added tokens"), want=i)
    for token in [s.roles[r] for r in _ROLE_ORDER if r in s.roles] + s.extra:
        _add(tk, token, str(file.parent))

    roles = {r: t.content for r, t in s.roles.items()}
    single, pair = fam.single.format(**roles), fam.pair.format(**roles)
    used = sorted({roles[r] for r in ("cls", "sep", "eos") if "{" + r + "}" in fam.single + fam.pair})
    tk.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                      special_tokens=[(t, tk.token_to_id(t)) for t in used])
    # tokenizers' JSON reader can round a float score by one ulp: the fresh and the cached tokenizer are the same
    return tokenizers.Tokenizer.from_str(tk.to_str())


def cache_root() -> Path:
    """Where converted tokenizers are kept: ``$PRETUNE_CACHE/tokenizers``, default ``~/.cache/pretune/tokenizers``."""
    env = os.environ.get("PRETUNE_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "pretune") / "tokenizers"


def convert(file: str | os.PathLike) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a SentencePiece model file and the settings of its folder (see the module
    docstring); converted once, then read from the cache.

    Args:
        file: ``spiece.model`` / ``spm.model`` (any ``*.model``) inside its Hugging Face folder.
    """
    file = Path(file)
    try:
        model = file.read_bytes()
    except OSError as e:
        raise SentencePieceError(f"{file}: cannot read it ({e.strerror or e})") from None
    settings = _settings(file.parent)
    cached = cache_root() / settings.key(model) / "tokenizer.json"
    if cached.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(cached))
        except Exception:  # a damaged cache entry (tokenizers raises a bare Exception): convert again
            pass
    tk = _build(file, model, settings)
    try:
        write_atomic(cached, tk.to_str(pretty=True))
    except OSError:
        pass  # a read-only cache: the conversion is used as it is, and redone next time
    return tk
