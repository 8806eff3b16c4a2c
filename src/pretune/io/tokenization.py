"""Train and load subword tokenizers; Hugging Face ``tokenizers`` does the work underneath.

Three recipes, each the one its model family made famous:

* ``"bpe"``: byte-level BPE like GPT-2/RoBERTa (ByteLevel pre-tokenizer and decoder, the full
  256-byte initial alphabet, so no text is ever unknown and ``decode(encode(x)) == x`` exactly).
* ``"wordpiece"``: WordPiece like BERT (BertNormalizer, BertPreTokenizer, ``##`` continuation).
* ``"unigram"``: Unigram LM like T5/SentencePiece (NFKC, whitespace runs collapsed to one space and
  stripped like SentencePiece's ``nmt_nfkc``, Metaspace ``▁`` pre-tokenizer and decoder).

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` with the roles of its special tokens (pad, unk,
cls, sep, mask, bos, eos, T5 sentinels), read from the token strings of the three families (plus
GPT-2's ``<|endoftext|>``) and, for a Hugging Face folder, from ``tokenizer_config.json`` and
``special_tokens_map.json``. ``encode`` never adds special tokens: objectives add them.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .outputs import write_atomic

__all__ = ["DEFAULT_SPECIALS", "KINDS", "ROLES", "SPECIAL_SETS", "Tokenizer", "TokenizerError", "load_tokenizer",
           "tokenizer_sha", "train_tokenizer"]

Kind = Literal["bpe", "wordpiece", "unigram"]
KINDS: tuple[str, ...] = ("bpe", "wordpiece", "unigram")
ROLES: tuple[str, ...] = ("pad", "unk", "cls", "sep", "mask", "bos", "eos")

# role -> token string; the dict order is the id order (roberta keeps RoBERTa's <s>=0, <pad>=1, ...).
SPECIAL_SETS: dict[str, dict[str, str]] = {
    "bert": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "roberta": {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"},
    "t5": {"pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
}
DEFAULT_SPECIALS: dict[str, str] = {"wordpiece": "bert", "bpe": "roberta", "unigram": "t5"}
DEFAULT_SENTINELS = 100  # T5: 100 <extra_id_N> sentinels (Raffel et al. 2019, §3.1.4)

# What `encode` of a pair looks like in the saved file, so that Hugging Face loaders behave like the
# originals: BERT [CLS] A [SEP] B [SEP]; RoBERTa <s> A </s></s> B </s>; T5 A </s> B </s>.
_TEMPLATES: dict[str, tuple[str, str]] = {
    "bert": ("{cls} $A:0 {sep}:0", "{cls} $A:0 {sep}:0 $B:1 {sep}:1"),
    "roberta": ("{cls} $A:0 {sep}:0", "{cls} $A:0 {sep}:0 {sep}:0 $B:0 {sep}:0"),
    "t5": ("$A:0 {eos}:0", "$A:0 {eos}:0 $B:0 {eos}:0"),
}
_LSTRIP_TOKENS = {"<mask>"}  # RoBERTa: "<mask>" swallows the space before it, so "a <mask>" fills " word"

# Known token strings per role, most specific first; roles not found stay None.
_ROLE_CANDIDATES: dict[str, tuple[str, ...]] = {
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>", "<|endoftext|>"),
    "cls": ("[CLS]",),  # RoBERTa's <s> arrives through the cls <- bos fallback
    "sep": ("[SEP]",),
    "mask": ("[MASK]", "<mask>"),
    "bos": ("<s>", "<|endoftext|>"),  # GPT-2: <|endoftext|> is bos, eos and unk at once
    "eos": ("</s>", "<|endoftext|>"),
}
_SENTINEL_RE = re.compile(r"<extra_id_(\d+)>")
_HF_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # later files win, as in transformers

# Vocabulary a model needs beyond its special tokens: BPE the 256 byte tokens; WordPiece and Unigram
# at least a small character alphabet (a corpus with more characters needs more: checked after training).
_MIN_MODEL_VOCAB = {"bpe": 256, "wordpiece": 100, "unigram": 100}
_MAX_WORDPIECE_ALPHABET = 1000  # BERT recipe (HF BertWordPieceTokenizer limit_alphabet); rarer chars -> [UNK]
_BATCH_LINES = 1000  # lines handed to the trainer per Python -> Rust call


class TokenizerError(ValueError):
    """Bad tokenizer input: the message names the file or value and what was expected."""


# --------------------------------------------------------------------------------------------------
# Reading the corpus
# --------------------------------------------------------------------------------------------------

def _expand_files(files: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Paths, folders (their ``*.txt`` and ``*.gz`` files, recursively) and glob patterns -> files."""
    entries = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not entries:
        raise TokenizerError("files is empty: expected at least one path, folder or glob pattern")
    out: list[Path] = []
    for entry in entries:
        text = os.fspath(entry)
        path = Path(text).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith((".txt", ".gz"))
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise TokenizerError(f"folder {text!r} holds no *.txt or *.gz files")
            out += found
        elif path.is_file():
            out.append(path)
        elif glob.has_magic(text):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(text), recursive=True) if Path(p).is_file())
            if not found:
                raise TokenizerError(f"no files match the pattern {text!r}")
            out += found
        else:
            raise TokenizerError(f"no such file or folder: {text!r}")
    return out


def _read_lines(paths: Sequence[Path], errors: str = "strict") -> Iterator[str]:
    """Lines of UTF-8 text files, plain or gzip (by the ``.gz`` suffix), without their newline; a byte that is not
    UTF-8 or a NUL byte (a binary file) is an error naming the file, line and offset, as pretraining's reader says."""
    from ..data.readers import DataError, _iter_lines

    for path in paths:
        try:
            for lineno, line in _iter_lines(path, path.suffix == ".gz", errors):
                if "\x00" in line:
                    raise TokenizerError(f"{path}:{lineno}: a NUL byte at column {line.index(chr(0)) + 1}: this looks "
                                         "like a binary file; expected UTF-8 text")
                yield line
        except DataError as e:
            raise TokenizerError(str(e)) from None
        except OSError as e:
            what = "gzip text" if path.suffix == ".gz" else "text"
            raise TokenizerError(f"{path}: cannot read it as {what} ({e.strerror or e})") from None


def _batched_nonblank(lines: Iterable[str], what: str) -> Iterator[list[str]]:
    """Non-blank lines in lists of ``_BATCH_LINES``; raises (before the first batch) if there are none."""
    it = (line for line in lines if line and not line.isspace())
    first = next(it, None)
    if first is None:
        raise TokenizerError(f"empty corpus: {what} holds no non-blank line of text")
    it = itertools.chain([first], it)
    while batch := list(itertools.islice(it, _BATCH_LINES)):
        yield batch


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

def _special_tokens(specials: str, sentinels: int, extra_specials: Sequence[str]) -> list[str]:
    """Role tokens in SPECIAL_SETS order, then sentinels <extra_id_0>..., then extras; duplicates dropped."""
    tokens = [*SPECIAL_SETS[specials].values(), *(f"<extra_id_{i}>" for i in range(sentinels)), *extra_specials]
    return list(dict.fromkeys(tokens))


def _pipeline(kind: str, *, lowercase: bool, unk: str | None) -> tokenizers.Tokenizer:
    """An untrained tokenizers.Tokenizer with the model, normalizer, pre-tokenizer and decoder of ``kind``."""
    if kind == "bpe":  # GPT-2 / RoBERTa
        tk = tokenizers.Tokenizer(models.BPE())  # no unk: every byte has a token
        tk.normalizer = normalizers.Lowercase() if lowercase else None
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
    elif kind == "wordpiece":  # BERT
        tk = tokenizers.Tokenizer(models.WordPiece(unk_token=unk, continuing_subword_prefix="##",
                                                   max_input_chars_per_word=100))
        tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                   lowercase=lowercase)
        tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    else:  # T5 / SentencePiece (nmt_nfkc: NFKC, extra whitespace removed)
        tk = tokenizers.Tokenizer(models.Unigram())
        steps = [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
        tk.normalizer = normalizers.Sequence(steps + ([normalizers.Lowercase()] if lowercase else []))
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return tk


def _trainer(kind: str, *, vocab_size: int, special_tokens: list[str], unk: str | None, min_frequency: int,
             show_progress: bool) -> trainers.Trainer:
    added = [AddedToken(t, special=True, normalized=False, lstrip=t in _LSTRIP_TOKENS) for t in special_tokens]
    if kind == "bpe":
        return trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=added,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    if kind == "wordpiece":
        # Each kept character costs two tokens (c and ##c): keep the alphabet to a quarter of the budget.
        limit = min(_MAX_WORDPIECE_ALPHABET, (vocab_size - len(special_tokens)) // 4)
        return trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=added,
                                         limit_alphabet=limit, continuing_subword_prefix="##",
                                         show_progress=show_progress)
    return trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=added, unk_token=unk,
                                   show_progress=show_progress)


def _set_post_processor(tk: tokenizers.Tokenizer, specials: str) -> None:
    """Give the saved file its family's template ([CLS] A [SEP], ...) for Hugging Face loaders."""
    roles = SPECIAL_SETS[specials]
    roles = {"cls": roles.get("cls", roles.get("bos")), "sep": roles.get("sep", roles.get("eos")), **roles}
    single, pair = _TEMPLATES[specials]
    used = sorted({t for t in re.findall(r"\{(\w+)\}", single + pair)})
    tokens = [(roles[r], tk.token_to_id(roles[r])) for r in used]
    tk.post_processor = processors.TemplateProcessing(single=single.format(**roles), pair=pair.format(**roles),
                                                      special_tokens=list(dict.fromkeys(tokens)))


def train_tokenizer(files: str | os.PathLike | Iterable[str | os.PathLike] | None = None, *, kind: Kind,
                    vocab_size: int, specials: str | None = None, sentinels: int | None = None,
                    extra_specials: Sequence[str] = (), lowercase: bool | None = None, min_frequency: int = 2,
                    show_progress: bool = True, texts: Iterable[str] | None = None,
                    errors: str = "strict") -> Tokenizer:
    """Train a subword tokenizer on text files (or strings) and return it wrapped with its special-token roles.

    Lines are streamed to ``tokenizers``' ``train_from_iterator`` in batches, so gzip files work and
    memory stays small; blank lines are skipped.

    Args:
        files: a path, folder (its ``*.txt`` and ``*.gz`` files, recursively) or glob pattern, or a list
            of them; ``.gz`` files are read as gzip. Give either ``files`` or ``texts``.
        kind: ``"bpe"`` (byte-level, GPT-2/RoBERTa), ``"wordpiece"`` (BERT) or ``"unigram"`` (T5/SentencePiece).
        vocab_size: size of the final vocabulary, special tokens and sentinels included. At least the
            special tokens + 256 bytes for bpe, + 100 for wordpiece and unigram; a corpus whose alphabet
            does not fit raises after training.
        specials: a SPECIAL_SETS name (``"bert"``, ``"roberta"``, ``"t5"``); default DEFAULT_SPECIALS[kind].
            Its tokens get the first ids, in the set's order (pad is id 0 for bert and t5; roberta keeps
            RoBERTa's order <s>=0, <pad>=1, </s>=2, <unk>=3).
        sentinels: number of T5 sentinels ``<extra_id_0>``, ``<extra_id_1>``, ... added (in that order, right
            after the role tokens); default 100 for ``specials="t5"``, else 0.
        extra_specials: more special tokens, after the sentinels.
        lowercase: lowercase the text before tokenizing; default True for wordpiece (like bert-base-uncased,
            which also strips accents), False for bpe and unigram (GPT-2, RoBERTa and T5 keep case).
        min_frequency: least count of a merged pair (bpe, wordpiece); the unigram trainer has no such knob.
        show_progress: show tokenizers' progress bars.
        texts: an iterable of strings to train on instead of files (each string may hold several lines).
        errors: a byte that is not UTF-8: ``"strict"`` stops naming the file, line and offset; ``"replace"`` reads
            it as U+FFFD.

    Returns:
        The trained :class:`Tokenizer`; ``tokenizer.vocab_size <= vocab_size`` (fewer on a small corpus).
    """
    if kind not in KINDS:
        raise TokenizerError(f"unknown tokenizer kind {kind!r}: expected one of {', '.join(KINDS)}")
    specials = DEFAULT_SPECIALS[kind] if specials is None else specials
    if specials not in SPECIAL_SETS:
        raise TokenizerError(f"unknown special-token set {specials!r}: expected one of {', '.join(SPECIAL_SETS)}")
    sentinels = (DEFAULT_SENTINELS if specials == "t5" else 0) if sentinels is None else sentinels
    if isinstance(sentinels, bool) or not isinstance(sentinels, int) or sentinels < 0:
        raise TokenizerError(f"sentinels ({sentinels!r}) must be an integer >= 0")
    if isinstance(extra_specials, str):
        raise TokenizerError(f"extra_specials ({extra_specials!r}) must be a list of token strings, not one string")
    lowercase = (kind == "wordpiece") if lowercase is None else lowercase
    special_tokens = _special_tokens(specials, sentinels, extra_specials)
    minimum = len(special_tokens) + _MIN_MODEL_VOCAB[kind]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise TokenizerError(
            f"vocab_size ({vocab_size!r}) is too small for a {kind} tokenizer with {len(special_tokens)} special "
            f"tokens: expected at least {minimum} ({len(special_tokens)} special + {_MIN_MODEL_VOCAB[kind]} "
            f"{'byte tokens' if kind == 'bpe' else 'for a minimal alphabet'})")
    if (files is None) == (texts is None):
        raise TokenizerError("give exactly one of files (paths, folders or glob patterns) and texts (strings)")

    if texts is not None:
        if isinstance(texts, str):
            raise TokenizerError("texts must be an iterable of strings, not one string")
        length = len(texts) if hasattr(texts, "__len__") else None
        batches = _batched_nonblank(texts, "texts")
    else:
        paths = _expand_files(files)
        length = None  # counting the lines of (gzip) files would mean reading them twice
        shown = ", ".join(map(str, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        batches = _batched_nonblank(_read_lines(paths, errors), shown)

    unk = SPECIAL_SETS[specials].get("unk")
    if unk is None and kind != "bpe":  # every set has one today; a future set might not
        raise TokenizerError(f"a {kind} tokenizer needs an unk token, and special set {specials!r} has none")
    tk = _pipeline(kind, lowercase=lowercase, unk=unk)
    trainer = _trainer(kind, vocab_size=vocab_size, special_tokens=special_tokens, unk=unk,
                       min_frequency=min_frequency, show_progress=show_progress)
    batches = iter(batches)
    first = next(batches)  # raises the empty-corpus error here, before the trainer starts
    try:
        tk.train_from_iterator(itertools.chain([first], batches), trainer=trainer, length=length)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception
        if "not large enough" in str(e):
            raise TokenizerError(f"vocab_size ({vocab_size}) is too small for this corpus: a {kind} vocabulary must "
                                 f"hold every character of the corpus plus {len(special_tokens)} special tokens "
                                 f"(tokenizers: {e}); raise vocab_size") from e
        raise
    if tk.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise TokenizerError(f"vocab_size ({vocab_size}) is too small for this corpus: its {kind} alphabet and "
                             f"special tokens alone take {tk.get_vocab_size(with_added_tokens=True)} tokens; "
                             f"expected vocab_size >= that")
    _set_post_processor(tk, specials)
    # tokenizers' JSON reader can round a float score by one ulp: pass through JSON once so that the
    # returned tokenizer equals (encodings, tokenizer_sha) what save -> load gives back.
    tk = tokenizers.Tokenizer.from_str(tk.to_str())
    return Tokenizer(tk, roles=SPECIAL_SETS[specials])


# --------------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------------

def _hf_role_overrides(folder: Path, tk: tokenizers.Tokenizer) -> dict[str, str]:
    """Roles from a Hugging Face folder's tokenizer_config.json / special_tokens_map.json (null = no opinion)."""
    roles: dict[str, str] = {}
    for name in _HF_SPECIAL_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{file}: not a readable JSON file ({e})") from e
        if not isinstance(data, dict):
            raise TokenizerError(f"{file}: expected a JSON object, got {type(data).__name__}")
        for role in ROLES:
            value = data.get(f"{role}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise TokenizerError(f'{file}: {role}_token is {value!r}; expected a string or {{"content": string}}')
            if tk.token_to_id(value) is None:
                raise TokenizerError(f"{file}: {role}_token {value!r} is not in the tokenizer's vocabulary")
            roles[role] = value
    return roles


class Tokenizer:
    """Our wrapper: a ``tokenizers.Tokenizer`` plus the roles of its special tokens.

    Attributes:
        tk: the underlying ``tokenizers.Tokenizer`` (padding and truncation switched off).
        pad_id, unk_id, cls_id, sep_id, mask_id, bos_id, eos_id: ids of the roles, None where the
            tokenizer has no such token. cls falls back to bos and bos to cls, sep to eos and eos to sep.
        sentinel_ids: ids of ``<extra_id_0>``, ``<extra_id_1>``, ... in that order (T5 span corruption).
        special_ids: every special token id (added special tokens, roles, sentinels).
    """

    def __init__(self, tk: tokenizers.Tokenizer, *, roles: Mapping[str, str] | None = None):
        """Wrap ``tk``; roles are inferred from known token strings.

        Args:
            tk: a ``tokenizers.Tokenizer``; its padding and truncation are switched off (Hugging Face files
                such as all-MiniLM-L6-v2's pad and truncate every encoding to 128 tokens).
            roles: role -> token string (roles in ROLES), overriding the inference.
        """
        if not isinstance(tk, tokenizers.Tokenizer):
            raise TokenizerError(f"expected a tokenizers.Tokenizer, got {type(tk).__name__}")
        tk.no_padding()
        tk.no_truncation()
        self.tk = tk
        added = tk.get_added_tokens_decoder()  # id -> AddedToken
        special_strings = {t.content for t in added.values() if t.special}

        found: dict[str, str | None] = {}
        for role, candidates in _ROLE_CANDIDATES.items():
            found[role] = next((c for c in candidates if c in special_strings), None)
        inferred = dict(found)
        for role, token in (roles or {}).items():
            if role not in ROLES:
                raise TokenizerError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
            if tk.token_to_id(token) is None:
                raise TokenizerError(f"the {role} token {token!r} is not in the vocabulary")
            found[role] = token
        found["cls"] = found["cls"] or found["bos"]
        found["bos"] = found["bos"] or found["cls"]
        found["sep"] = found["sep"] or found["eos"]
        found["eos"] = found["eos"] or found["sep"]
        self.roles: dict[str, str | None] = found  # role -> token string
        ids = {role: (None if token is None else tk.token_to_id(token)) for role, token in found.items()}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id = ids["pad"], ids["unk"], ids["cls"], ids["sep"]
        self.mask_id, self.bos_id, self.eos_id = ids["mask"], ids["bos"], ids["eos"]

        numbered = {}
        for i, t in added.items():
            if m := _SENTINEL_RE.fullmatch(t.content):
                numbered[int(m.group(1))] = i
        self.sentinel_ids: list[int] = list(itertools.takewhile(lambda i: i is not None,
                                                                (numbered.get(n) for n in range(len(numbered)))))
        self.special_ids: frozenset[int] = frozenset(
            [i for i, t in added.items() if t.special] + [i for i in ids.values() if i is not None]
            + self.sentinel_ids)
        self._json: dict | None = None
        # roles set from outside that inference would not find (a tokenizer_config.json's): saved beside it again
        self.role_overrides: dict[str, str] = {r: t for r, t in (roles or {}).items() if inferred.get(r) != t}
        # the Jinja chat template of a chat model's folder (chat_template.jinja / tokenizer_config.json), None: none
        self.chat_template: str | None = None

    # ---- facts ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tk.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def kind(self) -> str:
        """The model type, lowercased: ``"bpe"``, ``"wordpiece"``, ``"unigram"`` (or ``"wordlevel"``)."""
        return self._parsed()["model"]["type"].lower()

    def __repr__(self) -> str:
        roles = ", ".join(f"{r}={t!r}" for r, t in self.roles.items() if t is not None)
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, {roles}, "
                f"sentinels={len(self.sentinel_ids)})")

    def _parsed(self) -> dict:
        if self._json is None:
            self._json = json.loads(self.tk.to_str())
        return self._json

    # ---- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added (a post-processor's [CLS]/[SEP] is skipped)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by tokenizers; no special tokens are added."""
        if isinstance(texts, str):
            raise TokenizerError("encode_batch expects a list of strings, not one string")
        texts = list(texts)
        if not texts:
            return []
        return [e.ids for e in self.tk.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list, numpy array or 1-d tensor); special tokens dropped if ``skip_special_tokens``."""
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if it is not in the vocabulary."""
        return self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """Token string of an id, or None if the id is out of range."""
        return self.tk.id_to_token(int(i))

    # ---- whole-word masking -----------------------------------------------------------------------
    def _word_marker(self) -> tuple[str, str] | None:
        """("prefix", "##") when continuations are marked, ("start", "Ġ"/"▁") when word starts are, else None."""
        data = self._parsed()
        prefix = data["model"].get("continuing_subword_prefix")
        if data["model"]["type"] == "WordPiece" or prefix:
            return ("prefix", prefix or "##")
        around = json.dumps([data.get("normalizer"), data.get("pre_tokenizer"), data.get("decoder")],
                            ensure_ascii=False)
        if '"ByteLevel"' in around:
            return ("start", "Ġ")  # GPT-2 byte-level: a leading space is the byte Ġ
        if '"Metaspace"' in around or "▁" in around:
            return ("start", "▁")  # SentencePiece / T5 / Llama
        return None

    def word_start_mask(self) -> np.ndarray:
        """Bool array (vocab_size,): True where a token begins a new word, for whole-word masking.

        WordPiece: tokens not starting with ``##``. Byte-level BPE (``Ġ``) and SentencePiece-style
        (``▁``): tokens starting with the marker or not starting with a letter/digit (punctuation,
        newlines). Special and added tokens are True. A tokenizer with no known marker gets all True.
        Byte-level BPE encodes a text's first word without ``Ġ`` (no prefix space, like GPT-2), so callers
        should also treat position 0 of a text as a word start.
        """
        mask = np.ones(self.vocab_size, dtype=bool)
        marker = self._word_marker()
        if marker is None:
            return mask
        how, sym = marker
        for token, i in self.tk.get_vocab(with_added_tokens=False).items():
            if i >= len(mask):
                continue
            if how == "prefix":
                mask[i] = not token.startswith(sym)
            else:
                mask[i] = token.startswith(sym) or not token[:1].isalnum()
        for i in self.tk.get_added_tokens_decoder():
            if i < len(mask):
                mask[i] = True
        return mask

    # ---- files ------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` atomically (temporary file + ``os.replace``); saved as ``tokenizer.json``, the
        roles a ``tokenizer_config.json`` set and the chat template go beside it (``tokenizer_config.json``,
        ``chat_template.jinja``) so that a model folder keeps them.

        Args:
            path: a file (ending in ``.json``) or a folder (created if missing) to hold ``tokenizer.json``.

        Returns:
            The path of the written file.
        """
        path = Path(path)
        file = path if path.suffix == ".json" and not path.is_dir() else path / "tokenizer.json"
        file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(file, self.tk.to_str(pretty=True))
        if file.name == "tokenizer.json" and (self.role_overrides or self.chat_template):
            # a model folder: what the tokenizer.json cannot hold goes beside it, as Hugging Face folders keep it
            config = {f"{role}_token": token for role, token in self.role_overrides.items()}
            text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
            write_atomic(file.parent / "tokenizer_config.json", text)
            if self.chat_template:
                write_atomic(file.parent / CHAT_TEMPLATE_NAME, self.chat_template)
        return file

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a ``tokenizer.json`` file, or a folder holding one (a pretune checkpoint or a Hugging Face folder).
        A folder with only a SentencePiece model (ALBERT, T5, DeBERTa-v3) or that file converts once (pretune.io.spm).

        Roles are inferred from known token strings; ``tokenizer_config.json`` and ``special_tokens_map.json``
        beside the file (``bos_token``, ``pad_token``, ...: a string or ``{"content": ...}``) override them. A chat
        model's template (``chat_template.jinja``, else ``chat_template.json`` or ``tokenizer_config.json``'s
        ``"chat_template"``) is kept in ``chat_template`` and saved with the tokenizer.
        """
        tok = cls._load(path)
        tok.chat_template = read_chat_template(Path(path).expanduser())
        return tok

    @classmethod
    def _load(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path).expanduser()
        if path.is_dir():
            file = path / "tokenizer.json"
            if not file.is_file():
                from .spm import find_model

                if (model := find_model(path)) is not None:
                    return cls._from_spm(model)
                slow = [n for n in ("vocab.txt", "vocab.json") if (path / n).is_file()]
                hint = (f" (it holds {', '.join(slow)}: convert once with transformers, "
                        f"AutoTokenizer.from_pretrained(folder).save_pretrained(folder))") if slow else ""
                raise TokenizerError(f"folder {str(path)!r} holds no tokenizer.json{hint}")
        elif path.is_file() and path.suffix == ".model":
            return cls._from_spm(path)
        elif path.is_file():
            file = path
        else:
            raise TokenizerError(f"no such tokenizer file or folder: {str(path)!r}")
        try:
            tk = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or a non-tokenizer object
            raise TokenizerError(f"{file} is not a valid tokenizer.json ({e})") from e
        return cls(tk, roles=_hf_role_overrides(file.parent, tk))

    @classmethod
    def _from_spm(cls, model: Path) -> Tokenizer:
        """A folder with only a SentencePiece model (ALBERT, T5, DeBERTa-v2/v3): converted once (``pretune.io.spm``)."""
        from .spm import SentencePieceError, convert

        try:
            tk = convert(model)
        except SentencePieceError as e:
            raise TokenizerError(str(e)) from None
        return cls(tk, roles=_hf_role_overrides(model.parent, tk))


CHAT_TEMPLATE_NAME = "chat_template.jinja"


def read_chat_template(path: Path) -> str | None:
    """The default chat template of the folder of ``path`` (as transformers looks for it: chat_template.jinja, else
    chat_template.json, else tokenizer_config.json's "chat_template", a string or a list of named templates);
    None when it has none."""
    folder = path if path.is_dir() else path.parent
    if (folder / CHAT_TEMPLATE_NAME).is_file():
        return (folder / CHAT_TEMPLATE_NAME).read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            continue
        try:
            value = json.loads((folder / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue  # a broken config is reported where roles are read
        if isinstance(value, list):
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"),
                         None)
        if isinstance(value, str):
            return value
    return None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Same as :meth:`Tokenizer.load`: a tokenizer.json file or a folder holding one."""
    return Tokenizer.load(path)


def tokenizer_sha(tok: Tokenizer | tokenizers.Tokenizer) -> str:
    """Hex sha256 of the canonical tokenizer.json (sorted keys, compact): the key of token caches."""
    tk = tok.tk if isinstance(tok, Tokenizer) else tok
    if not isinstance(tk, tokenizers.Tokenizer):
        raise TokenizerError(f"tokenizer_sha expects a Tokenizer, got {type(tok).__name__}")
    canonical = json.dumps(json.loads(tk.to_str()), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
