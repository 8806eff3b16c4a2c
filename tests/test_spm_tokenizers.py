"""SentencePiece-only folders (ALBERT's and T5's spiece.model, DeBERTa-v3's spm.model) load in pretune: converted
once (pretune.io.spm) to ids equal to the slow tokenizers' and to transformers' on real text, special tokens included.

The SentencePiece models are trained here on the bundled corpus (a second each), with the special pieces of the real
ones: ALBERT <pad> <unk> [CLS] [SEP] [MASK]; DeBERTa-v3 [PAD] [CLS] [SEP] [UNK] (its [MASK] is added_tokens.json's,
after the pieces); T5 <pad> </s> <unk> (+ 100 <extra_id_N> after them). Transformers 5 has no sentencepiece-backed
class for these families any more, so the slow reference is ``sentencepiece`` itself plus each slow tokenizer's own
steps, written out below as transformers 4's AlbertTokenizer / DebertaV2Tokenizer / T5Tokenizer took them.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
import re
import unicodedata
from pathlib import Path

import pytest

from pretune import bundled
from pretune.io.tokenization import Tokenizer, TokenizerError

FAMILIES = ("albert", "deberta-v2", "t5")
VOCAB = 800
SPM = {  # family -> (model file name, trainer arguments giving the real model's special pieces)
    "albert": ("spiece.model", dict(pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, control_symbols=["[CLS]", "[SEP]",
                                                                                                 "[MASK]"])),
    "deberta-v2": ("spm.model", dict(pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]",
                                     eos_piece="[SEP]", unk_piece="[UNK]")),
    "t5": ("spiece.model", dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)),
}
DEBERTA_SPECIALS = {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]", "sep_token": "[SEP]",
                    "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}  # deberta-v3-base's map
EDGE = ["  leading,  inner   and trailing spaces  ", "tabs\tand\nnewlines\r\nin one line", "naïve café Ångström Ñ",
        "``LaTeX quotes'' and \"plain\" ones", "1,000,000 people, 2, 3,4 and 12,5", "…ﬁne Ｆｕｌｌ-width ½ ²",
        "Hello WORLD", "a [MASK] b", "x <unk> y </s> <pad> [CLS] z", "", " ", "emoji 🙂 and 中文"]


def _lines(path: Path, start: int, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in itertools.islice(fh, start, start + n)]


def _task_texts(per_task: int) -> list[str]:
    out = []
    for task in ("sms_spam", "austen_ner", "wordnet_qa", "austen_edit_similarity", "wordnet_defines"):
        with open(bundled.task(task)["dev"], encoding="utf-8") as fh:
            for line in itertools.islice(fh, per_task):
                r = json.loads(line)
                out += [r[k] for k in ("text", "text_a", "text_b", "context", "question") if isinstance(r.get(k), str)]
                out += [" ".join(r["tokens"])] if "tokens" in r else []
    return out


@pytest.fixture(scope="module")
def spm():
    pytest.importorskip("google.protobuf", reason="reading SentencePiece models needs protobuf")
    return pytest.importorskip("sentencepiece", reason="SentencePiece folders need the sentencepiece package")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real text the models were not trained on: 60 lines of each corpus file, task records, edge cases."""
    lines = [t for f in bundled.corpus() for t in _lines(f, 3000, 60)]
    return lines + _task_texts(25) + EDGE


@pytest.fixture(scope="module")
def models(spm) -> dict[str, bytes]:
    """family -> a SentencePiece Unigram model (nmt_nfkc, like the real ones) trained on the bundled corpus."""
    lines = [t for f in bundled.corpus() for t in _lines(f, 0, 1000) if t.strip()]
    out = {}
    for family, (_, special) in SPM.items():
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=VOCAB,
                                       model_type="unigram", character_coverage=0.9995, num_threads=1,
                                       minloglevel=2, **special)
        out[family] = buf.getvalue()
    return out


def _folder(d: Path, family: str, model: bytes, **files) -> Path:
    """A Hugging Face folder as the real checkpoints ship it: the SentencePiece model, config.json (+ json files)."""
    d.mkdir(parents=True)
    (d / SPM[family][0]).write_bytes(model)
    files.setdefault("config.json", {"model_type": family})
    if family == "deberta-v2":  # microsoft/deberta-v3-base
        files.setdefault("tokenizer_config.json", {"do_lower_case": False, "vocab_type": "spm"})
        files.setdefault("special_tokens_map.json", DEBERTA_SPECIALS)
        files.setdefault("added_tokens.json", {"[MASK]": VOCAB})
    for name, data in files.items():
        (d / name).write_text(json.dumps(data))
    return d


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETUNE_CACHE", str(tmp_path / "cache"))


def _albert_text(text: str, lower: bool = True) -> str:
    text = " ".join(text.strip().split()).replace("``", '"').replace("''", '"')
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return text.lower() if lower else text


def _slow(family: str, sp, text: str, lower: bool | None = None) -> list[int]:
    """The ids of the slow tokenizer (transformers 4): its own steps around sentencepiece's encode."""
    if family == "albert":  # AlbertTokenizer.preprocess_text + _tokenize (google-research/albert tokenization.py)
        pieces = []
        for piece in sp.encode(_albert_text(text, lower=lower is not False), out_type=str):
            if len(piece) > 1 and piece[-1] == "," and piece[-2].isdigit():  # "1," -> "1" ","
                cur = sp.encode(piece[:-1].replace("▁", ""), out_type=str)
                if piece[0] != "▁" and cur[0][0] == "▁":
                    cur = cur[1:] if len(cur[0]) == 1 else [cur[0][1:], *cur[1:]]
                pieces += [*cur, piece[-1]]
            else:
                pieces.append(piece)
        return [sp.piece_to_id(p) for p in pieces]
    return sp.encode(text.lower() if lower else text)  # DebertaV2Tokenizer (do_lower_case), T5Tokenizer


def _with_specials(family: str, tok: Tokenizer, ids: list[int]) -> list[int]:
    return ids + [tok.eos_id] if family == "t5" else [tok.cls_id, *ids, tok.sep_id]


def _special_free(text: str) -> bool:
    return not re.search(r"\[(MASK|CLS)\]|</?s>|<unk>|<pad>", text)


# --------------------------------------------------------------------------------------------------
# Ids equal the slow and the fast tokenizers'
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_the_slow_tokenizer_on_real_text(family, spm, models, texts, tmp_path):
    folder = _folder(tmp_path / family, family, models[family])
    tok = Tokenizer.load(folder)
    sp = spm.SentencePieceProcessor(model_proto=models[family])
    plain = [t for t in texts if _special_free(t)]  # sentencepiece alone would spell "[MASK]" out
    assert len(plain) > 300
    assert tok.encode_batch(plain) == [_slow(family, sp, t) for t in plain]
    for text in plain[:50]:  # the post-processor adds the family's special tokens
        assert tok.tk.encode(text).ids == _with_specials(family, tok, _slow(family, sp, text))


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_transformers_on_real_text_with_special_tokens(family, spm, models, texts, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path / family, family, models[family])
    tok = Tokenizer.load(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.vocab_size == len(hf)
    if family == "deberta-v2":  # transformers 5 leaves the model's NFKC map out of DeBERTa's pipeline (not the slow)
        texts = [t for t in texts if unicodedata.normalize("NFKC", t) == t]
    assert len(texts) > 300
    assert [tok.tk.encode(t).ids for t in texts] == hf(texts)["input_ids"]
    assert tok.encode_batch(texts) == hf(texts, add_special_tokens=False)["input_ids"]
    pairs = list(zip(texts[::2], texts[1::2]))[:100]
    ours = [tok.tk.encode(a, b) for a, b in pairs]
    theirs = hf([a for a, _ in pairs], [b for _, b in pairs], return_token_type_ids=True)
    assert [e.ids for e in ours] == theirs["input_ids"]
    assert [e.type_ids for e in ours] == theirs["token_type_ids"]
    text = "Emma [MASK] <unk> rich <extra_id_0> </s>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == hf.decode(hf(text)["input_ids"],
                                                                                skip_special_tokens=True)


def test_albert_number_comma_pieces_are_never_produced(spm, models, tmp_path):
    """ALBERT's tokenization.py re-splits a piece ending in digit + comma ("▁1," -> "▁1" ","); albert-base-v2's
    vocabulary has such pieces, the trained one not: they are added here. One Unigram model cannot re-split after
    choosing, so (as transformers' AlbertConverter, whose output albert-base-v2's tokenizer.json is) such pieces
    score -100: never produced, and the ids equal the slow tokenizer's wherever sentencepiece chose none of them.
    Where it did, the best split without them may differ from the re-split ("▁1" "0," -> "▁1" "0" ",", while
    "▁" "10" "," scores better): 3 of the 241 lines here."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(models["albert"])
    for piece, score in (("▁1,", -5.0), ("0,", -5.0), ("5,", -6.0), ("▁2,", -6.0)):
        proto.pieces.add(piece=piece, score=score)
    model = proto.SerializeToString()
    tok = Tokenizer.load(_folder(tmp_path / "albert", "albert", model))
    sp = spm.SentencePieceProcessor(model_proto=model)
    lines = [t for f in bundled.corpus() for t in _lines(f, 0, 3000) if re.search(r"\d,", t)]
    lines += ["1,000, 5, and 20,000 then 1995, 1,2,3"]
    ours = tok.encode_batch(lines)
    comma = {i for i in range(tok.vocab_size) if re.fullmatch(r".*\d,", tok.id_to_token(i))}
    assert len(comma) == 4 and not comma & {i for ids in ours for i in ids}
    chose = [bool(comma & set(sp.encode(_albert_text(t)))) for t in lines]
    assert sum(chose) > 50
    assert [ids for ids, c in zip(ours, chose) if not c] == [_slow("albert", sp, t) for t, c in zip(lines, chose)
                                                             if not c]
    same = sum(ids == _slow("albert", sp, t) for ids, t in zip(ours, lines))
    assert same >= 0.98 * len(lines), (same, len(lines))


@pytest.mark.parametrize("family,config,lower", [
    ("albert", {"do_lower_case": False}, False),
    ("deberta-v2", {"do_lower_case": True, "vocab_type": "spm"}, True),
])
def test_tokenizer_config_options_are_followed(family, config, lower, spm, models, texts, tmp_path):
    folder = _folder(tmp_path / family, family, models[family], **{"tokenizer_config.json": config})
    tok = Tokenizer.load(folder)
    sp = spm.SentencePieceProcessor(model_proto=models[family])
    plain = [t for t in texts if _special_free(t)][:200]
    assert tok.encode_batch(plain) == [_slow(family, sp, t, lower=lower) for t in plain]


def test_deberta_split_by_punct_equals_transformers(spm, models, texts, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = {"do_lower_case": False, "split_by_punct": True}
    folder = _folder(tmp_path / "deberta", "deberta-v2", models["deberta-v2"], **{"tokenizer_config.json": config})
    tok, hf = Tokenizer.load(folder), transformers.AutoTokenizer.from_pretrained(folder)
    plain = [t for t in texts if unicodedata.normalize("NFKC", t) == t][:200]
    assert [tok.tk.encode(t).ids for t in plain] == hf(plain)["input_ids"]


# --------------------------------------------------------------------------------------------------
# Roles, the cache, the ways in
# --------------------------------------------------------------------------------------------------

def test_roles_sentinels_and_added_tokens(models, tmp_path):
    albert = Tokenizer.load(_folder(tmp_path / "a", "albert", models["albert"]))
    assert [albert.pad_id, albert.unk_id, albert.cls_id, albert.sep_id, albert.mask_id] == [0, 1, 2, 3, 4]
    assert (albert.bos_id, albert.eos_id) == (2, 3)
    deberta = Tokenizer.load(_folder(tmp_path / "d", "deberta-v2", models["deberta-v2"]))
    assert [deberta.pad_id, deberta.cls_id, deberta.sep_id, deberta.unk_id, deberta.mask_id] == [0, 1, 2, 3, VOCAB]
    assert deberta.vocab_size == VOCAB + 1
    t5 = Tokenizer.load(_folder(tmp_path / "t", "t5", models["t5"]))
    assert [t5.pad_id, t5.eos_id, t5.unk_id, t5.cls_id] == [0, 1, 2, None]
    assert t5.sentinel_ids == [VOCAB + 99 - n for n in range(100)]  # <extra_id_0> is the last id, as in T5
    assert t5.vocab_size == VOCAB + 100
    none = Tokenizer.load(_folder(tmp_path / "t0", "t5", models["t5"], **{"tokenizer_config.json": {"extra_ids": 0}}))
    assert none.vocab_size == VOCAB and none.sentinel_ids == []


def test_converted_once_into_the_cache_never_into_the_folder(models, tmp_path, monkeypatch):
    import pretune.io.spm

    folder = _folder(tmp_path / "t5", "t5", models["t5"])
    before = sorted(p.name for p in folder.iterdir())
    first = Tokenizer.load(folder)
    assert sorted(p.name for p in folder.iterdir()) == before
    cached = list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))
    assert len(cached) == 1
    monkeypatch.setattr(pretune.io.spm, "_build", lambda *a: pytest.fail("converted again"))
    again = Tokenizer.load(folder)
    assert again.tk.to_str() == first.tk.to_str()
    assert again.encode("Emma Woodhouse, handsome") == first.encode("Emma Woodhouse, handsome")
    monkeypatch.undo()
    monkeypatch.setenv("PRETUNE_CACHE", str(tmp_path / "cache"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 10}))  # other settings: a new entry
    assert Tokenizer.load(folder).vocab_size == VOCAB + 10
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*/tokenizer.json"))) == 2


def test_an_unwritable_cache_still_loads(models, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("PRETUNE_CACHE", str(tmp_path / "file" / "cache"))  # under a file: cannot be created
    tok = Tokenizer.load(_folder(tmp_path / "a", "albert", models["albert"]))
    assert tok.encode("Emma") and tok.cls_id == 2


def test_the_model_file_itself_and_tokenizer_json_first(models, tmp_path):
    folder = _folder(tmp_path / "a", "albert", models["albert"])
    assert Tokenizer.load(folder / "spiece.model").tk.to_str() == Tokenizer.load(folder).tk.to_str()
    Tokenizer.load(folder).save(folder)  # a folder with a tokenizer.json uses it, whatever else it holds
    (folder / "spiece.model").write_bytes(b"broken")
    assert Tokenizer.load(folder).encode("Emma") == Tokenizer.load(tmp_path / "a" / "tokenizer.json").encode("Emma")


def test_a_t5_folder_loads_and_converts_with_its_tokenizer(models, tmp_path):
    transformers = pytest.importorskip("transformers")
    import pretune
    from pretune.cli import main

    config = transformers.T5Config(vocab_size=VOCAB + 100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0)
    hf = tmp_path / "t5"
    transformers.T5ForConditionalGeneration(config).save_pretrained(hf)
    (hf / "spiece.model").write_bytes(models["t5"])
    loaded = pretune.load_pretrained(hf)
    assert loaded.tokenizer.vocab_size == VOCAB + 100 and loaded.tokenizer.eos_id == 1
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "ckpt")]) == 0
    saved = Tokenizer.load(tmp_path / "ckpt")
    text = "Emma Woodhouse, handsome, clever, and rich."
    assert saved.encode(text) == loaded.tokenizer.encode(text) and saved.sentinel_ids == loaded.tokenizer.sentinel_ids


# --------------------------------------------------------------------------------------------------
# Bad input: one TokenizerError naming the culprit
# --------------------------------------------------------------------------------------------------

def test_missing_sentencepiece_says_what_to_install(tmp_path, monkeypatch):
    folder = _folder(tmp_path / "a", "albert", b"\x00")
    monkeypatch.setitem(__import__("sys").modules, "sentencepiece", None)
    with pytest.raises(TokenizerError, match=r"spiece\.model.*pip install sentencepiece protobuf"):
        Tokenizer.load(folder)


def test_unknown_family_names_what_the_folder_says(tmp_path):
    folder = _folder(tmp_path / "x", "albert", b"\x00", **{"config.json": {"model_type": "xlnet"}})
    with pytest.raises(TokenizerError, match=r"model_type 'xlnet'.*AlbertTokenizer.*T5Tokenizer"):
        Tokenizer.load(folder)
    os.remove(folder / "config.json")
    with pytest.raises(TokenizerError, match="no tokenizer_class and no model_type"):
        Tokenizer.load(folder)


@pytest.mark.parametrize("files,match", [
    ({"tokenizer_config.json": {"do_lower_case": "yes"}}, r"tokenizer_config\.json: do_lower_case is 'yes'"),
    ({"tokenizer_config.json": {"tokenizer_class": "AlbertTokenizer", "mask_token": 3}}, r"mask_token is 3"),
    ({"added_tokens.json": {"[NEW]": VOCAB + 5}}, r"'\[NEW\]' has id 805, but the next free id is 800"),
    ({"added_tokens.json": {"[CLS]": 7}}, r"'\[CLS\]' has id 7, but the model gives it id 2"),
    ({"special_tokens_map.json": ["[CLS]"]}, r"special_tokens_map\.json: expected a JSON object"),
])
def test_bad_side_files_are_named(files, match, models, tmp_path):
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.load(_folder(tmp_path / "a", "albert", models["albert"], **files))


def test_a_broken_or_bpe_model_is_named(models, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    with pytest.raises(TokenizerError, match=r"spiece\.model: not a SentencePiece model"):
        Tokenizer.load(_folder(tmp_path / "broken", "t5", b"\xff\xfe not a model"))
    proto = sentencepiece_model_pb2.ModelProto.FromString(models["t5"])
    proto.trainer_spec.model_type = 2  # BPE, like Llama's tokenizer.model
    with pytest.raises(TokenizerError, match=r"of type 2 \(2 = BPE.*only Unigram"):
        Tokenizer.load(_folder(tmp_path / "bpe", "t5", proto.SerializeToString()))
