"""``pretune generate``: continue prompts with a pretune checkpoint or a Hugging Face folder.

One prompt decoded greedily or by sampling is streamed to the terminal token by token; otherwise every
prompt's output is printed when its batch is done. Prompts come from the command line and/or a file (one
per line); batches are left-padded.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from .quantize import add_quantize_argument, apply_quantize, check_quantize

GENERATE_DESCRIPTION = (
    "Generate text with a decoder or encoder-decoder LM (a pretune checkpoint folder or a Hugging Face folder "
    "with its tokenizer): greedy by default, sampling with --do-sample (--temperature, --top-k, --top-p, --seed), "
    "beam search with --num-beams. Generation ends at the model's EOS token, at a --stop string (kept in the "
    "output) or after --max-new-tokens. A single greedy or sampled sequence is streamed as it is generated.")

GENERATE_EPILOG = r"""escapes: \n, \t and \\ in prompts, --system and --stop are turned into newline, tab and backslash.

examples:
  pretune generate MODEL "Once upon a time" --max-new-tokens 40
  pretune generate MODEL "The capital of France is" --do-sample --temperature 0.7 --top-p 0.9 --seed 1 \
      --num-return-sequences 3
  pretune generate MODEL "Translate to German: Hello" --num-beams 4      (T5: the input goes to the encoder)
  pretune generate MODEL --file prompts.txt --stop '\n' --out generations.jsonl
  pretune generate SMOLLM2_DIR "What is the capital of France?" --chat --max-new-tokens 64
"""


def _unescape(text: str | None) -> str | None:
    from .prompt import unescape

    return unescape(text)


def add_generate_parser(sub) -> argparse.ArgumentParser:
    """Register ``generate`` on an argparse subparsers object (``func=cmd_generate``); returns its parser."""
    s = sub.add_parser("generate", help="generate text from prompts (greedy, sampling, beam search; streaming)",
                       description=textwrap.fill(GENERATE_DESCRIPTION, 100), epilog=GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="pretune checkpoint, Hugging Face folder or adapter folder "
                   "(a decoder or encoder-decoder with an LM head)")
    s.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text(s)")
    s.add_argument("--file", metavar="FILE", help="more prompts, one per line (blank lines skipped; - for stdin)")
    s.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or folder (default: the model's)")
    s.add_argument("--base", metavar="DIR", help="an adapter folder's base model (default: the path it recorded)")
    s.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most "
                   "(default 64)")
    s.add_argument("--min-new-tokens", type=int, default=0, metavar="N", help="no EOS before N tokens (default 0)")
    g = s.add_argument_group("sampling")
    g.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    g.add_argument("--temperature", type=float, default=1.0, help="divide logits by this (default 1.0)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the fewest tokens whose probability reaches P (nucleus sampling)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible runs)")
    g = s.add_argument_group("beam search")
    g.add_argument("--num-beams", type=int, default=1, metavar="K", help="beam width (default 1: no beam search)")
    g.add_argument("--length-penalty", type=float, default=1.0,
                   help="finished beams score sum(log p) / length ** this (default 1.0; > 0 favours longer)")
    g.add_argument("--early-stopping", action="store_true", help="stop a prompt once num_beams beams have ended")
    s.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                   help="outputs per prompt: the N best beams, or N samples (default 1)")
    s.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop a sequence once its text contains STR (repeatable; kept in the output)")
    s.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat "
                   "template (the folder's chat_template.jinja / tokenizer_config.json)")
    s.add_argument("--system", metavar="TEXT", help="--chat: a system message before the user message")
    s.add_argument("--bos", choices=["auto", "yes", "no"], default="auto",
                   help="decoder prompts: put the BOS token first (auto: when the tokenizer's post-processor does, "
                   "as transformers' tokenizer(text) does)")
    s.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per batch (default 8)")
    s.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    s.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda when available)")
    add_quantize_argument(s)
    s.add_argument("--compile", action="store_true",
                   help="decode with a fixed-shape KV cache and a torch.compile'd step (needs a C++ compiler on the "
                   "CPU): the first batch of each size and length bucket compiles (about a minute for a 135M model, "
                   "seconds once inductor's disk cache has it), then every token costs little more than reading the "
                   "weights; worth it for long outputs and many prompts")
    s.add_argument("--no-stream", action="store_true", help="print a single output at the end, not as it grows")
    s.add_argument("--out", metavar="FILE", help="also write JSONL: one line per prompt with its outputs (a new file)")
    s.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    s.set_defaults(func=cmd_generate)
    return s


def _read_prompts(args) -> list[str]:
    from ..config import ConfigError

    prompts = [_unescape(p) for p in args.prompts]
    if args.file:
        try:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--file {args.file}: cannot read it ({e.strerror})") from None
        prompts += [_unescape(line) for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: give PROMPT text or --file FILE")
    return prompts


class TextStreamer:
    """Prints the text of a growing token list as it grows: the whole list is decoded each time (so
    multi-token characters and word boundaries come out right) and only the new characters are written;
    a trailing incomplete character (U+FFFD) waits for its next token."""

    def __init__(self, tok, out=None):
        self.tok, self.out = tok, out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def end(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


def _text(ids: list[int], tok, eos: int | None, pad: int) -> str:
    """The text of one row's new tokens: up to its EOS, without the padding that fills it after a stop."""
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    while ids and ids[-1] == pad:
        ids.pop()
    return tok.decode(ids, skip_special_tokens=True)


def cmd_generate(args) -> int:
    import torch

    from ..config import ConfigError
    from ..generation.decode import generate
    from ..generation.scoring import _pad, prompt_ids
    from ..loading import load_pretrained
    from ..model.layout import layout_of

    prompts = _read_prompts(args)
    if args.out:
        from ..io.outputs import check_file

        check_file(args.out, overwrite=args.overwrite, what="output file")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    check_quantize(args.quantize, device=device, dtype=args.dtype, compile=args.compile)
    if sys.stderr.isatty():  # a progress note, like a bar: only on a terminal
        print(f"loading {args.model} …", file=sys.stderr, flush=True)
    loaded = load_pretrained(args.model, tokenizer=args.tokenizer or None, base=args.base)
    model, tok = loaded.model, loaded.tokenizer
    layout = layout_of(model.config)
    if not layout.writes_text:
        raise ConfigError(f"{args.model} is an {layout.name} model ({model.config.arch}): it reads text but writes "
                          "none; generate needs a decoder or an encoder-decoder with an LM head")
    apply_quantize(model, args.quantize)  # (from the fp32 weights, before any cast)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    # frozen: only run, so its stacked q/k/v and gate/up weights are its storage, not a second copy
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    chat_source = None
    if args.chat:
        from ..generation.prompt import load_chat_template

        chat_source = load_chat_template(loaded.folders)
    add_bos = {"auto": None, "yes": True, "no": False}[args.bos]
    encoded = [prompt_ids(p, tok, model, chat_source=chat_source, system=_unescape(args.system),
                          add_bos=add_bos) for p in prompts]
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else tok.eos_id
    pad = tok.pad_id if tok.pad_id is not None else (eos if eos is not None else model.config.pad_token_id)
    stream = (len(prompts) == 1 and args.num_beams == 1 and args.num_return_sequences == 1 and not args.no_stream)
    options = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, do_sample=args.do_sample,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, num_beams=args.num_beams,
                   length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                   num_return_sequences=args.num_return_sequences, stop=[_unescape(s) for s in args.stop] or None,
                   eos_token_id=eos, pad_token_id=pad, tokenizer=tok, seed=args.seed, compile=args.compile)
    if args.compile:
        print("--compile: the first batch of each shape compiles the decoding step first (about a minute, "
              "seconds when cached)", file=sys.stderr)
    n = args.num_return_sequences
    results = []
    for start in range(0, len(prompts), args.batch_size):
        rows = encoded[start: start + args.batch_size]
        ids, mask = _pad(rows, left=not layout.encoder_decoder, device=device)  # decoders: left padding
        streamer = TextStreamer(tok) if stream else None
        out = generate(model, ids, mask, streamer=streamer, **options)
        if streamer is not None:
            streamer.end()
        new = layout.new_tokens(out, ids.shape[1])
        for i in range(len(rows)):
            texts = [_text(new[i * n + j].tolist(), tok, eos, pad) for j in range(n)]
            results.append({"prompt": prompts[start + i], "generated": texts})
            if stream:
                continue
            for j, text in enumerate(texts):
                head = f"[{start + i + 1}" + (f".{j + 1}" if n > 1 else "") + "]"
                print(f"{head} {prompts[start + i]}" if len(prompts) > 1 or n > 1 else prompts[start + i])
                print(text + "\n")
    if args.out:
        from .prompt import _write_jsonl

        _write_jsonl(results, args.out)
        print(f"wrote {len(results)} prompts' outputs to {args.out}", file=sys.stderr)
    return 0
