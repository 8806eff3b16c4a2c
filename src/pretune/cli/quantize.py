"""``--quantize int8|int4``, shared by the commands that only run a model (generate, prompt, evaluate, predict, serve,
chat): the flag and the one call that applies it (``pretune.model.quantize``, PyTorch's CPU kernels;
docs/generate.md)."""

from __future__ import annotations

QUANTIZE_MODES = ("int8", "int4")  # pretune.model.fast.quantized.MODES (kept torch-free here for --help)


def add_quantize_argument(parser) -> None:
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default=None,
                        help="store the linear weights (and the LM head, int8) quantised for CPU decoding: int8 per "
                             "output channel, int4 in groups of 32 inputs (default: as loaded)")


def check_quantize(mode: str | None, *, device: str = "cpu", dtype: str = "fp32", compile: bool = False,
                   served: bool = False) -> None:
    """The combinations --quantize refuses, named (before the model is loaded). ``served``: pretune serve, which
    quantises the weights as loaded (fp32): its kernels compute with bf16 activations whatever --dtype says."""
    from ..config import ConfigError

    if mode is None:
        return
    if served and dtype != "fp32":
        raise ConfigError(f"--quantize {mode} quantises the fp32 weights and computes with bf16 activations itself: "
                          f"drop --dtype {dtype}")
    if device != "cpu":
        raise ConfigError(f"--quantize {mode} runs PyTorch's CPU kernels: use --device cpu (got --device {device})")
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--quantize {mode} computes in fp32 or bf16, not {dtype}: use --dtype fp32 or bf16")
    if compile:
        raise ConfigError(f"--quantize {mode} decodes eagerly through the flat decoding step; drop --compile")


def apply_quantize(model, mode: str | None):
    """``model`` with its linear weights quantised (in place) when ``mode`` is given."""
    if mode is None:
        return model
    from ..model import quantize

    return quantize(model, mode)
