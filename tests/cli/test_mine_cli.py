"""``pretune mine`` end to end on a tiny random BERT: the triplets it writes equal a ranking computed independently
(pretune embed's vectors, numpy's cosines and sort), records keep their fields, bad input and outputs are refused
with a message, and ``pretune finetune --task embedding`` trains on the result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))  # the tiny BERT of the task tests
from bert_fixtures import tiny_bert_folder  # noqa: E402

from pretune.cli import main  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat tree big small red blue house car man woman child plays reads book ball "
         "park river bank money walk fast slow old new green in with an has of").split()
PAIRS = [("the cat sat on the mat", "a small cat sat on a red mat"),
         ("a dog ran in the park", "the big dog ran fast in a park"),
         ("a dog ran in the park", "a dog in the green park"),  # the same anchor, a second positive
         ("the child plays with a ball", "a small child plays ball"),
         ("the woman reads a new book", "a woman reads an old book"),
         ("money in the bank", "the bank has money")]
CORPUS = ["the man reads a book", "a red car on the river bank", "an old house under a tree",
          "the dog sat under the tree", "a blue ball in the green park", "the cat sat on the mat"]  # an anchor too


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bert_folder(tmp_path_factory.mktemp("tiny_bert"), WORDS,
                            lambda cfg: transformers.BertModel(cfg, add_pooling_layer=False))


@pytest.fixture()
def files(tmp_path):
    rows = [{"id": k, "query": a, "doc": p} for k, (a, p) in enumerate(PAIRS)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
    return tmp_path


def _mine(folder, d, *extra, out="hard.jsonl") -> int:
    return main(["mine", str(folder), "--data", str(d / "pairs.jsonl"), "--out", str(d / out), "--corpus",
                 str(d / "corpus.txt"), "--anchor-field", "query", "--positive-field", "doc", "--quiet", *extra])


def test_mine_writes_the_independently_ranked_negatives(folder, files, capsys):
    from pretune.jobs.embed import embed_texts, load_encoder

    assert _mine(folder, files, "--num-negatives", "2", "--range-min", "1", "--device", "cpu") == 0
    printed = capsys.readouterr().out
    assert "mined 12 negatives for 6 of 6 records (5 distinct anchors) from a corpus of 12 texts" in printed
    rows = [json.loads(line) for line in (files / "hard.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(6)) and all(len(r["negative"]) == 2 for r in rows)

    # independently: mean-pooled vectors (a plain BERT folder: the encoder default), cosines, a stable sort
    model, tok = load_encoder(folder)
    docs = list(dict.fromkeys([p for _, p in PAIRS] + CORPUS))
    emb = embed_texts(model, tok, docs, pooling="mean")
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for r in rows:
        a = embed_texts(model, tok, [r["query"]], pooling="mean")[0]
        cos = unit @ (a / np.linalg.norm(a))
        own = {p for q, p in PAIRS if q == r["query"]} | {r["query"]}
        ranked = [docs[k] for k in np.argsort(-cos, kind="stable") if docs[k] not in own]
        assert r["negative"] == ranked[1:3]  # --range-min 1 skips rank 1
        assert not own & set(r["negative"])  # neither positive of the repeated anchor, nor the anchor itself


def test_margin_drops_candidates_and_unmined_records(folder, files, capsys):
    # a margin of 2 on cosines keeps nothing: every record is dropped, unless --keep-unmined
    assert _mine(folder, files, "--margin", "2") == 0
    assert "6 records had no candidate left" in capsys.readouterr().out
    assert (files / "hard.jsonl").read_text() == ""
    assert _mine(folder, files, "--margin", "2", "--keep-unmined", "--overwrite") == 0
    rows = [json.loads(line) for line in (files / "hard.jsonl").read_text().splitlines()]
    assert [r["doc"] for r in rows] == [p for _, p in PAIRS] and all("negative" not in r for r in rows)


def test_refusals_name_what_is_wrong(folder, files, capsys):
    assert _mine(folder, files) == 0
    capsys.readouterr()
    assert _mine(folder, files) == 2  # --out exists
    assert "hard.jsonl already exists; pass --overwrite" in capsys.readouterr().err
    with (files / "pairs.jsonl").open("a") as fh:
        fh.write(json.dumps({"query": "the cat", "text": "x"}) + "\n")
    assert _mine(folder, files, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"pretune mine: {files / 'pairs.jsonl'}:7: record has no field 'doc'" in err and "--positive-field" in err
    assert main(["mine", str(folder), "--data", str(files / "pairs.jsonl"), "--out", str(files / "t.txt")]) == 2
    assert "expected a .jsonl (or .jsonl.gz) file" in capsys.readouterr().err
    assert _mine(folder, files, "--overwrite", "--range-max", "2") == 2  # 2 ranks for 3 negatives
    assert "--range-max" in capsys.readouterr().err
    assert _mine(folder, files, "--overwrite", "--device", "gpu0") == 2
    assert "--device 'gpu0': not a torch device" in capsys.readouterr().err


def test_finetune_embedding_reads_the_triplets(folder, files):
    """The mined file (gzipped here) is a triplet file for --task embedding: every negative reaches the batch, and a
    run trains on it."""
    from pretune.data.readers import iter_records
    from pretune.jobs.finetune import finetune, load_finetune_config
    from pretune.loading import load_pretrained
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record

    assert _mine(folder, files, "--negative-field", "hard", out="hard.jsonl.gz") == 0
    out = files / "hard.jsonl.gz"
    loaded = load_pretrained(folder)
    task = build_task(TaskConfig(name="embedding", anchor_field="query", positive_field="doc", negative_field="hard"),
                      loaded.model.config, loaded.tokenizer)
    rows = [r for _, r in iter_records(out)]
    batch = task.collate([f for k, r in enumerate(rows) for f in task.encode(Record(f"hard.jsonl:{k + 1}", r))])
    assert batch["input_ids"].shape[0] == 6 + 6 + 18 and batch["n_docs"].tolist() == [4] * 6  # 3 negatives each
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=embedding", "task.anchor_field=query",
                                      "task.positive_field=doc", "task.negative_field=hard",
                                      f"train.out={files / 'run'}", f"data.train={out}", "train.batch_size=3",
                                      "train.steps=1", "tune.epochs=0"])
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    assert (result.model_dir / "modules.json").is_file()


def test_help_states_the_jobs_default(capsys):
    """--help names the default number of negatives without importing the job (numpy): the two must agree."""
    from pretune.jobs.mine import DEFAULT_NUM_NEGATIVES

    with pytest.raises(SystemExit):
        main(["mine", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"negatives mined per record (default {DEFAULT_NUM_NEGATIVES}," in help_text
