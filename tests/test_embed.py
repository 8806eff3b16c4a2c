"""pretune.jobs.embed: contextual sentence embeddings against sentence-transformers' recipe on the real MiniLM."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from pretune.cli.embed import add_embed_parser
from pretune.config import ConfigError
from pretune.data.readers import DataError
from pretune.io.outputs import OutputError
from pretune.jobs.embed import (
    cosine_matrix,
    embed_texts,
    load_encoder,
    pairwise_cosine,
    rank_all_pairs,
    rank_pairs,
    special_tokens,
)

GUITAR = "A man is playing a guitar."
PARAPHRASE = "Someone plays the guitar."
UNRELATED = "The stock market fell sharply today."
SENTENCES = [GUITAR, "Hi.", "The quick brown fox jumps over the lazy dog near the old riverbank at dawn.",
             PARAPHRASE, UNRELATED]


@pytest.fixture(scope="module")
def minilm_path():
    from pretune.realmodels import minilm_dir

    try:
        return minilm_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return load_encoder(minilm_path)


def _run(argv: list[str]) -> int:
    """Parse ``embed ...`` with a fresh parser holding only the embed subcommand, and run it."""
    parser = argparse.ArgumentParser(prog="pretune")
    sub = parser.add_subparsers(dest="command", required=True)
    add_embed_parser(sub)
    args = parser.parse_args(["embed", *argv])
    return args.func(args)


# ------------------------------------------------------------------------------------------- API


def test_mean_pooling_matches_transformers(minilm, minilm_path):
    transformers = pytest.importorskip("transformers")
    model, tok = minilm
    ours = embed_texts(model, tok, SENTENCES, pooling="mean", batch_size=2)  # several length-sorted batches

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    hf_model = transformers.AutoModel.from_pretrained(str(minilm_path)).eval()
    enc = hf_tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        h = hf_model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ref = ((h * m).sum(1) / m.sum(1).clamp(min=1e-9)).numpy()

    assert ours.dtype == np.float32 and ours.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
    # normalize=True is the unit-length version of the same vectors
    unit = embed_texts(model, tok, SENTENCES, normalize=True)
    np.testing.assert_allclose(unit, ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)


def test_streams_embed_the_same_vectors_and_put_the_threads_back(minilm, monkeypatch):
    """streams=3: batches on three threads at once (one torch thread each) give the vectors one batch at a time does,
    in input order, and torch's thread count is what it was, after a failing batch too."""
    from pretune.jobs import embed

    model, tok = minilm
    texts = SENTENCES * 3  # 15 texts, batches of 2: 8 batches
    threads = torch.get_num_threads()
    one = embed_texts(model, tok, texts, batch_size=2)
    three = embed_texts(model, tok, texts, batch_size=2, streams=3)
    np.testing.assert_allclose(three, one, atol=1e-6, rtol=0)
    assert torch.get_num_threads() == threads
    with pytest.raises(ConfigError, match="streams"):
        embed_texts(model, tok, texts, streams=0)
    hidden, calls = embed._hidden, []

    def failing(*args):  # the fourth batch fails, on a stream
        calls.append(torch.get_num_threads())
        if len(calls) == 4:
            raise RuntimeError("batch 4")
        return hidden(*args)

    monkeypatch.setattr(embed, "_hidden", failing)
    with pytest.raises(RuntimeError, match="batch 4"):
        embed_texts(model, tok, texts, batch_size=2, streams=3)
    assert calls[0] == threads and set(calls[1:]) == {1}  # the shortest batch on every thread, the rest on one each
    assert torch.get_num_threads() == threads


def test_paraphrase_ranks_above_unrelated(minilm):
    model, tok = minilm
    emb = embed_texts(model, tok, [GUITAR, PARAPHRASE, UNRELATED])
    sims = cosine_matrix(emb)
    assert sims.shape == (3, 3)
    np.testing.assert_allclose(np.diag(sims), 1.0, atol=1e-5)
    assert sims[0, 1] > sims[0, 2] + 0.3
    ranked = rank_pairs(emb[[0, 0]], emb[[2, 1]])  # pair 0: unrelated, pair 1: paraphrase
    assert [k for k, _ in ranked] == [1, 0]
    assert ranked[0][1] == pytest.approx(float(sims[0, 1]), abs=1e-6)
    np.testing.assert_allclose(pairwise_cosine(emb[[0]], emb[[1]]), sims[0, 1:2], atol=1e-6)
    assert [(i, j) for i, j, _ in rank_all_pairs(emb)][0] == (0, 1)
    (best,) = rank_all_pairs(emb, top=1, chunk=1)  # chunked top-k: same winner
    assert best[:2] == (0, 1) and best[2] == pytest.approx(float(sims[0, 1]), abs=1e-6)


def test_cls_pooling_is_the_first_token(minilm):
    model, tok = minilm
    assert special_tokens(tok, model) == ([tok.cls_id], [tok.sep_id])
    emb = embed_texts(model, tok, SENTENCES, pooling="cls", batch_size=3)
    for k, text in enumerate(SENTENCES):
        ids = torch.tensor([[tok.cls_id, *tok.encode(text), tok.sep_id]])
        with torch.no_grad():
            first = model(ids).last_hidden_state[0, 0].numpy()
        np.testing.assert_allclose(emb[k], first, atol=1e-5, rtol=0)


def test_order_truncation_and_empty_list(minilm):
    model, tok = minilm
    both = embed_texts(model, tok, [SENTENCES[2], SENTENCES[1]], batch_size=1)
    np.testing.assert_allclose(both[::-1], embed_texts(model, tok, [SENTENCES[1], SENTENCES[2]]), atol=1e-5)
    # max_len keeps [CLS] + the first tokens + [SEP]: the same as embedding the truncated ids
    short = embed_texts(model, tok, [SENTENCES[2]], max_len=6, pooling="cls")
    ids = torch.tensor([[tok.cls_id, *tok.encode(SENTENCES[2])[:4], tok.sep_id]])
    with torch.no_grad():
        np.testing.assert_allclose(short[0], model(ids).last_hidden_state[0, 0].numpy(), atol=1e-5)
    assert embed_texts(model, tok, []).shape == (0, 384)
    with pytest.raises(ConfigError, match="longer than the model's 512 positions"):
        embed_texts(model, tok, ["x"], max_len=10_000)


def test_decoder_last_and_encoder_decoder(tmp_path):
    import pretune

    texts = ["the cat sat on the mat", "a dog ran in the park today", "birds sing", "rain falls on the roof"] * 5
    tok = pretune.train_tokenizer(texts=texts, kind="bpe", vocab_size=300, show_progress=False)
    model = pretune.build_model("tiny-gpt2", vocab_size=tok.vocab_size, dropout=0.0, attn_dropout=0.0)
    pretune.save(model, tmp_path / "gpt", tokenizer=tok.tk)
    model, tok = load_encoder(tmp_path / "gpt")  # a pretune checkpoint folder
    batch = embed_texts(model, tok, texts[:4], pooling="last", batch_size=4)
    for k, text in enumerate(texts[:4]):
        np.testing.assert_allclose(batch[k], embed_texts(model, tok, [text], pooling="last")[0], atol=1e-5)
    assert embed_texts(model, tok, texts[:4], pooling="mean").shape == (4, model.config.dim)
    with pytest.raises(ConfigError, match="'cls' does not apply to decoder models; use one of mean, last"):
        embed_texts(model, tok, texts[:2], pooling="cls")
    with pytest.raises(ConfigError, match="unknown pooling 'max'"):
        embed_texts(model, tok, texts[:2], pooling="max")

    t5 = pretune.build_model("tiny-t5-small", vocab_size=tok.vocab_size, dropout=0.0)
    assert embed_texts(t5, tok, texts[:3]).shape == (3, t5.config.dim)


# ------------------------------------------------------------------------------------------- CLI


def test_cli_writes_npy_and_jsonl(minilm_path, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text(f"{GUITAR}\n\n{PARAPHRASE}\n   \n{UNRELATED}\n", encoding="utf-8")
    assert _run([str(minilm_path), str(src), "--out", str(tmp_path / "e.npy"), "--normalize"]) == 0
    emb = np.load(tmp_path / "e.npy")
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert "embedded 3 texts" in capsys.readouterr().out

    recs = tmp_path / "in.jsonl"
    recs.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate([GUITAR, UNRELATED])))
    assert _run([str(minilm_path), str(recs), "--field", "body", "--out", str(tmp_path / "e.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r["text"] for r in rows] == [GUITAR, UNRELATED]
    assert all(len(r["embedding"]) == 384 for r in rows)
    got = np.array([r["embedding"] for r in rows])  # no --normalize: MiniLM's Normalize module still applies
    np.testing.assert_allclose(got / np.linalg.norm(got, axis=1, keepdims=True), emb[[0, 2]], atol=1e-5)


def test_cli_similarity_ranks_paraphrase_first(minilm_path, tmp_path, capsys):
    pairs = tmp_path / "pairs.txt"
    pairs.write_text(f"{GUITAR}\t{UNRELATED}\n{GUITAR}\t{PARAPHRASE}\n{PARAPHRASE}\t{UNRELATED}\n", encoding="utf-8")
    out = tmp_path / "ranked.jsonl"
    assert _run([str(minilm_path), str(pairs), "--similarity", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["pair"] for r in rows][0] == 1 and rows[0]["text_b"] == PARAPHRASE
    assert [r["rank"] for r in rows] == [1, 2, 3] and rows[0]["cosine"] > rows[1]["cosine"] >= rows[2]["cosine"]
    assert printed.index(PARAPHRASE) < printed.index(UNRELATED)

    jl = tmp_path / "pairs.jsonl"
    jl.write_text(json.dumps({"q": GUITAR, "d": UNRELATED}) + "\n" + json.dumps({"q": GUITAR, "d": PARAPHRASE}) + "\n")
    assert _run([str(minilm_path), str(jl), "--similarity", "--field-a", "q", "--field-b", "d", "--top", "1"]) == 0
    printed = capsys.readouterr().out
    assert "top 1 of 2 pairs" in printed and PARAPHRASE in printed and UNRELATED not in printed

    plain = tmp_path / "list.txt"
    plain.write_text(f"{UNRELATED}\n{GUITAR}\n{PARAPHRASE}\n", encoding="utf-8")
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        _run([str(minilm_path), str(plain), "--similarity", "--out", str(out), "--top", "2"])
    assert _run([str(minilm_path), str(plain), "--similarity", "--out", str(out), "--top", "2", "--overwrite"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and (rows[0]["i"], rows[0]["j"]) == (1, 2)


# ---------------------------------------------------------------------------------------- errors


def test_errors(minilm_path, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DataError, match="no texts"):
        _run([str(minilm_path), str(empty), "--out", str(tmp_path / "x.npy")])

    recs = tmp_path / "r.jsonl"
    recs.write_text(json.dumps({"text": "ok"}) + "\n\n" + json.dumps({"body": "no text here"}) + "\n")
    with pytest.raises(DataError, match=r"r\.jsonl:3: record has no field 'text'.*\['body'\]"):
        _run([str(minilm_path), str(recs), "--out", str(tmp_path / "x.npy")])
    with pytest.raises(DataError, match=r"r\.jsonl:1: record has no field 'body'"):
        _run([str(minilm_path), str(recs), "--field", "body", "--out", str(tmp_path / "x.npy")])

    ok = tmp_path / "ok.txt"
    ok.write_text("hello\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="'last' does not apply to encoder models"):
        _run([str(minilm_path), str(ok), "--pooling", "last", "--out", str(tmp_path / "x.npy")])
    with pytest.raises(ConfigError, match="unknown output type"):
        _run([str(minilm_path), str(empty), "--out", str(tmp_path / "x.csv")])
    with pytest.raises(ConfigError, match="--out FILE is required"):
        _run([str(minilm_path), str(empty)])
    bad_pairs = tmp_path / "bad.txt"
    bad_pairs.write_text("a\tb\nc\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.txt:2: 0 tabs"):
        _run([str(minilm_path), str(bad_pairs), "--similarity"])
    with pytest.raises(DataError, match="needs at least two texts"):
        _run([str(minilm_path), str(ok), "--similarity"])
    assert not (tmp_path / "x.npy").exists()
