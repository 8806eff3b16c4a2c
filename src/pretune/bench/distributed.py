"""``pretune bench distributed``: what sharding and recomputation buy, measured.

Two measurements, each run in its own process (or ``torchrun`` job), alternating, several rounds:

* **memory per process, DDP vs FSDP** (``--what sharding``): ``torchrun --nproc_per_node 2`` (gloo on CPU, nccl on
  GPUs), a gpt2-medium-sized model (24 layers, dim 1024, vocab 50257: ~355 M parameters), AdamW steps on a fixed
  batch; DDP replicates parameters, gradients (plus DDP's gradient buckets) and AdamW state in each process, FSDP
  (``train.parallel=fsdp``: pretune's ``train.parallel.shard``) keeps 1/2 of each. Reported: each process's peak
  resident set size (the largest over the processes) and the step time.
* **activation checkpointing** (``--what checkpointing``): one process, a gpt2-small-sized model at sequence length
  1024 (batch 1), a step (forward, backward, AdamW) with ``train.activation_checkpointing`` off and ``blocks``;
  reported: the step's peak memory above what the process held before it (peak RSS after ``clear_refs``, Linux;
  the gradients stay allocated between steps, so this is the memory of the activations and what the backward
  allocates for them), the step time, and, from one more process that runs both, the largest gradient difference.

The model is built in fp32 (``--dtype bf16`` runs under autocast). The step time is the median of the timed steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from .common import add_run_arguments

MEMORY_TARGET = 0.6  # FSDP's peak RSS per process at most this fraction of DDP's (2 processes)
CKPT_MEMORY_TARGET = 0.6  # activation checkpointing: the step's peak memory at most this fraction (a >= 40 % cut)
CKPT_TIME_TARGET = 1.4  # ... at most this step-time overhead


@dataclass
class Job:
    what: str  # "sharding" or "checkpointing"
    impl: str  # sharding: ddp | fsdp; checkpointing: none | blocks | compare
    preset: str = "gpt2-medium"
    batch: int = 1
    seq: int = 128
    steps: int = 2
    warmup: int = 1
    threads: int = 0
    dtype: str = "fp32"


def _rss() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _model(job: Job):
    import torch

    from ..model import build_model

    torch.manual_seed(0)
    return build_model(job.preset, max_seq_len=max(job.seq, 1024), dropout=0.0, attn_dropout=0.0)


def _step_fn(model, optimizer, ids, dtype: str, keep_grads: bool = False):
    import contextlib

    import torch

    amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def step():
        with amp:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)
        return float(loss)

    return step


def _timed(step, job: Job) -> list[float]:
    for _ in range(job.warmup):
        step()
    times = []
    for _ in range(job.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_sharding_worker(job: Job) -> dict | None:
    """One process of the torchrun job: build, wrap (DDP or FSDP), time steps; process 0 returns every process's
    figures."""
    import torch
    import torch.distributed as dist

    from ..train.dist import all_gather_objects, init_distributed

    info = init_distributed()
    if job.threads:
        torch.set_num_threads(job.threads)
    model = _model(job).to(info.device)
    if job.impl == "fsdp":
        from ..train.loop import _stacks
        from ..train.parallel import shard

        shard(model, [b for s in _stacks(model) for b in s.layers], precision="fp32")
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(info.rank)
    ids = torch.randint(0, model.config.vocab_size, (job.batch, job.seq), generator=g).to(info.device)
    times = _timed(_step_fn(net, optimizer, ids, job.dtype), job)
    mine = {"rank": info.rank, "peak_rss_mb": _rss()[1], "step_s": statistics.median(times),
            "params": sum(p.numel() for p in model.parameters())}
    if info.device.type == "cuda":
        mine["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    rows = all_gather_objects(mine, info)
    dist.destroy_process_group()
    return {"impl": job.impl, "ranks": rows} if info.is_main else None


def run_checkpointing_worker(job: Job) -> dict:
    import torch

    if job.threads:
        torch.set_num_threads(job.threads)
    model = _model(job).train()
    ids = torch.randint(0, model.config.vocab_size, (job.batch, job.seq), generator=torch.Generator().manual_seed(0))
    if job.impl == "compare":  # the gradients of both ways, in one process
        grads = []
        for on in (False, True):
            model.checkpoint_blocks(on)
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        diff = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
        return {"impl": "compare", "max_grad_diff": diff}
    model.checkpoint_blocks(job.impl == "blocks")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _step_fn(model, optimizer, ids, job.dtype, keep_grads=True)
    step()  # AdamW state and gradient buffers exist from here on (kept): what remains is the step's activations
    _reset_peak()
    before = _rss()[0]
    times = _timed(step, job)
    return {"impl": job.impl, "step_peak_mb": _rss()[1] - before, "step_s": statistics.median(times)}


def _spawn(job: Job) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "pretune.bench.distributed", json.dumps(asdict(job))]
    if job.what == "sharding":
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(k, None)
        port = 21000 + os.getpid() % 20000
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "-m", "pretune.bench.distributed", json.dumps(asdict(job))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker failed for {job}:\n{proc.stderr[-3000:]}")
    return json.loads([x for x in proc.stdout.strip().splitlines() if x.startswith("{")][-1])


def bench_distributed(*, what=("sharding", "checkpointing"), rounds: int = 3, echo=print, **kw) -> list[dict]:
    rows = []
    if "sharding" in what:
        runs: dict[str, list[dict]] = {"ddp": [], "fsdp": []}
        for r in range(rounds):
            for impl in ("ddp", "fsdp"):
                res = _spawn(Job(what="sharding", impl=impl, **kw.get("sharding", {})))
                runs[impl].append(res)
                peaks = ", ".join(f"{x['peak_rss_mb']:.0f}" for x in res["ranks"])
                echo(f"  round {r + 1} {impl}: peak RSS per process {peaks} MB, step {res['ranks'][0]['step_s']:.2f} s")
        row = {"bench": "sharding", "processes": 2, **kw.get("sharding", {})}
        for impl, rs in runs.items():
            row[f"{impl}_peak_rss_mb"] = statistics.median(max(x["peak_rss_mb"] for x in r["ranks"]) for r in rs)
            row[f"{impl}_step_s"] = statistics.median(r["ranks"][0]["step_s"] for r in rs)
            row["params"] = rs[0]["ranks"][0]["params"]
        row["ratio"] = row["fsdp_peak_rss_mb"] / row["ddp_peak_rss_mb"]
        row["met"] = row["ratio"] <= MEMORY_TARGET
        rows.append(row)
    if "checkpointing" in what:
        ck = kw.get("checkpointing", {})
        runs = {"none": [], "blocks": []}
        for r in range(rounds):
            for impl in ("none", "blocks"):
                res = _spawn(Job(what="checkpointing", impl=impl, **ck))
                runs[impl].append(res)
                echo(f"  round {r + 1} checkpointing={impl}: step peak {res['step_peak_mb']:.0f} MB, "
                     f"step {res['step_s']:.2f} s")
        cmp = _spawn(Job(what="checkpointing", impl="compare", **ck))
        row = {"bench": "checkpointing", **ck, "max_grad_diff": cmp["max_grad_diff"]}
        for impl, rs in runs.items():
            row[f"{impl}_step_peak_mb"] = statistics.median(x["step_peak_mb"] for x in rs)
            row[f"{impl}_step_s"] = statistics.median(x["step_s"] for x in rs)
        row["memory_ratio"] = row["blocks_step_peak_mb"] / row["none_step_peak_mb"]
        row["time_ratio"] = row["blocks_step_s"] / row["none_step_s"]
        row["met"] = (row["memory_ratio"] <= CKPT_MEMORY_TARGET and row["time_ratio"] <= CKPT_TIME_TARGET
                      and row["max_grad_diff"] <= 1e-6)
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    from ..train.precision import describe_device

    lines = [f"device: {describe_device('cpu')}"]
    for r in rows:
        if r["bench"] == "sharding":
            lines.append(f"{r['preset']} ({r['params'] / 1e6:.0f} M parameters), batch {r['batch']} x {r['seq']}, "
                         f"AdamW, 2 processes: peak RSS per process")
            for impl in ("ddp", "fsdp"):
                lines.append(f"  {impl:<5}{r[f'{impl}_peak_rss_mb']:>9.0f} MB   step {r[f'{impl}_step_s']:.2f} s")
            lines.append(f"  FSDP / DDP memory: {r['ratio']:.2f}x (target <= {MEMORY_TARGET}: "
                         f"{'met' if r['met'] else 'NOT met'})")
        else:
            lines.append(f"{r['preset']}, batch {r['batch']} x {r['seq']}: the step's peak memory above the model "
                         "and AdamW state")
            for impl in ("none", "blocks"):
                lines.append(f"  checkpointing {impl:<7}{r[f'{impl}_step_peak_mb']:>8.0f} MB   step "
                             f"{r[f'{impl}_step_s']:.2f} s")
            lines.append(f"  memory {r['memory_ratio']:.2f}x, time {r['time_ratio']:.2f}x, largest gradient "
                         f"difference {r['max_grad_diff']:.1e} (targets <= {CKPT_MEMORY_TARGET}x memory, <= "
                         f"{CKPT_TIME_TARGET}x time, <= 1e-6: {'met' if r['met'] else 'NOT met'})")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--what", nargs="+", default=["sharding", "checkpointing"], choices=["sharding", "checkpointing"])
    p.add_argument("--preset", default="gpt2-medium", help="sharding: the model (default gpt2-medium, ~355 M)")
    p.add_argument("--seq", type=int, default=128, help="sharding: tokens per row (default 128)")
    p.add_argument("--ckpt-preset", default="gpt2", help="checkpointing: the model (default gpt2, 124 M)")
    p.add_argument("--ckpt-seq", type=int, default=1024, help="checkpointing: tokens per row (default 1024)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run (median taken)")
    add_run_arguments(p, threads="torch's default; sharding: 1 per process")


def run_cli(args) -> int:
    from .common import report

    kw = {"sharding": dict(preset=args.preset, batch=1, seq=args.seq, steps=args.steps, threads=args.threads or 1),
          "checkpointing": dict(preset=args.ckpt_preset, batch=1, seq=args.ckpt_seq, steps=args.steps,
                                threads=args.threads)}
    rows = bench_distributed(what=args.what, rounds=args.rounds, **kw)
    return report(rows, format_rows(rows), args.json)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].startswith("{"):
        job = Job(**json.loads(argv[0]))
        out = run_sharding_worker(job) if job.what == "sharding" else run_checkpointing_worker(job)
        if out is not None:
            print(json.dumps(out))
        return 0
    import argparse

    p = argparse.ArgumentParser(prog="pretune bench distributed", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
