"""Precision that fits the hardware: ``auto`` picks bf16 only where the device computes it natively.

Without native bf16 a CPU runs a bf16 matmul through a slow fallback (measured on an AVX2-only AMD EPYC: a
2048x512 by 512x2048 product took 8.7 s in bf16 against 88 ms in fp32), so ``auto`` means:

* CUDA: bf16 when the GPU supports it (``torch.cuda.is_bf16_supported()``), else fp32;
* CPU: bf16 when it has AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``) and torch runs its AVX512 kernels
  (not limited by ``ATEN_CPU_CAPABILITY=avx2``), else fp32.

``auto`` never picks fp16. An explicit ``bf16`` on a CPU without native bf16 is kept but warned about once, with
the slowdown measured on the spot. ``fp16`` (autocast to float16 with a dynamic loss scale, ``torch.amp.GradScaler``:
a step whose gradients overflow is skipped and the scale lowered) is for GPUs without bf16 (V100, T4); on a CPU it
is kept but warned about the same way.
"""

from __future__ import annotations

import functools
import time

import torch

__all__ = ["native_bf16", "resolve_precision", "describe_device", "bf16_slowdown", "PRECISIONS"]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cpu_flags() -> dict:
    try:
        return dict(torch.cpu.get_capabilities())
    except Exception:  # noqa: BLE001 - older torch: no capability table, assume no native bf16
        return {}


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` computes bf16 matmuls natively (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):  # ATen limited (ATEN_CPU_CAPABILITY=avx2)
        return False
    flags = _cpu_flags()
    return bool(flags.get("amx_bf16") or flags.get("avx512_bf16"))


def describe_device(device: torch.device | str = "cpu") -> str:
    """One line naming the device and what it computes bf16 with: "CPU Intel Xeon (AVX512, AMX bf16)"."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}" + (" (bf16)" if native_bf16(device) else " (no bf16)")
    flags = _cpu_flags()
    how = "AMX bf16" if flags.get("amx_bf16") else "AVX512-BF16" if flags.get("avx512_bf16") else "no native bf16"
    if how != "no native bf16" and not native_bf16("cpu"):
        how = f"{how} unused: torch limited to {torch.backends.cpu.get_cpu_capability()}"
    name = flags.get("cpu_name") or "CPU"
    return f"CPU {name} ({torch.backends.cpu.get_cpu_capability()}, {how})"


@functools.cache
def bf16_slowdown(n: int = 512, dtype: torch.dtype = torch.bfloat16) -> float:
    """How many times slower an (n x n) @ (n x n) matmul runs in ``dtype`` (bf16) than in fp32 on this CPU
    (median of 3)."""

    def timed(dtype) -> float:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[1]

    return timed(dtype) / max(timed(torch.float32), 1e-9)


def resolve_precision(requested: str, device: torch.device | str = "cpu", *, warn=None) -> str:
    """The precision a run uses: ``auto`` resolved for ``device``; ``bf16`` kept, with a warning through ``warn``
    (a function taking one line) when the device has no native bf16."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r} is not one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if requested == "bf16" and not native_bf16(device) and warn is not None:
        warn(f"warning: precision bf16 on {describe_device(device)}: bf16 matmuls run {bf16_slowdown():.0f}x slower "
             "than fp32 here; train.precision=auto (or fp32) avoids it")
    if requested == "fp16" and torch.device(device).type == "cpu" and warn is not None:
        slow = bf16_slowdown(dtype=torch.float16)
        if slow > 1.5:
            warn(f"warning: precision fp16 on {describe_device(device)}: fp16 matmuls run {slow:.0f}x slower than "
                 "fp32 here (fp16 is meant for GPUs without bf16); train.precision=auto (or fp32) avoids it")
    return requested


def precision_line(requested: str, resolved: str, device: torch.device | str = "cpu") -> str:
    """What a run prints at its start: "precision: bf16 (auto on CPU Intel Xeon (AVX512, AMX bf16))"."""
    how = "auto" if requested == "auto" else "as set"
    return f"precision: {resolved} ({how}; {describe_device(device)})"
