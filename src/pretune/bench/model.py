"""``pretune bench model``: training-step throughput of pretune vs transformers, side by side.

Each measurement runs in its own Python process (two models in one process distort each other's
allocator behaviour), the implementations alternate, and every configuration is repeated for
several rounds; the report gives the median tokens/s of each side, the ratio, and model FLOPs/s
as a fraction of a matmul peak measured in the same run (MFU).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

SHAPES = {  # the benchmark models of the model-core issue: 6 layers, dim 512, 8 heads, vocab 8192
    "gpt": dict(n_layers=6, dim=512, n_heads=8, ffn_dim=2048, vocab_size=8192),
    "bert": dict(n_layers=6, dim=512, n_heads=8, ffn_dim=2048, vocab_size=8192),
    "llama": dict(n_layers=6, dim=512, n_heads=8, ffn_dim=1376, vocab_size=8192),
}
# --loop labels: a user's plain loop (model(**batch).loss + AdamW) on each family's real vocabulary, where the
# LM head's logits are a large part of the memory
REAL_VOCAB = {"gpt": 50257, "bert": 30522, "llama": 32000}


@dataclass
class Job:
    impl: str  # pretune | transformers | matmul
    family: str  # gpt | bert
    dtype: str  # fp32 | bf16
    batch: int = 8
    seq: int = 256
    steps: int = 10
    warmup: int = 3
    threads: int = 0  # 0: torch default
    dropout: float = 0.1
    loop: str = "objective"  # objective: pretune's objective functions, forward + backward; labels: both sides
    # model(input_ids, labels=...).loss + backward + AdamW step, on the family's real vocabulary size


def _shape(job: Job) -> dict:
    shape = dict(SHAPES[job.family])
    if job.loop == "labels":
        shape["vocab_size"] = REAL_VOCAB[job.family]
    return shape


# ---------------------------------------------------------------------------------------------
# worker side (runs in a child process)
# ---------------------------------------------------------------------------------------------
def _build(job: Job):
    import torch

    shape = _shape(job)
    max_len = max(512, job.seq)
    if job.impl == "pretune":
        from ..model import build_model

        preset = {"gpt": "gpt2", "bert": "bert-base", "llama": "llama"}[job.family]
        extra = (dict(dropout=job.dropout, attn_dropout=job.dropout) if job.family != "llama" else
                 dict(n_kv_heads=shape["n_heads"], tie_embeddings=False, rope_base=10000.0))  # LlamaConfig's
        model = build_model(preset, **shape, max_seq_len=max_len, **extra)
    else:
        import transformers as T

        if job.family == "llama":
            model = T.LlamaForCausalLM(T.LlamaConfig(
                vocab_size=shape["vocab_size"], hidden_size=shape["dim"], num_hidden_layers=shape["n_layers"],
                num_attention_heads=shape["n_heads"], intermediate_size=shape["ffn_dim"],
                max_position_embeddings=max_len))
        elif job.family == "gpt":
            cfg = T.GPT2Config(vocab_size=shape["vocab_size"], n_embd=shape["dim"], n_layer=shape["n_layers"],
                               n_head=shape["n_heads"], n_inner=shape["ffn_dim"], n_positions=max_len,
                               resid_pdrop=job.dropout, embd_pdrop=job.dropout, attn_pdrop=job.dropout)
            model = T.GPT2LMHeadModel(cfg)
        else:
            cfg = T.BertConfig(vocab_size=shape["vocab_size"], hidden_size=shape["dim"],
                               num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
                               intermediate_size=shape["ffn_dim"], max_position_embeddings=max_len,
                               hidden_dropout_prob=job.dropout, attention_probs_dropout_prob=job.dropout)
            model = T.BertForMaskedLM(cfg)
        model.config._attn_implementation = "sdpa"
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (job.batch, job.seq), generator=g)
    if job.family != "bert":
        labels = ids
    else:  # 15% of positions carry an MLM target, the rest are ignored (-100)
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    return model, ids, labels


def _step_fn(job: Job, model, ids, labels):
    if job.loop == "labels":  # the same line on both sides
        return lambda: model(input_ids=ids, labels=labels).loss
    if job.impl == "pretune":
        from ..objectives import causal_lm_loss, masked_lm_loss

        if job.family != "bert":
            return lambda: causal_lm_loss(model, ids)
        return lambda: masked_lm_loss(model, ids, labels)
    return lambda: model(input_ids=ids, labels=labels).loss


def _flops_per_token(model_params: int, job: Job) -> float:
    """Training FLOPs per token: 6 * (matmul parameters) + 12 * layers * seq * dim for attention
    scores and values (Kaplan et al. 2020 / PaLM appendix B)."""
    shape = _shape(job)
    return 6 * model_params + 12 * shape["n_layers"] * job.seq * shape["dim"]


def _matmul_params(job: Job) -> int:
    s = _shape(job)
    d, f, v, L = s["dim"], s["ffn_dim"], s["vocab_size"], s["n_layers"]
    per_layer = 4 * d * d + (3 if job.family == "llama" else 2) * d * f
    head = d * v + (d * d if job.family == "bert" else 0)  # BERT's MLM head has a dense transform
    return L * per_layer + head


def run_worker(job: Job) -> dict:
    import torch

    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    if job.impl == "matmul":
        return _matmul_peak(job)
    import resource

    model, ids, labels = _build(job)
    step = _step_fn(job, model, ids, labels)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if job.loop == "labels" else None
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if job.dtype == "bf16" else None
    times = []
    for i in range(job.warmup + job.steps):
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx():
                loss = step()
        else:
            loss = step()
        loss.backward()
        if opt is not None:
            opt.step()
        for p in model.parameters():
            p.grad = None
        if i >= job.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = job.batch * job.seq
    return {"tokens_per_s": tokens / step_s, "step_s": step_s, "loss": float(loss.detach()),
            "flops_per_token": _flops_per_token(_matmul_params(job), job), "threads": torch.get_num_threads(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _matmul_peak(job: Job) -> dict:
    """Best FLOP/s of a large square matmul in the given dtype (the denominator of MFU)."""
    import torch

    n = 2048
    dt = torch.bfloat16 if job.dtype == "bf16" else torch.float32
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    for _ in range(2):
        a @ b
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return {"flops_per_s": best, "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def bench_model(*, families=("gpt", "bert"), dtypes=("bf16", "fp32"), rounds: int = 3, steps: int = 10,
                warmup: int = 3, batch: int = 8, seq: int = 256, threads: int = 0, dropout: float = 0.1,
                impls=("pretune", "transformers"), loop: str = "objective", echo=print) -> list[dict]:
    """Alternate pretune and transformers, one process per measurement, ``rounds`` times each;
    return one row per (family, dtype) with median tokens/s, ratio and MFU."""
    from ..io.progress import progress
    from .common import spawn_worker

    peaks: dict[str, list[float]] = {d: [] for d in dtypes}
    samples: dict[tuple, list[dict]] = {}
    plan = []
    for r in range(rounds):
        for dt in dtypes:
            plan.append(Job("matmul", "gpt", dt, threads=threads))
            for fam in families:
                order = impls if r % 2 == 0 else tuple(reversed(impls))  # alternate who goes first
                for impl in order:
                    plan.append(Job(impl, fam, dt, batch=batch, seq=seq, steps=steps, warmup=warmup,
                                    threads=threads, dropout=dropout, loop=loop))
    for job in progress(plan, desc="bench model", unit="run"):
        res = spawn_worker(job, "pretune.bench.model")
        if job.impl == "matmul":
            peaks[job.dtype].append(res["flops_per_s"])
        else:
            samples.setdefault((job.family, job.dtype, job.impl), []).append(res)
    rows = []
    for fam in families:
        for dt in dtypes:
            peak = max(peaks[dt])
            row = {"model": fam, "dtype": dt, "peak_gflops": peak / 1e9, "loop": loop}
            for impl in impls:
                runs = samples[(fam, dt, impl)]
                tps = statistics.median(r["tokens_per_s"] for r in runs)
                row[f"{impl}_tokens_per_s"] = tps
                row[f"{impl}_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
                row[f"{impl}_mfu"] = tps * runs[0]["flops_per_token"] / peak
                row[f"{impl}_peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
            if len(impls) == 2:
                row["ratio"] = row[f"{impls[0]}_tokens_per_s"] / row[f"{impls[1]}_tokens_per_s"]
                row["memory_ratio"] = row[f"{impls[0]}_peak_rss_mb"] / row[f"{impls[1]}_peak_rss_mb"]
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (f"{'model':<6}{'dtype':<6}{'pretune tok/s':>14}{'HF tok/s':>10}{'ratio':>7}"
            f"{'pretune MFU':>13}{'HF MFU':>8}{'peak GFLOP/s':>14}{'memory':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mem = f"{r['memory_ratio']:>7.2f}x" if "memory_ratio" in r else ""
        lines.append(f"{r['model']:<6}{r['dtype']:<6}{r['pretune_tokens_per_s']:>14.0f}"
                     f"{r['transformers_tokens_per_s']:>10.0f}{r['ratio']:>7.2f}"
                     f"{r['pretune_mfu']:>12.1%}{r['transformers_mfu']:>9.1%}{r['peak_gflops']:>14.0f}{mem}")
    if rows and rows[0].get("loop") == "labels":
        lines.append("loop: model(input_ids, labels=...).loss + backward + AdamW on both sides (real vocabularies); "
                     "memory = pretune / transformers peak RSS")
    return "\n".join(lines)


if __name__ == "__main__":  # worker entry point: python -m pretune.bench.model '{"impl": ...}'
    result = run_worker(Job(**json.loads(sys.argv[1])))
    print(json.dumps(result))


