"""Where QLoRA's loss gap on SmolLM2 comes from (issue 36): the loss of the frozen base itself, before any LoRA step,
with its attention and FFN projections rounded to each storage format — the weights replaced by what the format's
codes stand for, everything else (embeddings, tied LM head, norms) as loaded, bf16 autocast as in training.

    .venv/bin/python scripts/qlora_base_error.py [--windows 32] [--len 256] [SIDE ...]

Sides (default: all but the partial ones):
  bf16            the weights as loaded (bf16 autocast rounds them as a bf16 base stores them)
  int8            per output channel, symmetric (peft.base_dtype=int8)
  nf4             torchao's to_nf4, blocks of 64, scales quantised again in blocks of 256 (peft.base_dtype=nf4;
                  QLoRA's settings, Dettmers et al. 2023), from bf16 weights, dequantised in bf16 as torchao does
  nf4-b32         the same, blocks of 32
  nf4-exact       NF4 with fp32 code values and exact fp32 absmax scales (no double quantisation, no bf16): what
                  torchao's storage choices cost on top of the NF4 grid itself
  nf4-exact-b32   the same, blocks of 32
  int4-g32/-g64   asymmetric min/max 4-bit in groups of 32 / 64 (llama.cpp's Q4_1 layout; the bundled checkpoint is a
                  dequantised Q4_1 GGUF, so g32 finds its grid again)
  nf4-attn, nf4-ffn, nf4-down   nf4 on those projections only (the others as loaded): which part loses the loss

Reported: the mean next-token loss over ``--windows`` windows of ``--len`` tokens drawn (seed 1) from the bundled
enwiki_sample, and the weights' relative error ||W_q - W|| / ||W|| over the projections a side rounds.
"""

from __future__ import annotations

import argparse
import gzip
import math
import time

import torch
from torch import nn

import pretune
from pretune import bundled
from pretune.realmodels import smollm2_dir

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NF4_CODES = torch.tensor([  # the 16 NormalFloat values (bitsandbytes' and the paper's, fp32)
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])


def nf4_torchao(w: torch.Tensor, block: int = 64) -> torch.Tensor:
    from torchao.quantization import to_nf4

    wb = w.to(torch.bfloat16).contiguous()
    blocks = wb.numel() // block
    scaler_block = max(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % b == 0)  # as NF4Linear picks it
    return to_nf4(wb, block, scaler_block).get_original_weight().float()


def nf4_exact(w: torch.Tensor, block: int = 64) -> torch.Tensor:
    wb = w.float().reshape(-1, block)
    scale = wb.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    idx = (wb[..., None] / scale[..., None] - NF4_CODES).abs().argmin(-1)
    return (NF4_CODES[idx] * scale).reshape(w.shape)


def int4_minmax(w: torch.Tensor, group: int) -> torch.Tensor:
    wg = w.float().reshape(w.shape[0], -1, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    return (torch.round((wg - lo) / scale).clamp(0, 15) * scale + lo).reshape(w.shape)


def int8_channel(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127) * scale


SIDES = {  # name -> (rounding, projections it applies to: None = all)
    "bf16": (lambda w: w, None),
    "int8": (int8_channel, None),
    "nf4": (nf4_torchao, None),
    "nf4-b32": (lambda w: nf4_torchao(w, 32), None),
    "nf4-exact": (nf4_exact, None),
    "nf4-exact-b32": (lambda w: nf4_exact(w, 32), None),
    "int4-g32": (lambda w: int4_minmax(w, 32), None),
    "int4-g64": (lambda w: int4_minmax(w, 64), None),
    "nf4-attn": (nf4_torchao, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "nf4-ffn": (nf4_torchao, ("gate_proj", "up_proj", "down_proj")),
    "nf4-down": (nf4_torchao, ("down_proj",)),
}
DEFAULT = [s for s in SIDES if not s.startswith(("nf4-attn", "nf4-ffn", "nf4-down"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sides", nargs="*", metavar="SIDE", help=f"any of {', '.join(SIDES)}")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--len", type=int, default=256)
    args = p.parse_args()
    args.sides = args.sides or DEFAULT
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        p.error(f"unknown side {unknown[0]!r}: expected any of {', '.join(SIDES)}")
    torch.manual_seed(0)
    tok = pretune.load_pretrained(smollm2_dir()).tokenizer
    model = pretune.load(smollm2_dir()).eval()
    text = gzip.open(bundled.path("corpus") / "enwiki_sample.txt.gz", "rt", encoding="utf-8").read()
    ids = torch.tensor(tok.encode(text[:2_000_000]), dtype=torch.long) % model.config.vocab_size
    starts = torch.randint(0, len(ids) - args.len - 1, (args.windows,), generator=torch.Generator().manual_seed(1))
    batches = [torch.stack([ids[i: i + args.len] for i in chunk.tolist()]) for chunk in starts.split(8)]
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n.split(".")[-1] in PROJECTIONS}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    base = None
    for side in args.sides:
        fn, only = SIDES[side]
        t0, err, norm = time.perf_counter(), 0.0, 0.0
        with torch.no_grad():
            for n, m in linears.items():
                w = original[n]
                if only is None or n.split(".")[-1] in only:
                    q = fn(w)
                    err, norm = err + float(((q - w) ** 2).sum()), norm + float((w ** 2).sum())
                    m.weight.copy_(q)
                else:
                    m.weight.copy_(w)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = sum(float(model(x, labels=x).loss) for x in batches) / len(batches)
        base = loss if base is None else base
        print(f"{side:<14} loss {loss:.4f} ({100 * (loss / base - 1):+.2f} % vs {args.sides[0]}); weights' relative "
              f"error {math.sqrt(err / norm) if norm else 0.0:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
