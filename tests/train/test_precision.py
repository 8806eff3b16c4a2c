"""train.precision: ``auto`` picks bf16 only where the device computes it natively, an explicit bf16 without native
support is warned about with the measured cost, and every run prints the precision it uses."""

import pytest
import torch

from pretune.train import precision as P


@pytest.mark.parametrize("flags, expected", [({}, "fp32"), ({"avx2": True}, "fp32"), ({"amx_bf16": True}, "bf16"),
                                             ({"avx512_bf16": True}, "bf16")])
def test_auto_is_bf16_only_with_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setattr(P, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert P.resolve_precision("auto", "cpu") == expected
    assert P.resolve_precision("fp32", "cpu") == "fp32"


def test_auto_is_fp32_when_torch_runs_its_avx2_kernels(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"amx_bf16": True})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert P.resolve_precision("auto", "cpu") == "fp32"


def test_explicit_bf16_without_native_support_warns_with_the_measured_cost(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx2": True})
    monkeypatch.setattr(P, "bf16_slowdown", lambda: 97.0)
    said = []
    assert P.resolve_precision("bf16", "cpu", warn=said.append) == "bf16"  # kept: the user asked for it
    assert len(said) == 1 and "97x slower than fp32" in said[0] and "train.precision=auto" in said[0]
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"amx_bf16": True})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    said.clear()
    P.resolve_precision("bf16", "cpu", warn=said.append)
    assert said == []


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        P.resolve_precision("fp8", "cpu")


def test_fp16_is_never_picked_by_auto_and_is_kept_when_asked(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"amx_bf16": True})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert P.resolve_precision("auto", "cpu") == "bf16"
    said = []
    monkeypatch.setattr(P, "bf16_slowdown", lambda n=512, dtype=None: 40.0)
    assert P.resolve_precision("fp16", "cpu", warn=said.append) == "fp16"
    assert len(said) == 1 and "fp16 matmuls run 40x slower" in said[0]


def test_the_line_a_run_prints_names_the_choice_and_the_device(monkeypatch):
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"amx_bf16": True, "cpu_name": "Test CPU"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    line = P.precision_line("auto", P.resolve_precision("auto", "cpu"))
    assert line == "precision: bf16 (auto; CPU Test CPU (AVX512, AMX bf16))"
    assert "as set" in P.precision_line("fp32", "fp32")


def test_bf16_slowdown_is_a_measured_ratio():
    r = P.bf16_slowdown(64)
    assert r > 0 and r == P.bf16_slowdown(64)  # measured once, cached
