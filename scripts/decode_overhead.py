"""The framework time of eager decoding: SmolLM2's 30-layer shape shrunk to dim 64 (weights that cost nothing), greedy
decoding with pretune's generate, milliseconds per token = (time of 72 new tokens - time of 8) / 64, best of 3
rounds. What is left of a real model's time per token above the memory-bandwidth floor (scripts/decode_floor.py)
that is not the framework is the matrix-vector products running slower than back to back (BENCHMARKS.md).

    .venv/bin/python scripts/decode_overhead.py
"""

import time

import torch

import pretune
from pretune.generation import generate
from pretune.model import build_model
from pretune.realmodels import smollm2_dir


def main() -> None:
    torch.set_num_threads(2)
    cfg = pretune.from_hf(smollm2_dir()).config.replace(dim=64, n_heads=8, n_kv_heads=2, ffn_dim=128, vocab_size=512)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))

    def run(n: int) -> None:
        with torch.inference_mode():
            generate(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    run(8)
    best = {}
    for _ in range(3):
        for n in (8, 72):
            t = time.perf_counter()
            run(n)
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t)
    print(f"framework time: {(best[72] - best[8]) / 64 * 1e3:.2f} ms per token ({cfg.n_layers} layers, dim 64, "
          f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})")


if __name__ == "__main__":
    main()
