"""One training step of the embedding task through pretune's Trainer, for test_embedding.py's DDP test: imported
there for the one-process side and for :func:`run_rank`, which the test forks into two gloo processes (no second
import of torch: a few seconds less), or run as a script in each of them:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/tasks/embedding_ddp.py FOLDER CASES OUT

FOLDER: the tiny BERT; CASES: a JSON file of {"name": {"cfg": {task settings}, "records": [record dicts]}}, every
case's records one global batch (the trainer splits it between the processes). Rank 0 writes OUT (torch.save): per
case the step's loss and the gradients the optimizer was handed."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def trainer_step(folder, cfg: dict, records: list[dict], run_dir, dist=None) -> tuple[float, dict]:
    """(the step's loss, {parameter name: its gradient as the optimizer steps}) of one Trainer step over ``records``
    as one batch (fp32, no clipping), in this process or, with ``dist``, this process's share under DDP."""
    from pretune.loading import load_pretrained
    from pretune.runconfig import TrainConfig
    from pretune.tasks import TaskConfig, build_task
    from pretune.tasks.base import Record
    from pretune.train.loop import ExampleSet, Trainer

    loaded = load_pretrained(folder)
    model, tok = loaded.model.with_head(head="none"), loaded.tokenizer  # no dropout in the folder: processes agree
    task = build_task(TaskConfig(name="embedding", **cfg), model.config, tok)
    task.dist = dist
    feats = [f for i, r in enumerate(records) for f in task.encode(Record(f"batch:{i}", r))]
    data = ExampleSet(get=lambda i: feats[i], train_ids=np.arange(len(feats)), eval_ids=np.arange(0))
    tc = TrainConfig(out=str(run_dir), steps=1, batch_size=len(feats), clip=0.0, precision="fp32", report_to=[],
                     plot=False, lr=1e-3)
    trainer = Trainer(model=model, objective=task, data=data, cfg=tc, run_dir=run_dir, dist=dist,
                      show_progress=False)
    grads: dict[str, torch.Tensor] = {}
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return trainer.train_step()["loss"], grads


def run_rank(rank: int, world: int, port: int, folder, cases: dict, out) -> None:
    """One process of the job: joins the gloo group of ``world`` processes (127.0.0.1:``port``), runs each case's
    step and, as rank 0, saves {case: {"loss", "grads"}} to ``out``."""
    import os

    from pretune.train.dist import init_distributed, shutdown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    d = init_distributed()
    results = {}
    for name, case in cases.items():
        loss, grads = trainer_step(folder, case["cfg"], case["records"], f"{out}.{name}.{d.rank}", dist=d)
        results[name] = {"loss": loss, "grads": grads}
    if d.is_main:
        torch.save(results, out)
    shutdown(d)


if __name__ == "__main__":
    import os

    folder, cases_file, out = sys.argv[1:4]
    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]), folder,
             json.loads(open(cases_file).read()), out)
