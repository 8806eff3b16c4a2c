"""Time scoring N wordnet_reverse_dictionary test records with SmolLM2 by generation (task seq2seq, prefix
"word for: "), for the before/after figure of BENCHMARKS.md ("Evaluation by generation"). Runs against the pretune
tree on PYTHONPATH, so an older commit can be timed from a worktree:

    git worktree add /tmp/before d4388c5
    PYTHONPATH=/tmp/before/src .venv/bin/python scripts/seq2seq_eval_speed.py before 50
    .venv/bin/python scripts/seq2seq_eval_speed.py after 50
"""
import json
import sys
import time
from pathlib import Path

import torch

try:
    from pretune.io.tokenization import Tokenizer
except ImportError:  # a checkout before pretune/io/ (or before tokenization.py)
    try:
        from pretune.tokenization import Tokenizer
    except ImportError:
        from pretune.tokenize import Tokenizer
import pretune
from pretune.realmodels import smollm2_dir

folder = smollm2_dir()
mode, n = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
model = pretune.from_hf(folder).eval()
tok = Tokenizer.load(folder)
B = str(Path(__file__).resolve().parent.parent / "src/pretune/bundled/tasks/wordnet_reverse_dictionary/test.jsonl")
rows = [json.loads(x) for x in open(B).read().splitlines()[:n]]
if mode == "before":  # run in a checkout of the commit before the batched generate()
    from pretune.finetune import evaluate_task

    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record
    task = build_task(TaskConfig(name="seq2seq", prefix="word for: ", max_target_len=8), model.config, tok)
    recs = [Record(f"t:{i}", r) for i, r in enumerate(rows)]
else:
    from pretune.jobs.inference import evaluate_task
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record
    task = build_task(TaskConfig(name="seq2seq", prefix="word for: ", max_target_len=8), model.config, tok)
    recs = [Record(f"t:{i}", r) for i, r in enumerate(rows)]
t0 = time.perf_counter()
metrics, preds = evaluate_task(task, model, recs, batch_size=16)
dt = time.perf_counter() - t0
print(json.dumps({"mode": mode, "n": n, "seconds": dt, "records_per_s": n / dt, "metrics": metrics,
                  "preds": preds[:5]}))
