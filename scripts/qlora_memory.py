"""QLoRA's memory and loss against a bf16 / fp32 frozen base (issue 36, part 2): peft.base_dtype = fp32, bf16, nf4,
int8, each side in its own process.

    .venv/bin/python scripts/qlora_memory.py --model smollm2 --batch 8 --len 256 --steps 3
    .venv/bin/python scripts/qlora_memory.py --model llama-1b --batch 1 --len 128 --steps 2
    .venv/bin/python scripts/qlora_memory.py --model smollm2 --batch 4 --len 128 --steps 100 --sides bf16 nf4 int8 \
        --parallel --threads 1                      # the loss target: 100 steps, the mean of the last 10

Each side: the model (SmolLM2-135M-Instruct, or a random-weight ~1B Llama config: dim 2048, 16 layers, 32/8 heads,
FFN 8192, vocabulary 32000, tied), LoRA r=16 alpha=32 on every linear layer (peft.inject with the side's base_dtype),
AdamW lr 1e-3 on the adapter, bf16 autocast for every side (what train.precision=bf16 runs; the fp32 base under it
computes what the bf16 base computes, bit for bit), ``--steps`` steps on fixed windows of the bundled enwiki_sample
(the same batches on every side). Reported: the frozen linear weights' bytes as stored against fp32, the process's
peak resident memory over the training steps alone (VmHWM, reset through /proc/self/clear_refs once the model is
built and its base stored), the loss of every step (step 1's is the base's own: LoRA's B starts at 0) and the mean
of the last 10 against the first side's.

A side ``nf4-bN`` is nf4 with N weights a block instead of 64 (QLoRA's and torchao's block), for the comparison in
BENCHMARKS.md; ``peft.base_dtype=nf4`` itself stores blocks of 64.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time

SIDES = ("fp32", "bf16", "nf4", "int8", "nf4-b32")


def _vm(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(side: str, model_name: str, batch: int, length: int, steps: int, threads: int = 0) -> dict:
    import torch
    from torch import nn

    import pretune
    from pretune import bundled, peft
    from pretune.model.fast import quantized
    from pretune.realmodels import smollm2_dir

    if threads:
        torch.set_num_threads(threads)
    base_dtype = side
    if side.startswith("nf4-b"):  # nf4 in smaller blocks: the module's block size, for this process only
        quantized.NF4_BLOCK, base_dtype = int(side[len("nf4-b"):]), "nf4"
    torch.manual_seed(0)
    tok = pretune.load_pretrained(smollm2_dir()).tokenizer
    if model_name == "smollm2":
        model = pretune.load(smollm2_dir())
    else:
        cfg = pretune.ModelConfig(arch="decoder", head="lm", vocab_size=32000, dim=2048, n_layers=16, n_heads=32,
                                  n_kv_heads=8, ffn_dim=8192, max_seq_len=2048, position="rope", norm="rmsnorm",
                                  ffn="swiglu", bias=False, dropout=0.0, attn_dropout=0.0, tie_embeddings=True,
                                  embed_norm=False, token_types=0)
        model = pretune.build_model(cfg)
    vocab = model.config.vocab_size
    text = gzip.open(bundled.path("corpus") / "enwiki_sample.txt.gz", "rt", encoding="utf-8").read()
    ids = torch.tensor(tok.encode(text[:2_000_000]), dtype=torch.long) % vocab
    lin_fp32 = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is nn.Linear)
    summary = peft.inject(model, peft.PeftConfig(method="lora", r=16, alpha=32, targets=["all-linear"],
                                                 base_dtype=base_dtype), seed=0)
    stored = lin_fp32 - summary.get("base_bytes_saved", 0)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(ids) - length - 1, (steps, batch), generator=g)
    with open("/proc/self/clear_refs", "w") as f:  # peak resident memory from here on: the steps alone
        f.write("5")
    before = _vm("VmRSS")
    losses, t0 = [], time.perf_counter()
    for s in range(steps):
        x = torch.stack([ids[i: i + length] for i in starts[s].tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        print(f"{side} step {s + 1}: loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return {"side": side, "model": model_name, "batch": batch, "len": length, "steps": steps,
            "frozen_linear_bytes_fp32": lin_fp32, "frozen_linear_bytes": stored,
            "rss_before_steps": before, "peak_rss_steps": _vm("VmHWM"), "losses": losses,
            "seconds_per_step": (time.perf_counter() - t0) / steps, "trainable": summary["trainable"],
            "threads": torch.get_num_threads()}


def _last10(row: dict) -> float:
    tail = row["losses"][-10:]
    return sum(tail) / len(tail)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "llama-1b"], default="smollm2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0: torch's default)")
    p.add_argument("--parallel", action="store_true", help="run the sides at once (loss runs on a busy machine: the "
                   "losses do not depend on the timing; the memory and time figures then do)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--worker", metavar="SIDE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.batch, args.len, args.steps, args.threads)))
        return
    cmd = [sys.executable, __file__, "--model", args.model, "--batch", str(args.batch), "--len", str(args.len),
           "--steps", str(args.steps), "--threads", str(args.threads), "--worker"]
    procs = {side: subprocess.Popen(cmd + [side], stdout=subprocess.PIPE, text=True)
             for side in (args.sides if args.parallel else ())}
    rows = []
    for side in args.sides:
        proc = procs.get(side) or subprocess.Popen(cmd + [side], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"side {side}: the worker failed (exit {proc.returncode}); its stderr is above")
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        base = rows[0]
        print(f"{side:<5} frozen linear weights {row['frozen_linear_bytes'] / 1e6:8.1f} MB "
              f"({row['frozen_linear_bytes'] / row['frozen_linear_bytes_fp32']:.3f}x fp32); peak RSS over the steps "
              f"{row['peak_rss_steps'] / 1e9:.2f} GB ({row['peak_rss_steps'] / base['peak_rss_steps']:.2f}x "
              f"{base['side']}); {row['seconds_per_step']:.1f} s/step; last loss {row['losses'][-1]:.4f} "
              f"({100 * (row['losses'][-1] / base['losses'][-1] - 1):+.2f} % vs {base['side']}); first (the base's "
              f"own) {row['losses'][0]:.4f} ({100 * (row['losses'][0] / base['losses'][0] - 1):+.2f} %); mean of the "
              f"last 10 {_last10(row):.4f} ({100 * (_last10(row) / _last10(base) - 1):+.2f} %)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
