"""Does preference tuning move the policy itself? For each held-out pair, whether the model alone (no reference,
no implicit reward) gives the chosen completion a higher summed log-probability than the rejected one — for the
base model and for the tuned one (issue 33's acceptance: the tuned policy prefers chosen more often than the base).

    python scripts/dpo_learning.py RUN/model pairs_test.jsonl [--base BASE]

RUN/model is a `pretune finetune --task dpo` result (an adapter folder or a whole checkpoint); the base is the model
the run started from (the adapter's recorded base, or --base).
"""

from __future__ import annotations

import argparse
import json

import torch


def preferences(model, task, feats, batch_size: int = 8) -> list[bool]:
    """Per pair: the model's summed log-probability of chosen > that of rejected (a tie is not a preference)."""
    out = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(feats), batch_size):
            batch = task.collate(feats[i:i + batch_size])
            sums, _ = task.sequence_logps(model, batch)
            n = sums.shape[0] // 2
            out += (sums[:n] > sums[n:]).tolist()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the dpo run's model/ folder")
    p.add_argument("pairs", help="held-out preference pairs (JSONL)")
    p.add_argument("--base", default="", help="the base model (default: the adapter's recorded base)")
    args = p.parse_args()
    import pretune
    from pretune.jobs.inference import load_finetuned
    from pretune.peft import read_meta
    from pretune.tasks import read_records
    from pretune.tasks.run import encode_records

    tuned, tok, task = load_finetuned(args.model)
    base_dir = args.base or read_meta(args.model)["base"]["model"]
    base = pretune.load(base_dir)
    recs = read_records(args.pairs)
    feats = encode_records(task, recs, show_progress=False)
    result = {}
    for name, model in (("base", base), ("tuned", tuned)):
        prefs = preferences(model, task, feats)
        result[name] = sum(prefs) / len(prefs)
    result["pairs"] = len(feats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
