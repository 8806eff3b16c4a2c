"""GGUF export and import without llama.cpp: what the file holds (read back with gguf's own GGUFReader), the round
trip through it into pretune (f32: the same logits), the LoRA file's factors, and the refusals. llama.cpp itself
runs the files in test_gguf_llamacpp.py (``make test-llamacpp``)."""

import numpy as np
import pytest
import torch

import pretune
from pretune import peft
from pretune.cli import main
from pretune.generation.prompt import load_chat_template
from pretune.interop.gguf import GGUFError, read_gguf, write_gguf, write_lora_gguf
from pretune.io.gguf_tokenizer import GGUFTokenizerError
from pretune.io.tokenization import train_tokenizer
from pretune.model import TransformerLM
from pretune.presets import get_preset

gguf = pytest.importorskip("gguf")

TEXT = "It is a truth universally acknowledged, that a single man in 1811 wasn't in want of a wife!"
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
CORPUS = ["The quick brown fox jumps over the lazy dog, 42 times.", "Pride and Prejudice; Sense and Sensibility.",
          "It was the best of times, it was the worst of times."] * 30


@pytest.fixture(scope="module")
def tok():
    t = train_tokenizer(texts=CORPUS, kind="bpe", vocab_size=300, show_progress=False)
    t.chat_template = TEMPLATE
    return t


def _config(family: str):
    llama = get_preset("tiny-llama").replace(vocab_size=320)  # 20 ids beyond the tokenizer's: [PADn] in the file
    gemma = dict(norm="rmsnorm_plus_one", ffn="geglu_tanh", scale_embeddings=True, tie_embeddings=True, head_dim=16)
    return {
        "llama": llama,
        "qwen2": llama.replace(qkv_bias=True),
        "qwen3": llama.replace(qk_norm=True, head_dim=16),
        "mistral": llama.replace(sliding_window=16),
        "gemma": llama.replace(**gemma),
        "gemma2": llama.replace(**gemma, norm_placement="sandwich", attn_softcap=50.0, logit_softcap=30.0,
                                sliding_window=16, sliding_layers=[0]),
        "gpt2": get_preset("tiny-gpt2").replace(vocab_size=320, dropout=0.0, attn_dropout=0.0),
    }[family]


def _model(cfg):
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # every parameter away from its initial value (norm gains, biases included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
        "gemma2": "gemma2", "gpt2": "gpt2"}


@pytest.mark.parametrize("family", list(ARCH))
def test_f32_file_holds_the_model_and_reads_back_to_the_same_logits(family, tok, tmp_path):
    model = _model(_config(family))
    out = write_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    r = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == ARCH[family]
    assert fields[f"{ARCH[family]}.block_count"] == 2
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 320 and tokens[:tok.vocab_size] == [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert tokens[300] == "[PAD300]" and fields["tokenizer.ggml.token_type"][300] == 5  # UNUSED
    assert fields["tokenizer.ggml.token_type"][tok.bos_id] == 3  # <s>: CONTROL
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eos_id
    assert fields["tokenizer.chat_template"] == TEMPLATE
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert set(types.values()) == {"F32"} and "token_embd.weight" in types
    assert ("output.weight" in types) == (not model.config.tie_embeddings)

    back, tok2 = read_gguf(out)
    for field in ("n_layers", "dim", "n_heads", "kv_heads", "dh", "ffn", "norm", "norm_placement", "qkv_bias",
                  "qk_norm", "sliding_window", "sliding_layers", "attn_softcap", "logit_softcap", "tie_embeddings"):
        assert getattr(back.config, field) == getattr(model.config, field), field
    ids = tok.encode(TEXT)
    assert tok2.encode(TEXT) == ids and tok2.decode(ids) == TEXT and tok2.chat_template == TEMPLATE
    assert (tok2.bos_id, tok2.eos_id, tok2.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_, weight, embed, tol", [("f16", "F16", "F16", 0.01), ("bf16", "BF16", "BF16", 0.05),
                                                       ("q8_0", "Q8_0", "Q8_0", 0.05), ("q4_0", "Q4_0", "Q8_0", 0.5),
                                                       ("q4_1", "Q4_1", "Q8_0", 0.5)])
def test_types_quantise_the_matrices_and_keep_norms_f32(type_, weight, embed, tol, tok, tmp_path):
    model = _model(_config("llama").replace(dim=64, head_dim=16, tie_embeddings=False))  # rows of 64: whole blocks
    out = write_gguf(model, tmp_path / "m.gguf", tokenizer=tok, type=type_)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == weight
    assert types["token_embd.weight"] == types["output.weight"] == embed
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    back, _ = read_gguf(out)  # de-quantised: close to the f32 model, by the type's precision
    ids = tok.encode(TEXT)
    a, b = _logits(model, ids), _logits(back, ids)
    assert (a - b).abs().max() / a.abs().max() < tol


def test_rows_not_a_whole_block_fall_back_to_f16(tok, tmp_path):
    out = write_gguf(_model(_config("llama")), tmp_path / "m.gguf", tokenizer=tok, type="q8_0")  # ffn_down rows: 64
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q8_0"  # dim 32
    out = write_gguf(_model(_config("llama").replace(dim=48, head_dim=12)), tmp_path / "n.gguf", tokenizer=tok,
                     type="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 48 | 64


def test_lora_file_holds_the_factors_of_the_merged_weights(tok, tmp_path):
    model = _model(_config("llama"))
    peft.inject(model, peft.PeftConfig(method="lora", r=4, alpha=8, targets=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    from pretune.jobs.gguf import lora_factors

    out = write_lora_gguf(model, lora_factors(model), tmp_path / "lora.gguf")
    r = gguf.GGUFReader(out)
    assert r.fields["general.type"].contents() == "adapter" and r.fields["adapter.type"].contents() == "lora"
    lora = {t.name: np.array(t.data) for t in r.tensors}
    assert sorted(lora) == sorted(f"blk.{i}.attn_{p}.weight.lora_{x}" for i in (0, 1) for p in "qv" for x in "ab")
    # base + B A in the file's layout (q rows permuted for llama.cpp) equals the merged model's file
    merged = peft.merged_model(model)
    base_file = write_gguf(_base(model), tmp_path / "b.gguf", tokenizer=tok)
    merged_file = write_gguf(merged, tmp_path / "m.gguf", tokenizer=tok)
    base = {t.name: np.array(t.data) for t in gguf.GGUFReader(base_file).tensors}
    want = {t.name: np.array(t.data) for t in gguf.GGUFReader(merged_file).tensors}
    for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight"):
        got = base[name] + lora[f"{name}.lora_b"] @ lora[f"{name}.lora_a"]
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-5)


def _base(model):
    """The model without its adapter (a copy)."""
    import copy

    plain = copy.deepcopy(model)
    peft.strip_peft(plain)
    return plain


def test_cli_round_trip_existing_out_and_loader(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("PRETUNE_CACHE", str(tmp_path / "cache"))  # where the file's tokenizer folder goes
    model = _model(_config("qwen2"))
    pretune.save(model, tmp_path / "ck", tokenizer=tok)
    out = tmp_path / "q.gguf"
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", str(out), "--type", "q8_0"]) == 0
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", str(out)]) == 2  # exists: refused
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", str(out), "--overwrite"]) == 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    loaded = pretune.load_pretrained(out)  # a .gguf path wherever a model path is taken
    assert loaded.kind == "gguf" and loaded.tokenizer.chat_template == TEMPLATE
    assert load_chat_template(loaded.folders).template == TEMPLATE  # generate --chat, prompt --chat read it there
    ids = tok.encode(TEXT)
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    assert main(["convert", "--from-gguf", str(out), "--out", str(tmp_path / "back")]) == 0
    back = pretune.load_pretrained(tmp_path / "back")
    assert back.tokenizer.encode(TEXT) == ids and back.tokenizer.chat_template == TEMPLATE


def test_refusals_name_the_family_option_and_tokenizer(tok, tmp_path, capsys):
    bert = TransformerLM(get_preset("tiny-bert-base"))
    with pytest.raises(GGUFError, match="bert family has no llama.cpp architecture"):
        write_gguf(bert, tmp_path / "b.gguf", tokenizer=tok)
    cls = TransformerLM(_config("llama").replace(head="classification", num_labels=2, pooling="last"))
    with pytest.raises(GGUFError, match="head='classification'"):
        write_gguf(cls, tmp_path / "c.gguf", tokenizer=tok)
    g2 = TransformerLM(_config("gemma2").replace(attn_scale=0.5))
    with pytest.raises(GGUFError, match="attn_scale=0.5"):
        write_gguf(g2, tmp_path / "g.gguf", tokenizer=tok)
    llama = TransformerLM(_config("llama"))
    wordpiece = train_tokenizer(texts=CORPUS, kind="wordpiece", vocab_size=300, show_progress=False)
    with pytest.raises(GGUFTokenizerError, match="a WordPiece tokenizer"):
        write_gguf(llama, tmp_path / "t.gguf", tokenizer=wordpiece)
    lower = train_tokenizer(texts=CORPUS, kind="bpe", vocab_size=300, lowercase=True, show_progress=False)
    with pytest.raises(GGUFTokenizerError, match="normaliser \\(Lowercase"):
        write_gguf(llama, tmp_path / "t.gguf", tokenizer=lower)
    assert not (tmp_path / "t.gguf").exists()
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(GGUFError, match="is a folder"):
        write_gguf(llama, tmp_path / "dir.gguf", tokenizer=tok)
    with pytest.raises(GGUFError, match="--type 'q2_k'"):
        write_gguf(llama, tmp_path / "x.gguf", tokenizer=tok, type="q2_k")


def test_bad_files_are_named(tok, tmp_path, capsys):
    good = write_gguf(_model(_config("llama")), tmp_path / "m.gguf", tokenizer=tok)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:3000])
    with pytest.raises(GGUFError, match="cut.gguf: a corrupt or truncated GGUF file"):
        read_gguf(cut)
    text = tmp_path / "text.gguf"
    text.write_text("hello")
    with pytest.raises(GGUFError, match="text.gguf: not a GGUF file"):
        read_gguf(text)
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")  # a valid GGUF file of an architecture not read
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'bert' is not read"):
        read_gguf(tmp_path / "bert.gguf")
    assert main(["convert", "--from-gguf", str(cut), "--out", str(tmp_path / "o")]) == 2
    assert "cut.gguf: a corrupt or truncated GGUF file" in capsys.readouterr().err


def test_adapter_folder_exports_as_gguf_lora_and_dora_is_refused(tok, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRETUNE_CACHE", str(tmp_path / "cache"))
    model = _model(_config("llama"))
    pretune.save(model, tmp_path / "base", tokenizer=tok)
    peft.inject(model, peft.PeftConfig(method="lora", r=2, alpha=4))
    peft.save_adapter(model, tmp_path / "lora", base=str(tmp_path / "base"))
    assert main(["convert", "--to-gguf", str(tmp_path / "lora"), "--out", str(tmp_path / "lora.gguf")]) == 0
    r = gguf.GGUFReader(tmp_path / "lora.gguf")
    assert r.fields["general.type"].contents() == "adapter" and len(r.tensors) == 8  # q, v of 2 layers: A and B
    assert main(["convert", "--to-gguf", str(tmp_path / "lora"), "--out", str(tmp_path / "merged.gguf"),
                 "--merged"]) == 0
    assert pretune.load_pretrained(tmp_path / "merged.gguf").kind == "gguf"
    dora = _model(_config("llama"))
    peft.inject(dora, peft.PeftConfig(method="lora", r=2, alpha=4, dora=True))
    peft.save_adapter(dora, tmp_path / "dora", base=str(tmp_path / "base"))
    assert main(["convert", "--to-gguf", str(tmp_path / "dora"), "--out", str(tmp_path / "dora.gguf")]) == 2
    assert "lora_magnitude" in capsys.readouterr().err and not (tmp_path / "dora.gguf").exists()


@pytest.mark.slow
def test_bundled_smollm2_gguf_reads_as_transformers_dequantises_it():
    """The bundled Q4_1 file read by pretune's reader gives transformers' de-quantised model exactly."""
    from pretune.realmodels import smollm2_dir, smollm2_gguf

    ref = pretune.load_pretrained(smollm2_dir())
    model, tok = read_gguf(smollm2_gguf())
    ids = ref.tokenizer.encode(TEXT)
    assert tok.encode(TEXT) == ids
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids])).logits, ref.model(torch.tensor([ids])).logits)



def test_a_model_without_tokenizer_takes_one_given(tok, tmp_path, capsys):
    pretune.save(_model(_config("gemma")), tmp_path / "ck")  # no tokenizer saved with it
    out = str(tmp_path / "g.gguf")
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", out]) == 2
    assert "no usable tokenizer" in capsys.readouterr().err  # the loader says so, naming the folder
    tok.save(tmp_path / "tok.json")
    given = ["--tokenizer", str(tmp_path / "tok.json")]
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", out, *given]) == 0
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == "gpt-2"


# ---------------------------------------------------------------------------------------------
# Unigram (pretune tokenizer train --kind unigram) as llama.cpp's UGM ("t5") tokenizer
# ---------------------------------------------------------------------------------------------
NFKC_TEXT = "ﬁne ﬂour,\t½ cup…  Ｆｕｌｌ－ｗｉｄｔｈ e\u0301 ™ \u00a0end "


def _pretune_view(tok, text: str) -> str:
    """The text a Unigram tokenizer's Viterbi runs on: normalised, then Metaspace's ▁ before each word."""
    return "".join(p for p, _ in tok.tk.pre_tokenizer.pre_tokenize_str(tok.tk.normalizer.normalize_str(text)))


@pytest.fixture(scope="module")
def unigram():
    return train_tokenizer(texts=CORPUS, kind="unigram", vocab_size=300, sentinels=2, show_progress=False)


def test_unigram_file_holds_llamacpp_ugm_keys_and_reads_back(unigram, tmp_path):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    unigram.chat_template = TEMPLATE
    model = _model(_config("llama"))  # 320 ids: more than the tokenizer's
    out = write_gguf(model, tmp_path / "u.gguf", tokenizer=unigram)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items() if not k.startswith("GGUF.")}
    assert fields["tokenizer.ggml.model"] == "t5"  # llama.cpp: LLAMA_VOCAB_TYPE_UGM
    assert "tokenizer.ggml.merges" not in fields and "tokenizer.ggml.pre" not in fields
    n = unigram.vocab_size
    pieces = unigram._parsed()["model"]["vocab"]
    assert fields["tokenizer.ggml.tokens"][:n] == [p for p, _ in pieces]
    assert fields["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, 320)]
    np.testing.assert_array_equal(np.float32(fields["tokenizer.ggml.scores"][:n]), np.float32([s for _, s in pieces]))
    types = fields["tokenizer.ggml.token_type"]
    specials = set(unigram.tk.get_added_tokens_decoder())  # <pad> </s> <unk> <extra_id_0> <extra_id_1>
    assert len(specials) == 5 and {types[i] for i in specials} == {3}  # CONTROL
    assert set(types[n:]) == {3}  # the padding ids too: llama.cpp's UGM would match a NORMAL or UNUSED "[PAD300]"
    assert {types[i] for i in range(n) if i not in specials} == {1}  # NORMAL
    assert (fields["tokenizer.ggml.unknown_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.padding_token_id"]) == (unigram.unk_id, unigram.eos_id, unigram.pad_id)
    assert fields["tokenizer.ggml.add_space_prefix"] and fields["tokenizer.ggml.remove_extra_whitespaces"]
    assert not fields["tokenizer.ggml.add_bos_token"] and not fields["tokenizer.ggml.add_eos_token"]
    assert fields["tokenizer.chat_template"] == TEMPLATE
    # the character map, run by SentencePiece's normaliser (which llama.cpp's UGM tokenizer ports) with the file's
    # whitespace keys, gives the text pretune's own NFKC normaliser and Metaspace give
    charsmap = bytes(fields["tokenizer.ggml.precompiled_charsmap"])
    spec = sentencepiece_model_pb2.NormalizerSpec(precompiled_charsmap=charsmap, add_dummy_prefix=True,
                                                  escape_whitespaces=True, remove_extra_whitespaces=True)
    spm_norm = spm.SentencePieceNormalizer(normalizer_spec=spec.SerializeToString())
    for text in (NFKC_TEXT, TEXT, "  two  spaces\n\nand lines  "):
        assert spm_norm.Normalize(text) == _pretune_view(unigram, text), text
    assert _pretune_view(unigram, NFKC_TEXT).startswith("▁fine▁flour,▁1⁄2▁cup...▁Full-width▁é▁TM▁end")

    back, tok2 = read_gguf(out)  # tokenizer.huggingface.json: pretune's own tokenizer back
    for text in (TEXT, NFKC_TEXT):
        assert tok2.encode(text) == unigram.encode(text)
    assert (tok2.eos_id, tok2.unk_id, tok2.pad_id) == (unigram.eos_id, unigram.unk_id, unigram.pad_id)
    ids = unigram.encode(TEXT)
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)


def _unigram_with(vocab, *, normalizer=None):
    """A Unigram tokenizer with the recipe's pipeline (or ``normalizer``) over hand-made pieces and scores."""
    import tokenizers
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    from pretune.io.tokenization import Tokenizer

    tk = tokenizers.Tokenizer(models.Unigram(vocab, unk_id=2))
    tk.normalizer = normalizer or normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tk.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return Tokenizer(tk)


def test_unigram_that_would_not_round_trip_is_refused_by_name(tmp_path, capsys):
    from tokenizers import normalizers

    llama = _model(_config("llama"))
    letters = [(c, -4.0) for c in "abcdfghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    # "the" as one piece (-3.0) or "▁th" + "e" (-1.4999999999 - 1.5): pretune's float64 scores split it; stored as
    # float32, -1.4999999999 is -1.5, the two tie, and llama.cpp's Viterbi keeps the piece it found first, "▁the"
    tie = _unigram_with(specials + letters + [("▁the", -3.0), ("▁th", -1.4999999999), ("e", -1.5)])
    assert [tie.tk.id_to_token(i) for i in tie.encode("the")] == ["▁th", "e"]
    with pytest.raises(GGUFTokenizerError, match=r"Unigram tokenizer is not written into GGUF: llama.cpp's UGM "
                                                 r"tokenizer \(its character map, whitespace rules and float32 "
                                                 r"scores\) would tokenize .* otherwise than pretune"):
        write_gguf(llama, tmp_path / "t.gguf", tokenizer=tie)
    nfkc_only = _unigram_with(specials + letters + [("e", -4.0)], normalizer=normalizers.NFKC())
    with pytest.raises(GGUFTokenizerError, match=r"normaliser \{\"type\": \"NFKC\"\} is not the recipe's"):
        write_gguf(llama, tmp_path / "t.gguf", tokenizer=nfkc_only)
    spanning = _unigram_with(specials + letters + [("e", -4.0), ("▁a▁b", -1.0)])
    with pytest.raises(GGUFTokenizerError, match="piece '▁a▁b' .* across a word boundary"):
        write_gguf(llama, tmp_path / "t.gguf", tokenizer=spanning)
    assert not (tmp_path / "t.gguf").exists()
    pretune.save(llama, tmp_path / "ck", tokenizer=tie)  # the command names the model whose tokenizer it refused
    assert main(["convert", "--to-gguf", str(tmp_path / "ck"), "--out", str(tmp_path / "t.gguf")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'ck'}: a Unigram tokenizer is not written into GGUF" in err and "--kind bpe" in err
