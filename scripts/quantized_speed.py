"""Batch-1 greedy decoding tokens/s of SmolLM2-135M-Instruct: fp32 eager against ``pretune.quantize`` int8 / int4, in
one process, the sides alternating round by round (a shared, busy machine: every side sees the same load; the fastest
round of each side counts). ``pretune bench generate --quantize int8 int4`` measures the same with a process per run.

    .venv/bin/python scripts/quantized_speed.py [--rounds 5] [--new-tokens 32] [--threads 1] [--json out.json]
        [--llamacpp q8_0=FILE.gguf q4_1=FILE.gguf]   # llama.cpp's sides (llama-cpp-python, make install-llamacpp)

Each timed call: ``pretune.generate`` of ``--new-tokens`` tokens (EOS ignored) after a 32-token prompt of random ids
(the same on every side), prefill included; tokens/s = new tokens / seconds. A llama.cpp side generates greedily from
the same ids (``Llama.generate`` with temperature 0, ``n_threads`` = ``--threads``) from a GGUF of the same model:
``pretune convert --to-gguf SMOL --type q8_0``, and the bundled Q4_1 file the checkpoint was dequantised from.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import pretune
from pretune.realmodels import smollm2_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--llamacpp", nargs="*", default=[], metavar="NAME=GGUF", help="llama.cpp sides")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fp32 = pretune.load(smollm2_dir()).eval().requires_grad_(False)
    sides = {"fp32": fp32}
    for mode in ("int8", "int4"):
        sides[mode] = pretune.quantize(copy.deepcopy(fp32), mode)
    ids = torch.randint(100, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    n = args.new_tokens

    def run(model, k):
        if not isinstance(model, torch.nn.Module):  # llama.cpp
            model.reset()
            for i, _ in enumerate(model.generate(ids[0].tolist(), temp=0.0, reset=True)):
                if i + 1 == k:
                    return
        return pretune.generate(model, ids, torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, pad_token_id=0)

    for spec in args.llamacpp:
        from llama_cpp import Llama

        name, path = spec.split("=", 1)
        sides[f"llama.cpp {name}"] = Llama(model_path=path, n_threads=args.threads, n_ctx=256, verbose=False)

    for model in sides.values():
        run(model, 4)  # warm-up
    rates = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            t0 = time.perf_counter()
            run(sides[name], n)
            rates[name].append(n / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    best = {k: max(v) for k, v in rates.items()}
    for k in sides:
        print(f"{k:<16} best {best[k]:6.1f} tok/s (median {statistics.median(rates[k]):6.1f}); "
              f"{best[k] / best['fp32']:.2f}x fp32 eager (medians: "
              f"{statistics.median(rates[k]) / statistics.median(rates['fp32']):.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "new_tokens": n, "rates": rates, "cpu":
                       torch.backends.cpu.get_cpu_capability()}, f, indent=2)


if __name__ == "__main__":
    main()
