"""Time the fast model (model/fast/) against the reference (fast=False) on one device: a training step (forward +
backward, bf16 autocast on CUDA, fp32 on CPU) and greedy decoding, alternating the two sides, each round in turn.

    python scripts/fast_vs_reference.py [--device cuda] [--rounds 3] [--dim 512] [--layers 8]

Prints the device (and the CPU's capability), then per side the median time and the ratio reference / fast (above 1:
the fast wing is faster)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretune import build_model
from pretune.generation import generate


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _alternate(fn, a, b, rounds: int, device: str, per_round: bool = False):
    """fn(a) and fn(b) in turn after one warm-up each: the median seconds of each (and b/a per round)."""
    fn(a), fn(b)
    _sync(device)
    times = ([], [])
    for _ in range(rounds):
        for side, model in enumerate((a, b)):
            t = time.perf_counter()
            fn(model)
            _sync(device)
            times[side].append(time.perf_counter() - t)
    medians = statistics.median(times[0]), statistics.median(times[1])
    return (*medians, [y / x for x, y in zip(*times)]) if per_round else medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--ablate", action="store_true",
                    help="also time the training step with one fast class at a time swapped into the reference")
    args = ap.parse_args()
    dev = args.device
    where = torch.cuda.get_device_name() if dev == "cuda" else torch.backends.cpu.get_cpu_capability()
    print(f"device {dev} ({where}), torch {torch.__version__}")
    cfg = dict(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=max(1, args.dim // 256),
               ffn_dim=int(args.dim * 8 / 3) // 64 * 64, vocab_size=32000, max_seq_len=args.seq, dropout=0.0)
    torch.manual_seed(0)
    fast = build_model("tiny-llama", **cfg).to(dev)
    ref = build_model("tiny-llama", fast=False, **cfg).to(dev)
    ref.load_state_dict(fast.state_dict())
    ids = torch.randint(0, 32000, (args.batch, args.seq), device=dev)
    prompt = ids[:1, :32]
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda")

    def train_step(model):
        with autocast:
            loss = model.train()(ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    def decode(model):
        with autocast:
            generate(model.eval(), prompt, max_new_tokens=64, min_new_tokens=64)

    if args.ablate:  # which fast class makes the training step faster or slower on this device
        from pretune.model import fast as fast_wing

        for ref_cls, fast_cls in fast_wing.FAST.items():
            one = build_model("tiny-llama", fast=False, **cfg).to(dev)
            one.load_state_dict(fast.state_dict())
            for module in one.modules():
                if type(module) is ref_cls:
                    module.__class__ = fast_cls
                    if hasattr(module, "_init_fast"):
                        module._init_fast()
            o, r = _alternate(train_step, one, ref, args.rounds, dev)
            print(f"training step with only {fast_cls.__name__}: {o * 1e3:.1f} ms, reference {r * 1e3:.1f} ms, "
                  f"reference/that {r / o:.2f}x")
            del one

    for what, fn in (("training step", train_step), ("greedy decoding, 64 tokens", decode)):
        f, r, ratios = _alternate(fn, fast, ref, args.rounds, dev, per_round=True)
        print(f"{what}: fast {f * 1e3:.1f} ms, reference {r * 1e3:.1f} ms, reference/fast {r / f:.2f}x "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
