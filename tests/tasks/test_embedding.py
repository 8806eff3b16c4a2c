"""The embedding task (a bi-encoder): its losses equal sentence-transformers' on a fixed batch (MNRL, symmetric,
CoSENT, Matryoshka; fp32, a tiny random BERT built by transformers), the cached (GradCache) loss's gradients equal the
uncached loss's, retrieval metrics by hand, bad records named, and a finetuning run that trains and evaluates."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from bert_fixtures import load_tiny, tiny_bert_folder  # noqa: E402

from pretune.data.readers import DataError  # noqa: E402
from pretune.loading import load_pretrained  # noqa: E402
from pretune.tasks import TaskConfig, build_task  # noqa: E402
from pretune.tasks.base import Record  # noqa: E402
from pretune.tasks.embedding import retrieval_metrics  # noqa: E402

WORDS = ("the a cat dog sat ran on under mat tree big small red blue house car man woman child plays reads "
         "book ball park river bank money walk fast slow old new green").split()
TRIPLETS = [("the cat sat on the mat", "a small cat sat on a red mat", "the man reads a book"),
            ("a dog ran in the park", "the big dog ran fast in a park", "a red car on the river bank"),
            ("the child plays with a ball", "a small child plays ball", "an old house under a tree"),
            ("the woman reads a new book", "a woman reads an old book", "the dog sat under the tree"),
            ("money in the bank", "the bank has money", "a blue ball in the green park")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random-weight BERT (every parameter perturbed) and a word-level WordPiece vocabulary, saved as a
    Hugging Face folder both libraries read."""
    return tiny_bert_folder(tmp_path_factory.mktemp("tiny_bert"), [*WORDS, "in", "with", "an", "has", "of"],
                            lambda cfg: transformers.BertModel(cfg, add_pooling_layer=False))


@pytest.fixture(scope="module")
def ours(folder):
    model, tok = load_tiny(folder)
    return model.with_head(head="none").eval(), tok


@pytest.fixture(scope="module")
def theirs(folder):
    from sentence_transformers import SentenceTransformer, models

    return SentenceTransformer(modules=[models.Transformer(str(folder)), models.Pooling(32, "mean")],
                               device="cpu").eval()


def _ours_loss(ours, records, **cfg) -> tuple[float, object, dict]:
    model, tok = ours
    task = build_task(TaskConfig(name="embedding", **cfg), model.config, tok)
    batch = task.collate([f for r in records for f in task.encode(r)])
    loss, stats = task.loss(model, batch, task.counts(batch))
    return loss, task, stats


def _records(with_negatives: bool) -> list[Record]:
    return [Record(f"t:{i}", {"anchor": a, "positive": p, **({"negative": n} if with_negatives else {})})
            for i, (a, p, n) in enumerate(TRIPLETS)]


def _st_features(theirs, columns):
    return [theirs.tokenize(list(c)) for c in columns]


@pytest.mark.parametrize("negatives", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_mnrl_equals_sentence_transformers(ours, theirs, negatives, symmetric):
    from sentence_transformers import losses

    with torch.no_grad():
        got, _, _ = _ours_loss(ours, _records(negatives), symmetric=symmetric)
        loss = losses.MultipleNegativesRankingLoss(
            theirs, scale=20.0, **({"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}
                                   if symmetric else {}))
        columns = list(zip(*TRIPLETS))[:3 if negatives else 2]
        want = loss(_st_features(theirs, columns), None)
    assert abs(float(got) - float(want)) < 1e-5, (float(got), float(want))


def test_matryoshka_equals_sentence_transformers(ours, theirs):
    from sentence_transformers import losses

    dims = [32, 16, 8]
    with torch.no_grad():
        got, _, _ = _ours_loss(ours, _records(True), matryoshka_dims=dims)
        loss = losses.MatryoshkaLoss(theirs, losses.MultipleNegativesRankingLoss(theirs), matryoshka_dims=dims)
        want = loss(_st_features(theirs, list(zip(*TRIPLETS))), None)
    assert abs(float(got) - float(want)) < 1e-5, (float(got), float(want))


def test_cosent_equals_sentence_transformers(ours, theirs):
    from sentence_transformers import losses

    scores = [0.9, 0.1, 0.5, 0.7, 0.3]
    records = [Record(f"s:{i}", {"text_a": a, "text_b": b, "score": s})
               for i, ((a, b, _), s) in enumerate(zip(TRIPLETS, scores))]
    with torch.no_grad():
        got, task, _ = _ours_loss(ours, records)
        want = losses.CoSENTLoss(theirs)(_st_features(theirs, list(zip(*TRIPLETS))[:2]), torch.tensor(scores))
    assert task.default_metric == "spearman"
    assert abs(float(got) - float(want)) < 1e-5, (float(got), float(want))


@pytest.mark.parametrize("cfg", [{}, {"symmetric": True, "matryoshka_dims": [32, 8]}])
def test_cached_loss_gradients_equal_uncached(ours, cfg):
    model = ours[0]
    grads = []
    for mini_batch in (0, 3):
        model.zero_grad(set_to_none=True)
        loss, _, stats = _ours_loss(ours, _records(True), mini_batch=mini_batch, **cfg)
        (loss * 2.0).backward()  # an upstream factor (the trainer's scaling) reaches the cached chunks too
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        grads[-1]["loss"] = loss.detach()
    model.zero_grad(set_to_none=True)
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) > 10
    scale = max(float(g.abs().max()) for g in grads[0].values())
    for name in grads[0]:  # equal to fp32 rounding: 1e-5 of the largest gradient (the chunks sum in another order)
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5 * scale, rtol=0)


def test_retrieval_metrics_by_hand():
    m = retrieval_metrics([1, 2, 11])
    assert m["recall@1"] == pytest.approx(1 / 3) and m["recall@10"] == pytest.approx(2 / 3)
    assert m["mrr@10"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / 1.584962500721156 + 0) / 3)
    assert m["map"] == pytest.approx((1 + 0.5 + 1 / 11) / 3)


def test_evaluation_ranks_the_dev_corpus(ours):
    from pretune.tasks.run import evaluate_task

    model, tok = ours
    task = build_task(TaskConfig(name="embedding"), model.config, tok)
    metrics, preds = evaluate_task(task, model, _records(True))
    assert set(metrics) == {"ndcg@10", "mrr@10", "map", "recall@1", "recall@5", "recall@10"}
    assert all(len(p["top"]) == 10 and 1 <= p["rank"] <= 10 for p in preds)  # 10 distinct docs in the corpus
    assert metrics["recall@10"] == 1.0


@pytest.mark.parametrize("data,message", [
    ({"anchor": "the cat"}, "missing field 'positive'"),
    ({"anchor": "the cat", "positive": "a dog", "negative": [""]}, "field 'negative' should hold non-empty texts"),
    ({"text_a": "the cat", "text_b": "a dog", "score": "high"}, "field 'score' should be int or float"),
    ({"text_a": "the cat", "text_b": "a dog", "score": True}, "expected a finite number"),
    ({"query": "the cat"}, "expected 'anchor' and 'positive'"),
])
def test_bad_records_are_named(ours, data, message):
    model, tok = ours
    task = build_task(TaskConfig(name="embedding"), model.config, tok)
    with pytest.raises(DataError, match=message) as err:
        task.encode(Record("train.jsonl:7", data))
    assert "train.jsonl:7" in str(err.value)


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    from pretune.jobs.finetune import finetune, load_finetune_config

    tmp_path = tmp_path_factory.mktemp("run")
    rows = [{"anchor": a, "positive": p, "negative": n} for a, p, n in TRIPLETS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=embedding", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", f"data.dev={tmp_path / 'dev.jsonl'}",
                                      "train.batch_size=5", "tune.epochs=3", "train.lr=1e-3"])
    return finetune(cfg, show_progress=False, log=lambda *a, **k: None)


def test_finetune_trains_and_evaluates(trained):
    first, last = trained.history[0][1], trained.dev
    assert last["mrr@10"] >= first["mrr@10"] and last["mrr@10"] > 0.5


def test_the_run_model_is_a_sentence_transformers_folder(trained):
    """SentenceTransformer(RUN/model) loads the run's model and gives the embeddings pretune's task computes."""
    from sentence_transformers import SentenceTransformer

    from pretune.jobs.inference import load_finetuned

    model_dir = trained.model_dir
    for name in ("modules.json", "1_Pooling/config.json", "2_Normalize", "config_sentence_transformers.json",
                 "sentence_bert_config.json", "tokenizer_config.json"):
        assert (model_dir / name).exists(), name
    texts = [a for a, _, _ in TRIPLETS]
    want = SentenceTransformer(str(model_dir), device="cpu").encode(texts, convert_to_tensor=True)
    loaded = load_pretrained(model_dir)
    task = build_task(TaskConfig(name="embedding"), loaded.model.config, loaded.tokenizer)
    batch = task.collate([f for t in texts for f in task.encode(Record("x:1", {"anchor": t}), labelled=False)])
    got = task.embed(loaded.model.eval(), batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert load_finetuned(model_dir) is not None  # pretune evaluate / predict read it with its task.json


def test_pretune_embed_reads_the_folder_modules(trained, tmp_path):
    """`pretune embed RUN/model` pools, normalises and truncates as the folder's modules say: SentenceTransformer's
    vectors, with no flag."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from pretune.cli import main

    texts = [a for a, _, _ in TRIPLETS]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    assert main(["embed", str(trained.model_dir), str(tmp_path / "texts.txt"), "--out", str(tmp_path / "e.npy")]) == 0
    want = SentenceTransformer(str(trained.model_dir), device="cpu").encode(texts)
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), want, atol=1e-5)


def test_unknown_modules_are_refused_by_name(trained, tmp_path):
    import shutil

    from pretune.config import ConfigError
    from pretune.interop.st_folder import read_st_modules

    folder = tmp_path / "st"
    shutil.copytree(trained.model_dir, folder)
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                                 "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match="models.Dense' of modules.json is not one pretune computes"):
        read_st_modules(folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    pool = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pool, "pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling pooling_mode_mean_tokens, pooling_mode_max_tokens"):
        read_st_modules(folder)



def _ddp_batches():
    """Six triplets (one global batch; the trainer gives each process 3): some with two hard negatives, one with
    none (the processes gather different numbers of rows); and six scored pairs."""
    rows = [*TRIPLETS, ("the old man on the bank", "an old man on a river bank", "a fast red car")]
    extra = {0: ["a blue ball in the green park", "the man reads a book"], 3: None}
    pairs = [{"anchor": a, "positive": p, **({} if extra.get(i, n) is None else {"negative": extra.get(i, n)})}
             for i, (a, p, n) in enumerate(rows)]
    scored = [{"text_a": a, "text_b": b, "score": s} for (a, b, _), s in zip(rows, [0.9, 0.1, 0.5, 0.7, 0.3, 0.6])]
    return pairs, scored


def test_negatives_gathered_over_two_processes_equal_one_process(folder, tmp_path):
    """A Trainer step on two gloo processes (DDP; each its half of the batch) against one process with the whole
    batch: with task.gather_across_ranks (the default) the loss and every gradient the optimizer gets are equal (to
    fp32 rounding) for mnrl, CoSENT, and the cached (GradCache) form of symmetric Matryoshka mnrl (the trainer then
    averages the gradients itself); without it each process ranks its own half alone, and the loss differs."""
    import multiprocessing
    import os
    import random

    from embedding_ddp import run_rank, trainer_step

    pairs, scored = _ddp_batches()
    cases = {"mnrl": ({}, pairs), "cosent": ({}, scored), "per_rank": ({"gather_across_ranks": False}, pairs),
             "cached symmetric matryoshka": ({"mini_batch": 2, "symmetric": True, "matryoshka_dims": [32, 8]}, pairs)}
    port = 20000 + (os.getpid() * 7 + random.randrange(1000)) % 20000
    spec = {k: {"cfg": c, "records": r} for k, (c, r) in cases.items()}
    fork = multiprocessing.get_context("fork")  # the children have torch and pretune imported already
    procs = [fork.Process(target=run_rank, args=(r, 2, port, folder, spec, tmp_path / "out.pt")) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():  # a hung collective: end it rather than the suite
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = torch.load(tmp_path / "out.pt")
    for name, (cfg, records) in cases.items():
        loss, grads = trainer_step(folder, cfg, records, tmp_path / f"one_{name}")
        if name == "per_rank":
            assert abs(got[name]["loss"] - loss) > 1e-2, (name, got[name]["loss"], loss)
            continue
        assert abs(got[name]["loss"] - loss) < 5e-6, (name, got[name]["loss"], loss)
        assert got[name]["grads"].keys() == grads.keys() and len(grads) > 10
        scale = max(float(g.abs().max()) for g in grads.values())
        for k, g in grads.items():  # fp32 rounding (the processes sum in another order): measured <= 1.6e-6 of it
            torch.testing.assert_close(got[name]["grads"][k], g, atol=5e-6 * scale, rtol=0,
                                       msg=lambda m, name=name, k=k: f"{name}, {k}: {m}")


def test_a_lora_run_writes_merged_weights_as_a_sentence_transformers_folder(folder, tmp_path):
    """--peft lora: model/ is the base with the adapter merged in, as a sentence-transformers folder that
    SentenceTransformer and `pretune embed` read and that embeds as the adapter does in pretune; the adapter itself is
    in RUN/adapter."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from pretune.cli import main
    from pretune.jobs.finetune import finetune, load_finetune_config

    rows = [{"anchor": a, "positive": p, "negative": n} for a, p, n in TRIPLETS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=embedding", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", "peft.method=lora",
                                      "train.batch_size=5", "tune.epochs=2", "train.lr=5e-2", "train.plot=false"])
    result = finetune(cfg, show_progress=False, log=lambda *a, **k: None)
    run = result.run_dir
    assert (run / "adapter" / "adapter_config.json").is_file() and not (run / "model" / "adapter_config.json").exists()
    assert (run / "model" / "modules.json").is_file() and (run / "model" / "2_Normalize").is_dir()

    texts = [a for a, _, _ in TRIPLETS]

    def pretune_vectors(path):
        loaded = load_pretrained(path)
        task = build_task(TaskConfig(name="embedding"), loaded.model.config, loaded.tokenizer)
        batch = task.collate([f for t in texts for f in task.encode(Record("x:1", {"anchor": t}), labelled=False)])
        with torch.no_grad():
            return task.embed(loaded.model.eval(), batch["input_ids"], batch["attention_mask"])

    adapter = pretune_vectors(run / "adapter")  # the trained adapter on its base, unmerged
    assert (adapter - pretune_vectors(folder)).abs().max() > 1e-3  # training moved the embeddings
    st_vectors = SentenceTransformer(str(run / "model"), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(st_vectors, adapter, atol=1e-5, rtol=0)
    assert main(["embed", str(run / "model"), str(_lines(tmp_path, texts)), "--out", str(tmp_path / "e.npy")]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "e.npy"), adapter.numpy(), atol=1e-5)
    from pretune.jobs.inference import load_finetuned

    assert load_finetuned(run / "model") is not None  # pretune evaluate / predict read it with its task.json


def _lines(tmp_path, texts):
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    return tmp_path / "texts.txt"


@pytest.mark.slow  # ~30 s of torchrun (make test-slow); the Trainer step on 2 processes runs by default (above)
@pytest.mark.parametrize("cfg", [[], ["task.mini_batch=2", "task.symmetric=true"]])
def test_finetune_under_torchrun_equals_one_process(folder, tmp_path, cfg):
    """`pretune finetune --task embedding` on 2 DDP processes (gloo) against 1: the same losses, weights and dev
    metrics (gathered negatives; the cached loss's gradients averaged by the trainer)."""
    import os
    import random
    import subprocess
    import sys

    from pretune.io.checkpoint import read_weights

    pairs, _ = _ddp_batches()
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs * 2))
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1")
    runs = {}
    for procs in (1, 2):
        out = tmp_path / f"run{procs}"
        cmd = ["-m", "pretune", "finetune", "--model", str(folder), "--task", "embedding", "--train",
               str(tmp_path / "train.jsonl"), "--dev", str(tmp_path / "dev.jsonl"), "--out", str(out), "--quiet",
               "train.batch_size=6", "train.steps=4", "tune.epochs=0", "train.lr=1e-3", "train.precision=fp32",
               "train.plot=false", "train.log_every=1", "train.eval_every=2", "train.tensorboard=false", *cfg]
        if procs > 1:
            port = str(20000 + (os.getpid() * 7 + random.randrange(1000)) % 20000)
            cmd = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, *cmd]
        res = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[procs] = ({r["step"]: r["loss"] for r in rows if r["split"] == "train"},
                       json.loads((out / "results.json").read_text())["dev"],
                       read_weights(out / "model" / "model.safetensors"))
    (curve1, dev1, w1), (curve2, dev2, w2) = runs[1], runs[2]
    assert len(curve1) == 4 and list(curve2.values()) == pytest.approx(list(curve1.values()), abs=1e-5)
    assert dev2 == pytest.approx(dev1, abs=1e-5)
    assert w1.keys() == w2.keys()
    for k in w1:
        if k.endswith("attention.self.key.bias"):  # its gradient is 0 but for rounding (a key bias shifts a query's
            continue  # every score alike), which AdamW's normalisation turns into lr-sized steps of either sign
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_an_adapter_that_does_not_merge_stays_in_model(folder, tmp_path):
    """--peft prefix adds computation rather than changing weights: model/ holds the adapter (pretune loads it), no
    sentence-transformers files, and the run says why."""
    from pretune.jobs.finetune import finetune, load_finetune_config

    rows = [{"anchor": a, "positive": p} for a, p, _ in TRIPLETS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=embedding", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", "peft.method=prefix",
                                      "train.batch_size=5", "train.steps=1", "tune.epochs=0", "train.plot=false"])
    lines = []
    run = finetune(cfg, show_progress=False, log=lambda *a, **k: lines.append(" ".join(map(str, a)))).run_dir
    assert (run / "model" / "pretune_adapter.json").is_file() and not (run / "model" / "modules.json").exists()
    assert not (run / "adapter").exists()
    assert any("model/ holds the adapter (pretune loads it), not a sentence-transformers folder" in x and "prefix" in x
               for x in lines)
    assert load_pretrained(run / "model").model is not None


def test_a_new_token_reaches_the_merged_sentence_transformers_folder(folder, tmp_path):
    """task.add_tokens with --peft lora: the token's trained row is merged into model/'s table, and
    SentenceTransformer reads the token as one id and embeds as pretune does."""
    from sentence_transformers import SentenceTransformer

    from pretune.jobs.finetune import finetune, load_finetune_config

    rows = [{"anchor": "[Q] " + a, "positive": p} for a, p, _ in TRIPLETS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    cfg = load_finetune_config(None, [f"model.init={folder}", "task.name=embedding", f"train.out={tmp_path / 'run'}",
                                      f"data.train={tmp_path / 'train.jsonl'}", 'task.add_tokens=["[Q]"]',
                                      "peft.method=lora", "train.batch_size=5", "train.steps=2", "tune.epochs=0",
                                      "train.lr=5e-2", "train.plot=false"])
    run = finetune(cfg, show_progress=False, log=lambda *a, **k: None).run_dir
    texts = ["[Q] the cat sat on the mat", "[Q] a dog ran in the park"]
    st_model = SentenceTransformer(str(run / "model"), device="cpu")
    loaded = load_pretrained(run / "model")
    q = loaded.tokenizer.token_to_id("[Q]")
    assert q == loaded.model.config.vocab_size - 1 and [x[1] for x in st_model.tokenizer(texts)["input_ids"]] == [q, q]
    start = load_pretrained(folder).model.transformer.embed.weight.mean(0)
    assert not torch.allclose(loaded.model.transformer.embed.weight[q], start)  # the trained row, merged
    task = build_task(TaskConfig(name="embedding"), loaded.model.config, loaded.tokenizer)
    batch = task.collate([f for t in texts for f in task.encode(Record("x:1", {"anchor": t}), labelled=False)])
    with torch.no_grad():
        got = task.embed(loaded.model.eval(), batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(got, st_model.encode(texts, convert_to_tensor=True), atol=1e-5, rtol=0)
