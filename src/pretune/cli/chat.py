"""``pretune chat MODEL``: a multi-turn chat in the terminal, streamed, through the server's engine (docs/serve.md)."""

from __future__ import annotations

import argparse

from .quantize import add_quantize_argument

CHAT_EPILOG = """commands while chatting: /reset (forget the conversation), /system TEXT (set the system message and
start over; /system alone removes it), /exit. Ctrl-C stops an answer as it streams.

examples:
  pretune chat runs/sft
  pretune chat SMOLLM2_DIR --system "You are a terse assistant." --temperature 0.7 --seed 1
"""


def add_chat_parser(sub) -> argparse.ArgumentParser:
    """Register ``chat`` (``func=cmd_chat``); returns its parser."""
    s = sub.add_parser("chat", help="chat with a model in the terminal (multi-turn, streamed)",
                       description="A multi-turn conversation with MODEL in the terminal, rendered with its chat "
                       "template and streamed, decoded by the same engine as pretune serve.",
                       epilog=CHAT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="model folder (any that pretune loads) or GGUF file")
    s.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    s.add_argument("--top-p", type=float, default=None, help="sampling: nucleus probability (default: off)")
    s.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="new tokens per answer at most (default: what the context leaves, up to 2048)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (turn i uses seed + i)")
    s.add_argument("--base", metavar="DIR", help="an adapter MODEL's base folder (default: the one it recorded)")
    add_quantize_argument(s)
    s.set_defaults(func=cmd_chat)
    return s


def cmd_chat(args) -> int:
    from ..config import ConfigError
    from ..serve import load_server
    from ..serve.chat import Conversation, chat_loop
    from ..serve.protocol import ApiError

    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature} must be >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens} must be >= 1")
    server = load_server(args.model, base=args.base, quantize=args.quantize)
    try:
        conv = Conversation(server, system=args.system, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    except ApiError as e:
        raise ConfigError(e.message) from None
    try:
        chat_loop(conv)
    finally:
        server.engine.close()
    return 0
