"""GGUF files (llama.cpp, Ollama, LM Studio) both ways, written and read with the ``gguf`` package.

The names go through the Hugging Face family's own table (interop/<family>.py: ours -> HF state-dict names), then
``gguf``'s TensorNameMap (HF -> GGUF, the table llama.cpp's convert_hf_to_gguf.py uses), with the three changes that
converter makes to the tensors themselves:

* llama (Llama, Mistral): q/k rows permuted from HF's rotate-half pairs (j, j + d/2) to llama.cpp's interleaved
  pairs (2j, 2j + 1) (``LlamaModel.permute``); Qwen2/3 and Gemma rotate halves in llama.cpp too (NEOX RoPE);
* gemma, gemma2: RMSNorm gains stored as 1 + w (llama.cpp multiplies by the gain; HF stores the offset);
* gpt2: Conv1D weights (in, out) transposed to (out, in), q/k/v fused into ``attn_qkv`` (the HF table already fuses).

Reading undoes each change, builds the family's config.json from the GGUF keys and imports through the same
``config_from_hf`` / ``weights_from_hf`` as a Hugging Face folder, so a file pretune wrote reads back to the same
model (f32: the same logits to rounding) and any llama.cpp file of these architectures reads too (quantised tensors
de-quantised to fp32 by ``gguf.quants``).

Types (``--type``, llama.cpp's names): f32, f16, bf16, q8_0, q4_0, q4_1. As in llama.cpp's converter, 1-D tensors
and norms stay f32, and a matrix whose rows are not a whole number of 32-value blocks falls back to f16; with q4_0 /
q4_1 the token embedding and the output head are q8_0 (llama.cpp's quantize keeps them at 6-8 bits too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..io.checkpoint import empty_parameters, load_state, unique_state
from . import InteropError, _family_for_config, family_of

__all__ = ["GGUFError", "TYPES", "ARCHS", "write_gguf", "write_lora_gguf", "read_gguf", "is_gguf"]

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1")
_MAGIC = b"GGUF"


class GGUFError(InteropError):
    """A model, adapter or file that GGUF export or import cannot take; the message names it and why."""


@dataclass(frozen=True)
class Arch:
    """How one Hugging Face family is written for llama.cpp."""

    name: str  # general.architecture, llama.cpp's LLM_ARCH name
    permute_qk: bool = False  # llama.cpp rotates interleaved pairs: HF's q/k rows are permuted
    norm_offset: float = 0.0  # added to every norm gain (Gemma: HF stores w, llama.cpp multiplies by 1 + w)
    conv1d: bool = False  # GPT-2: HF's Conv1D weights are stored transposed


# HF model_type -> llama.cpp architecture
ARCHS = {"llama": Arch("llama", permute_qk=True), "mistral": Arch("llama", permute_qk=True),
         "qwen2": Arch("qwen2"), "qwen3": Arch("qwen3"), "gemma": Arch("gemma", norm_offset=1.0),
         "gemma2": Arch("gemma2", norm_offset=1.0), "gpt2": Arch("gpt2", conv1d=True)}
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF files need the 'gguf' package: pip install 'pretune[hf]' (or pip install gguf)") from None
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes (or is named *.gguf)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == _MAGIC


# ---------------------------------------------------------------------------------------------
# which models llama.cpp runs
# ---------------------------------------------------------------------------------------------
def _why_not(cfg: ModelConfig, model_type: str) -> str | None:
    """Why llama.cpp's architecture for ``model_type`` would compute something else than this config (None: it
    computes the same)."""
    if cfg.head != "lm":
        return f"head={cfg.head!r}: llama.cpp runs language models (head='lm')"
    if cfg.rope_scaling == "llama3" and model_type not in ("llama", "mistral"):
        return "Llama 3.x RoPE scaling is written for the llama architecture only"
    if model_type in ("qwen2", "qwen3") and cfg.sliding_window is not None:
        return f"sliding_window={cfg.sliding_window}: llama.cpp's {model_type} attends to every key"
    if model_type == "gemma2":
        if cfg.attn_scale is not None:
            return (f"attn_scale={cfg.attn_scale:g} (query_pre_attn_scalar): llama.cpp's gemma2 scales by "
                    "head_dim ** -0.5 (except its 27B size)")
        if cfg.sliding_window is not None and list(cfg.sliding_layers or range(cfg.n_layers)) != list(
                range(0, cfg.n_layers, 2)):
            return (f"sliding_layers={cfg.sliding_layers}: llama.cpp's gemma2 makes the even layers local (0, 2, "
                    "...)")
    if model_type == "gpt2" and cfg.ffn != "gelu_tanh":
        return f"ffn={cfg.ffn!r}: llama.cpp's gpt2 uses the tanh GELU (ffn='gelu_tanh')"
    return None


def _family(cfg: ModelConfig):
    try:
        fam = _family_for_config(cfg)
    except InteropError as e:
        raise GGUFError(f"no GGUF architecture for this model: {e}") from None
    model_type = fam.MODEL_TYPES[0]
    if model_type not in ARCHS:
        raise GGUFError(f"the {model_type} family has no llama.cpp architecture; GGUF export takes "
                        f"{', '.join(sorted(ARCHS))}")
    why = _why_not(cfg, model_type)
    if why:
        raise GGUFError(f"a {model_type} model llama.cpp would run differently: {why}")
    return fam, model_type


# ---------------------------------------------------------------------------------------------
# tensors: HF names and values <-> GGUF ones
# ---------------------------------------------------------------------------------------------
def _permute(w: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """HF rotate-half rows of each head -> llama.cpp's interleaved ones (convert_hf_to_gguf's LlamaModel.permute)."""
    half = w.shape[0] // heads // 2
    shape = (heads, half, 2) if inverse else (heads, 2, half)
    return w.reshape(*shape, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_gguf_value(hf_name: str, t: torch.Tensor, arch: Arch, cfg: ModelConfig, inverse: bool = False):
    """An HF tensor as llama.cpp stores it (or, ``inverse``, back)."""
    if arch.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute(t, cfg.n_heads, inverse)
    if arch.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute(t, cfg.kv_heads, inverse)
    if arch.norm_offset and hf_name.endswith("norm.weight"):
        return t - arch.norm_offset if inverse else t + arch.norm_offset
    if arch.conv1d and hf_name.endswith(_CONV1D):
        return t.t()
    return t


def _names(arch: Arch, n_layers: int, hf_names) -> dict[str, str]:
    """HF name -> GGUF name, through gguf's TensorNameMap (llama.cpp's converter's table); unmapped -> error."""
    gguf = _gguf()
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.name)
    table = gguf.get_tensor_name_map(arch_id, n_layers)
    out = {}
    for name in hf_names:
        new = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GGUFError(f"tensor {name!r} has no GGUF name in llama.cpp's {arch.name} architecture")
        out[name] = new
    return out


def _qtype(gguf_name: str, shape: tuple[int, ...], type_: str):
    Q = _gguf().GGMLQuantizationType
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.startswith("position_embd"):
        return Q.F32
    if type_ in ("q4_0", "q4_1") and gguf_name.startswith(("token_embd", "output.")):
        type_ = "q8_0"
    want = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}[type_]
    block = _gguf().GGML_QUANT_SIZES[want][0]
    return want if shape[-1] % block == 0 else Q.F16  # llama.cpp's converter falls back to f16 too


def _add_tensor(writer, name: str, t: torch.Tensor, type_: str) -> None:
    gguf = _gguf()
    data = t.detach().to(torch.float32).contiguous().numpy()
    qtype = _qtype(name, data.shape, type_)
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


# ---------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------
def _write_hparams(w, cfg: ModelConfig, arch: Arch, model_type: str) -> None:
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    if arch.name == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
        return
    w.add_head_count_kv(cfg.kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_key_length(cfg.dh)
    w.add_value_length(cfg.dh)
    w.add_rope_dimension_count(cfg.dh)
    if arch.name == "llama":
        w.add_vocab_size(cfg.vocab_size)
    if model_type == "mistral" and cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)  # read back by pretune; llama.cpp's llama attends to every key
    if model_type == "gemma2":
        if cfg.attn_softcap is not None:
            w.add_attn_logit_softcapping(cfg.attn_softcap)
        if cfg.logit_softcap is not None:
            w.add_final_logit_softcapping(cfg.logit_softcap)
        w.add_sliding_window(cfg.sliding_window or cfg.max_seq_len)  # no local layer: a window as long as the model


def _rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.x RoPE scaling as llama.cpp reads it: one divisor per frequency (``rope_freqs.weight``; the
    converter's LlamaModel.generate_extra_tensors)."""
    import math

    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.dh, 2, dtype=torch.float32) / cfg.dh))
    old = cfg.rope_original_max_seq_len
    low, high = old / cfg.rope_low_freq_factor, old / cfg.rope_high_freq_factor
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(cfg.rope_factor)
        else:
            smooth = (old / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
            out.append(1 / ((1 - smooth) / cfg.rope_factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def check_out(out: str | os.PathLike, overwrite: bool) -> Path:
    """``out`` as a GGUF file path to write: refused when it is a folder, or an existing file without
    ``overwrite``."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise GGUFError(f"--out {out} is a folder; GGUF export writes one file (e.g. {out / 'model.gguf'})")
    if out.exists() and not overwrite:
        raise GGUFError(f"--out {out} exists; pass --overwrite to replace it")
    return out


def _write(writer_fill, arch_name: str, out: Path) -> Path:
    """Write a GGUF file atomically: ``writer_fill(writer)`` adds keys and tensors to a temporary file beside ``out``,
    which then replaces it."""
    gguf = _gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        writer = gguf.GGUFWriter(str(tmp), arch_name)
        writer_fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def write_gguf(model, out: str | os.PathLike, *, tokenizer, type: str = "f32", name: str = "",
               overwrite: bool = False) -> Path:
    """Write a decoder LM as a GGUF file llama.cpp runs, its tokenizer and chat template included.

    Args:
        model: a TransformerLM of a family in ``ARCHS`` with head 'lm' (anything else raises GGUFError naming it).
        out: the .gguf file (an existing one is refused unless ``overwrite``); written to a temporary file first.
        tokenizer: the model's ``pretune.io.tokenization.Tokenizer`` (byte-level BPE or Unigram; see
            ``io/gguf_tokenizer.py``).
        type: one of ``TYPES`` (llama.cpp's names).
        name: ``general.name`` (default: the file's stem).
    """
    from ..io.gguf_tokenizer import tokenizer_keys, write_tokenizer

    if type not in TYPES:
        raise GGUFError(f"--type {type!r}: expected one of {', '.join(TYPES)}")
    out = check_out(out, overwrite)
    cfg: ModelConfig = model.config
    fam, model_type = _family(cfg)
    arch = ARCHS[model_type]
    if tokenizer is None:
        raise GGUFError("a GGUF file holds its tokenizer, and this model has none; pass one (--tokenizer PATH)")
    tokenizer_keys(tokenizer, cfg.vocab_size)  # refuses a tokenizer llama.cpp would run differently, before writing
    hf = fam.weights_to_hf(unique_state(model), cfg)
    names = _names(arch, cfg.n_layers, hf)

    def fill(w):
        w.add_type("model")
        w.add_name(name or out.stem)
        _write_hparams(w, cfg, arch, model_type)
        w.add_file_type(_FILE_TYPES[type])
        if type.startswith("q"):
            w.add_quantization_version(_gguf().GGML_QUANT_VERSION)
        write_tokenizer(w, tokenizer, cfg.vocab_size)
        if cfg.rope_scaling == "llama3":
            _add_tensor(w, "rope_freqs.weight", _rope_factors(cfg), "f32")
        for hf_name, t in hf.items():
            _add_tensor(w, names[hf_name], _to_gguf_value(hf_name, t, arch, cfg), type)

    return _write(fill, arch.name, out)


def write_lora_gguf(model, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], out: str | os.PathLike, *,
                    type: str = "f32", name: str = "", overwrite: bool = False) -> Path:
    """Write LoRA factors as a GGUF adapter that llama.cpp applies to the base model's GGUF (``--lora FILE``).

    Args:
        model: the base TransformerLM (its family and shape name the tensors).
        factors: our module name (``transformer.decoder.layers.0.attn.q_proj``) -> (A (r, in), B (out, r)) with the
            LoRA scaling already folded into B (written with alpha 0: llama.cpp then scales by the user's --lora
            scale only).
        out, type, name, overwrite: as for :func:`write_gguf`; ``type`` f32, f16 or bf16.
    """
    if type not in ("f32", "f16", "bf16"):
        raise GGUFError(f"--type {type!r}: a GGUF LoRA is written as f32, f16 or bf16")
    out = check_out(out, overwrite)
    cfg: ModelConfig = model.config
    fam, model_type = _family(cfg)
    arch = ARCHS[model_type]
    if arch.conv1d:
        raise GGUFError("a GPT-2 LoRA is not written as GGUF (llama.cpp fuses q/k/v into one matrix); export the "
                        "merged model instead (--merged)")
    rows = {}
    for module, (a, b) in factors.items():
        hf = fam.weights_to_hf({f"{module}.weight": b}, cfg)  # the family's own name for the adapted matrix
        ((hf_name, _),) = hf.items()
        rows[hf_name] = (a, _to_gguf_value(hf_name, b, arch, cfg))  # B's rows are the weight's rows (permuted)
    names = _names(arch, cfg.n_layers, rows)

    def fill(w):
        gguf = _gguf()
        w.add_type("adapter")
        w.add_name(name or out.stem)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
        for hf_name, (a, b) in rows.items():
            for suffix, t in (("lora_a", a), ("lora_b", b)):
                data = t.detach().to(torch.float32).contiguous().numpy()
                if type == "f16":
                    w.add_tensor(f"{names[hf_name]}.{suffix}", data.astype(np.float16))
                elif type == "bf16":
                    qt = gguf.GGMLQuantizationType.BF16
                    w.add_tensor(f"{names[hf_name]}.{suffix}", gguf.quants.quantize(data, qt), raw_dtype=qt)
                else:
                    w.add_tensor(f"{names[hf_name]}.{suffix}", data)

    return _write(fill, arch.name, out)


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _reader(path: Path):
    gguf = _gguf()
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}, GGUF files with {_MAGIC!r})")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, ... on a truncated file
        raise GGUFError(f"{path}: a corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def _hf_config(arch: str, kv, tensors: dict, path: Path) -> dict:
    """The Hugging Face config.json of a GGUF file's hyper-parameters (``kv(key, default)`` reads ``{arch}.key``)."""
    vocab = int(tensors["token_embd.weight"].shape[-1])  # ggml's order: (dim, vocab)
    common = {"vocab_size": vocab, "bos_token_id": kv("tokenizer.ggml.bos_token_id", None, own=False),
              "eos_token_id": kv("tokenizer.ggml.eos_token_id", None, own=False),
              "pad_token_id": kv("tokenizer.ggml.padding_token_id", None, own=False)}
    dim, heads = kv("embedding_length"), kv("attention.head_count")
    if arch == "gpt2":
        return {**common, "model_type": "gpt2", "n_embd": dim, "n_layer": kv("block_count"), "n_head": heads,
                "n_inner": kv("feed_forward_length"), "n_positions": kv("context_length"),
                "layer_norm_epsilon": kv("attention.layer_norm_epsilon"), "activation_function": "gelu_new",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if "rope_freqs.weight" in tensors:
        raise GGUFError(f"{path}: Llama 3.x RoPE scaling (rope_freqs.weight) is not read from GGUF; convert the "
                        "Hugging Face folder instead (pretune convert --from-hf)")
    window = kv("attention.sliding_window", None)
    hf = {**common, "model_type": arch, "hidden_size": dim, "intermediate_size": kv("feed_forward_length"),
          "num_hidden_layers": kv("block_count"), "num_attention_heads": heads,
          "num_key_value_heads": kv("attention.head_count_kv", heads),
          "head_dim": kv("attention.key_length", dim // heads), "max_position_embeddings": kv("context_length"),
          "rms_norm_eps": kv("attention.layer_norm_rms_epsilon"), "rope_theta": kv("rope.freq_base", 10000.0),
          "tie_word_embeddings": "output.weight" not in tensors}
    if arch == "llama" and window is not None:
        hf.update(model_type="mistral", sliding_window=window)
    if arch == "gemma2":
        hf.update(attn_logit_softcapping=kv("attn_logit_softcapping", None),
                  final_logit_softcapping=kv("final_logit_softcapping", None), sliding_window=window or 4096,
                  query_pre_attn_scalar=hf["head_dim"])  # llama.cpp's scale: head_dim ** -0.5
    return hf


def _tensor(t) -> torch.Tensor:
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if t.tensor_type == Q.F32:
        data = np.array(t.data, dtype=np.float32)
    elif t.tensor_type == Q.F16:
        data = np.array(t.data).astype(np.float32)
    else:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(data).reshape([int(n) for n in reversed(t.shape)]))


def read_gguf(path: str | os.PathLike, *, tokenizer: bool = True):
    """Read a GGUF file of an architecture in ``ARCHS`` into a TransformerLM (fp32, eval mode) and its tokenizer.

    Returns ``(model, tokenizer)`` (the tokenizer None when ``tokenizer`` is False). Another architecture, a file
    that is not GGUF or is truncated, a tensor the family does not have: GGUFError naming the file and what.
    """
    from ..io.gguf_tokenizer import GGUFTokenizerError, read_tokenizer
    from ..model import TransformerLM

    path = Path(path).expanduser()
    reader = _reader(path)
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    readable = sorted({a.name for a in ARCHS.values()})
    if arch not in readable:
        raise GGUFError(f"{path}: architecture {arch!r} is not read by pretune (it reads {', '.join(readable)})")
    kind = fields.get("general.type")
    if kind is not None and kind.contents() == "adapter":
        raise GGUFError(f"{path}: a GGUF adapter (LoRA), not a model; llama.cpp applies it with --lora")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    missing = object()

    def kv(key, default=missing, own=True):
        field = fields.get(f"{arch}.{key}" if own else key)
        if field is None:
            if default is missing:
                raise GGUFError(f"{path}: no {arch}.{key} key")
            return default
        return field.contents()

    hf_config = _hf_config(arch, kv, tensors, path)
    fam = family_of(hf_config["model_type"])
    arch_info = ARCHS[hf_config["model_type"]]
    gguf_to_hf = {}
    try:
        config = fam.config_from_hf(hf_config, set())
        if config.eos_token_id is None and hf_config["eos_token_id"] is not None:
            config = config.replace(eos_token_id=int(hf_config["eos_token_id"]))
        with empty_parameters():  # on the meta device: the names and shapes a model of this config has
            expected = fam.weights_to_hf(unique_state(TransformerLM(config)), config)
        gguf_to_hf = {g: h for h, g in _names(arch_info, config.n_layers, expected).items()}
        unknown = sorted(set(tensors) - set(gguf_to_hf) - {"rope_freqs.weight"})
        if unknown:
            raise GGUFError(f"tensor {unknown[0]!r} is not part of a {hf_config['model_type']} model of this shape")
        hf = {h: _to_gguf_value(h, _tensor(tensors[g]), arch_info, config, inverse=True)
              for g, h in gguf_to_hf.items() if g in tensors}
        ours = fam.weights_from_hf(hf, config)
    except InteropError as e:
        raise GGUFError(f"{path}: {e}") from None
    with empty_parameters():
        model = TransformerLM(config)
    load_state(model, ours, source=f"{path} (GGUF, {arch})")
    tok = None
    if tokenizer:
        try:
            tok = read_tokenizer(fields, source=str(path))
        except GGUFTokenizerError as e:
            raise GGUFError(str(e)) from None
    return model.eval(), tok
