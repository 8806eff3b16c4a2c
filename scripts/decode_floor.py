"""The memory-bandwidth floor of decoding one token with SmolLM2-135M on this machine: the time to read every weight
once, measured three ways — the bare matrix-vector products of one token run back to back (each linear layer and the
LM head, no attention or norms) with MKL's kernel (``F.linear``) and with oneDNN's (what the eager decoding step uses
in fp32, ``model/fast/decode_step.py``), and a sum over all the weights. Divide by eager / compiled ms per token
(``pretune bench generate``) for the fraction of the floor they reach (BENCHMARKS.md, bench generate).

    .venv/bin/python scripts/decode_floor.py
"""

import statistics
import time

import torch

import pretune
from pretune.model.fast.decode_step import _LINEAR_POINTWISE, onednn_linear
from pretune.realmodels import smollm2_dir


def main() -> None:
    torch.set_num_threads(2)
    model = pretune.from_hf(smollm2_dir()).eval()
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] + [model.head.weight]
    params = list(model.parameters())
    mb = sum(p.numel() * p.element_size() for p in params) / 1e6
    x = {n: torch.randn(1, n) for n in {w.shape[1] for w in mats}}

    def matvecs():
        for w in mats:
            torch.nn.functional.linear(x[w.shape[1]], w)

    def matvecs_onednn():
        for w in mats:
            onednn_linear(x[w.shape[1]], w)

    def sums():
        for p in params:
            p.sum()

    with torch.inference_mode():
        ways = [("matvecs (MKL)", matvecs)] + ([("matvecs (oneDNN)", matvecs_onednn)] if _LINEAR_POINTWISE else [])
        print(f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
        for name, fn in (*ways, ("sum", sums)):
            fn()
            times = []
            for _ in range(20):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best, med = min(times) * 1e3, statistics.median(times) * 1e3
            print(f"{name}: best {best:.1f} ms, median {med:.1f} ms for {mb:.0f} MB "
                  f"({mb / best:.1f} GB/s at best)")


if __name__ == "__main__":
    main()
