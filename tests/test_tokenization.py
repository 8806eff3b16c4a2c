"""Tests for pretune.io.tokenization: training the three recipes, roles, save/load, Hugging Face folders, errors."""

from __future__ import annotations

import gzip
import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pretune.io.tokenization import (
    DEFAULT_SPECIALS,
    SPECIAL_SETS,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    tokenizer_sha,
    train_tokenizer,
)

CORPUS = Path("/work/shared/data/corpus")
KINDS = ("bpe", "wordpiece", "unigram")
VOCAB = 2000
TEXT = ("Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world.\n"
        "Anarchism is a political philosophy; its   critics disagree (strongly) about 1984!")
RARE = ("antidisestablishmentarianism", "Zyxquorbian")


def _corpus_lines(chars_per_file: int = 400_000) -> list[str]:
    """The first ~0.4 MB of two corpus files: enough for a 2000-token vocabulary, fast to train on."""
    lines: list[str] = []
    for name in ("austen.txt.gz", "enwiki_sample.txt.gz"):
        path = CORPUS / name
        if not path.is_file():
            pytest.skip(f"training corpus {path} not found")
        n = 0
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                lines.append(line)
                n += len(line)
                if n > chars_per_file:
                    break
    return lines


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    """One tokenizer per kind, each with its default special set, trained once for the module."""
    lines = _corpus_lines()
    return {kind: train_tokenizer(texts=lines, kind=kind, vocab_size=VOCAB, show_progress=False) for kind in KINDS}


def _same(a: Tokenizer, b: Tokenizer, texts: list[str]) -> None:
    assert a.encode_batch(texts) == b.encode_batch(texts)
    assert a.roles == b.roles
    for role in ("pad", "unk", "cls", "sep", "mask", "bos", "eos"):
        assert getattr(a, f"{role}_id") == getattr(b, f"{role}_id"), role
    assert (a.sentinel_ids, a.special_ids, a.vocab_size) == (b.sentinel_ids, b.special_ids, b.vocab_size)
    assert tokenizer_sha(a) == tokenizer_sha(b)


# ---- training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_trains_to_the_requested_size(trained, kind):
    tok = trained[kind]
    assert tok.kind == kind
    assert tok.vocab_size == VOCAB == len(tok)
    assert tok.word_start_mask().shape == (VOCAB,)


def test_bpe_round_trips_any_text_exactly(trained):
    tok = trained["bpe"]
    text = TEXT + "\n\tnaïve café 東京 🙂  <- unseen characters are bytes, never unknown"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.unk_id not in ids


def test_wordpiece_round_trips_modulo_case_and_spacing(trained):
    tok = trained["wordpiece"]
    ids = tok.encode(TEXT)
    assert tok.unk_id not in ids
    assert "".join(tok.decode(ids).split()) == "".join(TEXT.lower().split())  # lowercase by default, like BERT


def test_unigram_round_trips_modulo_nfkc_and_whitespace(trained):
    tok = trained["unigram"]
    text = TEXT + " the ﬁrst"  # the ligature ﬁ becomes "fi" under NFKC
    ids = tok.encode(text)
    assert tok.unk_id not in ids
    assert tok.decode(ids) == " ".join(unicodedata.normalize("NFKC", text).split())
    assert tok.decode(ids) != text  # case kept, whitespace collapsed like SentencePiece


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("word", RARE)
def test_rare_word_splits_into_subwords_never_unk(trained, kind, word):
    tok = trained[kind]
    ids = tok.encode(word)
    assert len(ids) >= 3
    assert tok.unk_id not in ids
    assert not set(ids) & tok.special_ids


@pytest.mark.parametrize("kind", KINDS)
def test_encode_batch_equals_encode_and_adds_no_special_tokens(trained, kind):
    tok = trained[kind]
    texts = [TEXT, "", "a", RARE[0]]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert not set(tok.encode(TEXT)) & tok.special_ids
    assert tok.encode_batch([]) == []


def test_saved_post_processor_adds_family_specials_for_hf_loaders(trained):
    """The underlying encode (what Hugging Face loaders call) frames text like BERT, RoBERTa, T5."""
    bert, roberta, t5 = trained["wordpiece"], trained["bpe"], trained["unigram"]
    assert bert.tk.encode("a b").ids == [bert.cls_id, *bert.encode("a b"), bert.sep_id]
    assert roberta.tk.encode("a b").ids == [roberta.bos_id, *roberta.encode("a b"), roberta.eos_id]
    assert t5.tk.encode("a b").ids == [*t5.encode("a b"), t5.eos_id]


# ---- special tokens -------------------------------------------------------------------------------

def test_special_token_roles_and_ids(trained):
    bert, roberta, t5 = trained["wordpiece"], trained["bpe"], trained["unigram"]
    # bert set in its dict order, pad = 0; bos/eos fall back to cls/sep
    assert (bert.pad_id, bert.unk_id, bert.cls_id, bert.sep_id, bert.mask_id) == (0, 1, 2, 3, 4)
    assert (bert.bos_id, bert.eos_id) == (bert.cls_id, bert.sep_id)
    # roberta keeps RoBERTa's order <s>=0, <pad>=1, </s>=2, <unk>=3; cls/sep fall back to bos/eos
    assert (roberta.bos_id, roberta.pad_id, roberta.eos_id, roberta.unk_id, roberta.mask_id) == (0, 1, 2, 3, 4)
    assert (roberta.cls_id, roberta.sep_id) == (0, 2)
    # t5: pad 0, eos 1, unk 2, then 100 sentinels in order; no cls, bos or mask
    assert (t5.pad_id, t5.eos_id, t5.unk_id, t5.sep_id) == (0, 1, 2, 1)
    assert (t5.cls_id, t5.bos_id, t5.mask_id) == (None, None, None)
    assert t5.sentinel_ids == list(range(3, 103))
    assert [t5.id_to_token(i) for i in t5.sentinel_ids[:2]] == ["<extra_id_0>", "<extra_id_1>"]
    assert t5.special_ids == frozenset(range(103))
    assert bert.special_ids == roberta.special_ids == frozenset(range(5))
    for tok, kind in ((bert, "wordpiece"), (roberta, "bpe"), (t5, "unigram")):
        for role, token in SPECIAL_SETS[DEFAULT_SPECIALS[kind]].items():
            assert tok.id_to_token(getattr(tok, f"{role}_id")) == token
    assert t5.token_to_id("<extra_id_99>") == 102 and t5.token_to_id("no-such-token") is None


def test_special_strings_in_text_map_to_their_ids(trained):
    bert = trained["wordpiece"]
    assert bert.encode("[MASK]") == [bert.mask_id]
    assert bert.decode([bert.cls_id, *bert.encode("hello"), bert.sep_id], skip_special_tokens=True) == "hello"


def test_other_specials_sentinels_and_extras():
    lines = ["the cat sat on the mat", "a dog ran"] * 50
    tok = train_tokenizer(texts=lines, kind="bpe", vocab_size=400, specials="t5", sentinels=3,
                          extra_specials=["<sep2>"], show_progress=False)
    assert [tok.id_to_token(i) for i in range(7)] == ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_1>",
                                                      "<extra_id_2>", "<sep2>"]
    assert tok.sentinel_ids == [3, 4, 5] and 6 in tok.special_ids
    assert tok.decode(np.array(tok.encode("the cat"))) == "the cat"  # numpy ids are accepted


# ---- word starts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_word_start_mask_marks_first_subword_of_each_word(trained, kind):
    tok = trained[kind]
    mask = tok.word_start_mask()
    assert mask.dtype == np.bool_
    assert mask[sorted(tok.special_ids)].all()
    for word in RARE:
        ids = tok.encode(" " + word)  # byte-level BPE marks a word start by its leading space (Ġ)
        assert mask[ids[0]], tok.id_to_token(ids[0])
        assert not mask[ids[1:]].any(), [tok.id_to_token(i) for i in ids]
    starts = [bool(mask[i]) for i in tok.encode(" the cat, the dog")]
    assert sum(starts) == 5  # the, cat, ",", the, dog


# ---- save / load ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_save_load_gives_identical_tokenizer(trained, kind, tmp_path):
    tok = trained[kind]
    file = tok.save(tmp_path / "ckpt")
    assert file == tmp_path / "ckpt" / "tokenizer.json" and file.is_file()
    assert not [p for p in file.parent.iterdir() if p != file]  # no temporary file left behind
    texts = [TEXT, *RARE, "<extra_id_0> [MASK] <mask>"]
    _same(tok, Tokenizer.load(tmp_path / "ckpt"), texts)
    _same(tok, load_tokenizer(file), texts)
    other = tok.save(tmp_path / "named.json")
    assert other.read_text() == file.read_text()


def test_tokenizer_sha_keys_the_tokenizer(trained):
    shas = {kind: tokenizer_sha(tok) for kind, tok in trained.items()}
    assert len(set(shas.values())) == 3
    assert all(len(s) == 64 and int(s, 16) >= 0 for s in shas.values())
    assert tokenizer_sha(trained["bpe"].tk) == shas["bpe"]


# ---- files ----------------------------------------------------------------------------------------

def test_trains_from_gzip_and_plain_files_folders_and_globs(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    with gzip.open(folder / "a.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write("the quokkalicious cat sat on the mat\n" * 200)
    (folder / "b.txt").write_text("\n\nthe dog ran far away\n" * 200)
    (folder / "notes.json").write_text("{}")  # not a text file: ignored inside a folder
    for files in (folder, str(folder / "*.txt*"), [folder / "a.txt.gz", folder / "b.txt"]):
        tok = train_tokenizer(files, kind="bpe", vocab_size=300, show_progress=False)
        assert len(tok.encode(" quokkalicious")) <= 2  # frequent in the gzip file: merged
        assert len(tok.encode(" dog")) == 1  # frequent in the plain file
    tok = train_tokenizer(folder, kind="wordpiece", vocab_size=200, show_progress=False)
    assert tok.encode("the dog") == [tok.token_to_id("the"), tok.token_to_id("dog")]


# ---- Hugging Face folders -------------------------------------------------------------------------

def test_minilm_matches_transformers():
    realmodels = pytest.importorskip("pretune.realmodels")
    transformers = pytest.importorskip("transformers")
    try:
        folder = realmodels.minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = load_tokenizer(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for role in ("cls", "sep", "mask", "pad", "unk"):
        assert getattr(tok, f"{role}_id") == getattr(hf, f"{role}_token_id"), role
    text = ("Hello, World! Tokenizers aren't hard: antidisestablishmentarianism — naïve café 東京. " * 20)
    ids = tok.encode(text)
    assert len(ids) > 128  # the file's own truncation/padding to 128 is switched off
    assert ids == hf(text, add_special_tokens=False).input_ids
    assert tok.encode_batch([text, "a"]) == [ids, hf("a", add_special_tokens=False).input_ids]
    mask = tok.word_start_mask()
    assert [bool(mask[i]) for i in tok.encode("unbelievable tokenizers")] == [
        not tok.id_to_token(i).startswith("##") for i in tok.encode("unbelievable tokenizers")]


def _gpt2_style(folder: Path) -> Path:
    """A GPT-2-style byte-level BPE whose only special token is <|endoftext|>, built with tokenizers."""
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["the cat sat on the mat", "hello world"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    folder.mkdir()
    tk.save(str(folder / "tokenizer.json"))
    return folder


def test_gpt2_style_roles_and_hf_overrides(tmp_path):
    folder = _gpt2_style(tmp_path / "gpt2")
    tok = load_tokenizer(folder)
    assert tok.bos_id == tok.eos_id == tok.unk_id == tok.cls_id == tok.sep_id == 0
    assert (tok.pad_id, tok.mask_id, tok.sentinel_ids) == (None, None, [])
    # a Hugging Face special_tokens_map.json (string or {"content": ...}) overrides the inference
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": {"content": "<|endoftext|>", "lstrip": False}, "mask_token": None}))
    assert load_tokenizer(folder).pad_id == 0
    (folder / "tokenizer_config.json").write_text(json.dumps({"mask_token": "Ġcat", "model_max_length": 1024}))
    assert load_tokenizer(folder).mask_id == tok.token_to_id("Ġcat")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|startoftext|>"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: bos_token '<\|startoftext\|>' is not in"):
        load_tokenizer(folder)


def test_t5_style_folder_matches_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    t5 = trained["unigram"]
    file = t5.save(tmp_path / "t5")
    (tmp_path / "t5" / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>", "unk_token": "<unk>",
        "additional_special_tokens": [f"<extra_id_{i}>" for i in range(100)]}))
    tok = load_tokenizer(tmp_path / "t5")
    _same(t5, tok, [TEXT])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
    assert hf(TEXT).input_ids == [*tok.encode(TEXT), tok.eos_id]  # T5 appends </s>
    assert hf(TEXT, add_special_tokens=False).input_ids == tok.encode(TEXT)


def test_smollm2_gpt2_style_folder_matches_transformers():
    """SmolLM2's converted folder (byte-level BPE; tokenizer_config.json sets bos/eos/pad); skipped if absent."""
    transformers = pytest.importorskip("transformers")
    root = Path(os.environ.get("PRETUNE_CACHE", Path.home() / ".cache" / "pretune")).expanduser()
    folder = root / "smollm2-135m-instruct"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"{folder} not converted yet (pretune.realmodels.smollm2_dir())")
    tok = load_tokenizer(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for role in ("bos", "eos", "pad", "unk"):
        assert getattr(tok, f"{role}_id") == getattr(hf, f"{role}_token_id"), role
    assert tok.encode(TEXT) == hf(TEXT, add_special_tokens=False).input_ids
    assert tok.decode(tok.encode(TEXT)) == TEXT


# ---- errors ---------------------------------------------------------------------------------------

def test_error_empty_corpus(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    with pytest.raises(TokenizerError, match=r"empty corpus: .*empty\.txt holds no non-blank line"):
        train_tokenizer(empty, kind="bpe", vocab_size=300)
    with pytest.raises(TokenizerError, match="empty corpus: texts"):
        train_tokenizer(texts=[], kind="wordpiece", vocab_size=300)


def test_error_vocab_too_small():
    with pytest.raises(TokenizerError, match=r"vocab_size \(100\) is too small .* at least 261 \(5 special \+ 256"):
        train_tokenizer(texts=["a b"], kind="bpe", vocab_size=100)
    with pytest.raises(TokenizerError, match=r"at least 203 \(103 special"):  # 3 roles + 100 sentinels
        train_tokenizer(texts=["a b"], kind="unigram", vocab_size=150)
    cjk = ["".join(chr(0x4E00 + i) for i in range(j, j + 20)) for j in range(0, 300, 5)]
    with pytest.raises(TokenizerError, match=r"vocab_size \(150\) is too small for this corpus"):
        train_tokenizer(texts=cjk, kind="unigram", vocab_size=150, sentinels=0, show_progress=False)


def test_error_unknown_kind_or_specials():
    with pytest.raises(TokenizerError, match=r"unknown tokenizer kind 'sentencepiece': expected one of bpe, "
                                             r"wordpiece, unigram"):
        train_tokenizer(texts=["a"], kind="sentencepiece", vocab_size=1000)
    with pytest.raises(TokenizerError, match=r"unknown special-token set 'gpt': expected one of bert, roberta, t5"):
        train_tokenizer(texts=["a"], kind="bpe", vocab_size=1000, specials="gpt")
    with pytest.raises(TokenizerError, match="exactly one of files"):
        train_tokenizer(kind="bpe", vocab_size=1000)


def test_error_missing_paths(tmp_path):
    with pytest.raises(TokenizerError, match=r"no files match the pattern '.*nowhere/\*\.txt\.gz'"):
        train_tokenizer(str(tmp_path / "nowhere" / "*.txt.gz"), kind="bpe", vocab_size=1000)
    with pytest.raises(TokenizerError, match=r"no such file or folder: '.*missing\.txt'"):
        train_tokenizer(tmp_path / "missing.txt", kind="bpe", vocab_size=1000)
    with pytest.raises(TokenizerError, match=r"no such tokenizer file or folder: '.*nothing'"):
        load_tokenizer(tmp_path / "nothing")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "vocab.txt").write_text("[PAD]\n")
    with pytest.raises(TokenizerError, match=r"holds no tokenizer\.json \(it holds vocab\.txt"):
        load_tokenizer(tmp_path / "bert")


def test_error_corrupt_tokenizer_json(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)
    other = tmp_path / "config.json"
    other.write_text('{"hidden_size": 32}')
    with pytest.raises(TokenizerError, match=r"config\.json is not a valid tokenizer\.json"):
        load_tokenizer(other)


def test_error_bad_gzip(tmp_path):
    fake = tmp_path / "fake.txt.gz"
    fake.write_text("not gzip at all\n")
    with pytest.raises(TokenizerError, match=r"fake\.txt\.gz: corrupt or truncated gzip data"):
        train_tokenizer(fake, kind="bpe", vocab_size=300)
