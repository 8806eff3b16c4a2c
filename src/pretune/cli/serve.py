"""``pretune serve MODEL``: the OpenAI HTTP API over one continuous-batching decoding loop (docs/serve.md)."""

from __future__ import annotations

import argparse
import textwrap

from .quantize import add_quantize_argument, check_quantize

SERVE_DESCRIPTION = (
    "Serve a model (a run folder, a pretune checkpoint, a Hugging Face folder, an adapter folder or a GGUF file) "
    "over the OpenAI HTTP API: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings "
    "(encoder models), GET /health. Every request joins one decoding loop (continuous batching); each request's "
    "tokens are what it gets alone. Binds 127.0.0.1 unless --host says otherwise; a host other machines can reach "
    "needs --api-key (or --insecure). Needs the serve extra: pip install 'pretune[serve]'.")
SERVE_EPILOG = r"""examples:
  pretune serve runs/sft                                        http://127.0.0.1:8000/v1
  pretune serve SMOLLM2_DIR --adapter spam=runs/lora-spam --max-batch 16
  pretune serve runs/sft --host 0.0.0.0 --api-key "$KEY"
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "sft", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}'
"""


def _adapter(value: str) -> tuple[str, str]:
    name, sep, folder = value.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=FOLDER")
    return name, folder


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` (``func=cmd_serve``); returns its parser."""
    s = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (continuous batching)",
                       description=textwrap.fill(SERVE_DESCRIPTION, 100), epilog=SERVE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="model folder (any that pretune loads) or GGUF file")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 requests")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without --api-key")
    s.add_argument("--adapter", action="append", type=_adapter, default=[], metavar="NAME=FOLDER",
                   help="an adapter folder served as model NAME (repeatable); requests pick it by 'model'")
    s.add_argument("--name", metavar="ID", help="the base model's id in /v1/models (default: the folder's name)")
    s.add_argument("--base", metavar="DIR", help="an adapter MODEL's base folder (default: the one it recorded)")
    s.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' dtype (default fp32)")
    add_quantize_argument(s)
    s.add_argument("--max-batch", type=int, default=16, metavar="N", help="rows decoded together (default 16)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for a row at most; more are answered 429 (default 64)")
    s.add_argument("--max-tokens-per-request", type=int, default=2048, metavar="N",
                   help="new tokens one choice may ask for (default 2048)")
    s.add_argument("--max-total-tokens", type=int, default=65536, metavar="N",
                   help="prompt + new tokens of all running rows; later requests wait (default 65536)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                   help="largest request body; larger ones get 413 (default 1 MiB)")
    s.set_defaults(func=cmd_serve)
    return s


def cmd_serve(args) -> int:
    from ..config import ConfigError
    from ..serve import check_exposure, run

    check_exposure(args.host, args.api_key, args.insecure)  # before loading anything
    for flag, value in (("--max-batch", args.max_batch), ("--max-tokens-per-request", args.max_tokens_per_request),
                        ("--max-total-tokens", args.max_total_tokens), ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue {args.max_queue} must be >= 0")
    names = [n for n, _ in args.adapter]
    if len(set(names)) != len(names):
        raise ConfigError(f"--adapter names must differ, got {names}")
    import torch

    from ..serve.app import Limits

    limits = Limits(max_batch=args.max_batch, max_queue=args.max_queue, max_request_tokens=args.max_tokens_per_request,
                    max_total_tokens=args.max_total_tokens, max_body_bytes=args.max_body_bytes)
    check_quantize(args.quantize, dtype=args.dtype, served=True)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    run(args.model, host=args.host, port=args.port, api_key=args.api_key, insecure=args.insecure,
        adapters=dict(args.adapter), name=args.name, limits=limits, base=args.base, dtype=dtype,
        quantize=args.quantize)
    return 0
