"""Wall time of lm-eval's loglikelihood requests: the ``pretune`` model class against lm-eval's ``hf`` class.

    .venv/bin/python scripts/lmeval_speed.py [--questions 96] [--rounds 2] [--batch-size 8] [--threads 2]

SmolLM2-135M-Instruct (fp32, CPU) on a WordNet gloss -> word multiple choice of ``--questions`` questions, 4
choices each (the bundled wordnet_reverse_dictionary test split), as lm-eval's multiple_choice tasks send them.
Each side loads once, then the two run alternately ``--rounds`` times on the same requests (only the model's
answering is timed); the best time of each is reported with the ratio, and the accuracies (equal: the
same requests scored by both). Both use the same batch size (lm-eval's ``hf`` default is 1, which would flatter
pretune).
"""

from __future__ import annotations

import argparse
import json
import random
import time


def build_requests(n: int):
    """lm-eval's loglikelihood requests of n questions, as its multiple_choice tasks make them."""
    from importlib.resources import files

    from lm_eval.api.instance import Instance

    lines = (files("pretune.bundled") / "tasks/wordnet_reverse_dictionary/test.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines][: max(n * 2, 64)]
    rng = random.Random(0)
    requests = []
    for i, r in enumerate(rows[:n]):
        others = [x["target"] for x in rng.sample(rows, 8) if x["target"] != r["target"]][:3]
        choices = others[:i % 4] + [r["target"]] + others[i % 4:]  # the answer is choice i % 4
        requests += [Instance("loglikelihood", doc=r, arguments=(f"Definition: {r['source']}\nWord:", " " + c),
                              idx=j) for j, c in enumerate(choices)]
    return requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from lm_eval.api.registry import get_model

    import pretune.jobs.harness  # noqa: F401  (registers "pretune")
    from pretune.realmodels import smollm2_dir

    torch.set_num_threads(args.threads)
    requests = build_requests(args.questions)
    model_dir = str(smollm2_dir())
    models = {"pretune": get_model("pretune")(pretrained=model_dir, batch_size=args.batch_size),
              "hf": get_model("hf")(pretrained=model_dir, batch_size=args.batch_size, device="cpu", dtype="float32")}
    best, scores = {}, {}
    for _ in range(args.rounds):
        for name, lm in models.items():
            t = time.perf_counter()
            out = lm.loglikelihood(requests, disable_tqdm=True)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            scores[name] = [lp for lp, _ in out]
    worst = max(abs(a - b) for a, b in zip(scores["pretune"], scores["hf"]))
    per_q = [scores["pretune"][i:i + 4] for i in range(0, len(requests), 4)]
    acc = sum(max(range(4), key=q.__getitem__) == i % 4 for i, q in enumerate(per_q)) / len(per_q)
    print(f"{len(requests)} loglikelihood requests ({args.questions} questions x 4 choices), SmolLM2-135M fp32, "
          f"batch {args.batch_size}, {args.threads} threads, best of {args.rounds}")
    for name in models:
        print(f"  {name:8s} {best[name]:7.2f} s  {len(requests) / best[name]:6.1f} requests/s")
    print(f"  ratio hf / pretune: {best['hf'] / best['pretune']:.2f}x; acc {acc:.3f}; largest log-likelihood "
          f"difference {worst:.2e}")


if __name__ == "__main__":
    main()
