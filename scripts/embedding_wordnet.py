"""Does `pretune finetune --task embedding` learn? MiniLM trained on a few hundred WordNet pairs, held-out retrieval
against the untouched MiniLM and BM25 on the same queries and corpus.

The pairs are honest: each is one WordNet sense of the shared data's wordnet_defines set (../shared/data/tasks;
Princeton WordNet 3.0 glosses; the package bundles a prefix of it),
its definition (the gloss before its first quoted example) as the query and its first usage example as the positive:
"beyond a norm in views or actions" -> "an extreme conservative". Training pairs come from the set's train split,
the dev pairs from its dev split, the held-out queries and corpus (every held-out usage example) from its test split;
no gloss is in two splits. Defaults only: no flag but the data (MNRL, scale 20, MiniLM's mean pooling, full
finetuning, the batch size and epochs `pretune finetune` picks).

    .venv/bin/python scripts/embedding_wordnet.py --out /tmp/embed_wordnet [--train-pairs 400]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tasks" / "wordnet_defines"


def pairs(split: str) -> list[dict]:
    """(definition, first usage example) of every distinct 'defines' gloss of a split that has an example (the rule
    `pretune bench embed` uses on the bundled prefix)."""
    from pretune.bench.embed import gloss_pairs

    return gloss_pairs((DATA / f"{split}.jsonl").read_text(encoding="utf-8"))


def bm25_metrics(records: list[dict]) -> dict:
    from rank_bm25 import BM25Okapi

    from pretune.tasks.embedding import retrieval_metrics

    corpus = list(dict.fromkeys(r["positive"] for r in records))
    tokens = [re.findall(r"\w+", t.lower()) for t in corpus]
    bm25 = BM25Okapi(tokens)
    ranks = []
    for r in records:
        scores = bm25.get_scores(re.findall(r"\w+", r["anchor"].lower()))
        ranks.append(int(1 + (scores > scores[corpus.index(r["positive"])]).sum()))
    return retrieval_metrics(ranks)


def model_metrics(model_dir, records: list[dict]) -> dict:
    from pretune.loading import load_pretrained
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record
    from pretune.tasks.run import evaluate_task

    loaded = load_pretrained(model_dir)
    model = loaded.model.with_head(head="none")
    task = build_task(TaskConfig(name="embedding"), model.config, loaded.tokenizer)
    metrics, _ = evaluate_task(task, model, [Record(f"test:{i}", r) for i, r in enumerate(records)])
    return metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a new folder: the data, the run, results.json")
    ap.add_argument("--train-pairs", type=int, default=400, help="training pairs (default 400)")
    ap.add_argument("--test-pairs", type=int, default=300, help="held-out queries (default 300)")
    args = ap.parse_args()
    from pretune.realmodels import minilm_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    test, dev = pairs("test")[: args.test_pairs], pairs("dev")[:150]
    held = {t for r in test + dev for t in r.values()}  # a synset's gloss can serve several words: keep it in one split
    dev = [r for r in dev if not {r["anchor"], r["positive"]} & {t for x in test for t in x.values()}]
    train = [r for r in pairs("train") if not {r["anchor"], r["positive"]} & held][: args.train_pairs]
    splits = {"train": train, "dev": dev, "test": test}
    for name, recs in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cmd = [str(Path(sys.executable).parent / "pretune"), "finetune", "--task", "embedding", "--model",
           str(minilm_dir()), "--train", str(out / "train.jsonl"), "--dev", str(out / "dev.jsonl"), "--test",
           str(out / "test.jsonl"), "--out", str(out / "run"), "--quiet"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    results = {"pairs": {k: len(v) for k, v in splits.items()},
               "bm25": bm25_metrics(splits["test"]),
               "minilm": model_metrics(minilm_dir(), splits["test"]),
               "finetuned": json.loads((out / "run" / "results.json").read_text())["test"],
               "finetuned_reloaded": model_metrics(out / "run" / "model", splits["test"])}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
