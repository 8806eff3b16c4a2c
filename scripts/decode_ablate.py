"""What each part of an eager decoding step costs in place: SmolLM2's greedy decoding with one part of the step
replaced, milliseconds per token = (time of 72 new tokens - time of 8) / 64, best of 4 rounds. The variants give
wrong tokens on purpose; only their time means something. Run each variant in its own process, alternating with
the plain one, a few times (the VM drifts by several per cent within an hour):

    for i in 1 2 3; do for v in plain norm-identity norm-gain sdpa-identity extra-views; do
        .venv/bin/python scripts/decode_ablate.py $v; done; done

Variants: plain (as shipped); norm-identity (every RMSNorm returns its input); norm-gain (every RMSNorm multiplies
by its gain only: one op); sdpa-identity (attention returns its queries); extra-views (five more view calls before
every RMSNorm: the in-place cost of a call that does no work). BENCHMARKS.md ("Fewer calls per step") has figures.
"""

import sys
import time

import torch
import torch.nn.functional as F

import pretune
from pretune.generation import generate
from pretune.model import layers
from pretune.realmodels import smollm2_dir

VARIANTS = ("plain", "norm-identity", "norm-gain", "sdpa-identity", "extra-views")


def patch(variant: str) -> None:
    if variant == "norm-identity":
        layers.RMSNorm.forward = lambda self, x: x
    elif variant == "norm-gain":
        layers.RMSNorm.forward = lambda self, x: x * self.weight
    elif variant == "sdpa-identity":
        F.scaled_dot_product_attention = lambda q, k, v, *args, **kwargs: q
    elif variant == "extra-views":
        forward = layers.RMSNorm.forward

        def with_views(self, x):
            for _ in range(5):
                x.view(x.shape)
            return forward(self, x)

        layers.RMSNorm.forward = with_views


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
    if variant not in VARIANTS:
        raise SystemExit(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    torch.set_num_threads(2)
    patch(variant)
    model = pretune.from_hf(smollm2_dir()).eval()
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            generate(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    run(8)
    best = {8: float("inf"), 72: float("inf")}
    for _ in range(4):
        for n in best:
            best[n] = min(best[n], run(n))
    print(f"{variant}: {(best[72] - best[8]) / 64 * 1e3:.2f} ms per token "
          f"({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})")


if __name__ == "__main__":
    main()
