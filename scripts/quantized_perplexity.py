"""Perplexity of SmolLM2-135M-Instruct on held-out bundled text, fp32 against ``pretune.quantize`` (int8, int4), for
issue 36's acceptance (int8 within +1 %, int4 within +5 % of fp32) and the choice of int4's group size and of the LM
head's format.

    .venv/bin/python scripts/quantized_perplexity.py [--windows 16] [--len 512] [--json out.json]

The text: the bundled enwiki_sample (106 Wikipedia articles), tokenized with SmolLM2's tokenizer, cut into
``--windows`` non-overlapping windows of ``--len`` tokens taken evenly across it; perplexity = exp(mean next-token
cross-entropy) over every predicted token, each window scored alone (no context carried over). Same windows for every
side; every side loads the model afresh and runs its forward (the prefill path: dequantised weights for this many
rows, so the numbers are those of the quantised weights, not of a kernel's rounding).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time

import torch

import pretune
from pretune import bundled
from pretune.realmodels import smollm2_dir

SIDES = {  # name -> quantize() arguments (None: fp32)
    "fp32": None,
    "int8": dict(mode="int8", head="int8"),
    "int8 head fp32": dict(mode="int8", head=None),
    "int4 g32 head int8": dict(mode="int4", head="int8", group=32),
    "int4 g64 head int8": dict(mode="int4", head="int8", group=64),
    "int4 g32 head int4": dict(mode="int4", head="int4", group=32),
}


def windows(n: int, length: int) -> torch.Tensor:
    text = gzip.open(bundled.path("corpus") / "enwiki_sample.txt.gz", "rt", encoding="utf-8").read()
    tok = pretune.load_pretrained(smollm2_dir()).tokenizer
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    starts = torch.linspace(0, len(ids) - length - 1, n).long()
    return torch.stack([ids[s: s + length] for s in starts])


@torch.no_grad()
def perplexity(model, batch: torch.Tensor) -> float:
    total, count = 0.0, 0
    for row in batch:
        logits = model(row[None]).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
        count += row.numel() - 1
    return math.exp(total / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    batch = windows(args.windows, args.len)
    rows = {}
    for name in args.sides:
        model = pretune.load(smollm2_dir()).eval().requires_grad_(False)
        if SIDES[name] is not None:
            kw = dict(SIDES[name])
            pretune.quantize(model, kw.pop("mode"), **kw)
        t0 = time.perf_counter()
        rows[name] = {"perplexity": perplexity(model, batch), "seconds": time.perf_counter() - t0,
                      "quantized_bytes": getattr(model, "quantization", {}).get("bytes", 0)}
        base = rows.get("fp32", {}).get("perplexity")
        rel = f" ({100 * (rows[name]['perplexity'] / base - 1):+.2f} % vs fp32)" if base else ""
        print(f"{name:<22} perplexity {rows[name]['perplexity']:.4f}{rel}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"windows": args.windows, "len": args.len, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
