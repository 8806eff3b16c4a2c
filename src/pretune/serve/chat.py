"""``pretune chat MODEL``: a multi-turn conversation in the terminal, streamed, through the server's engine (the same
continuous-batching loop, chat template and text handling as ``pretune serve``, without HTTP).

Commands: ``/reset`` forgets the conversation, ``/system TEXT`` sets the system message (and starts over),
``/system`` alone removes it, ``/exit`` (or end of input) leaves. Ctrl-C while an answer streams stops it; the
part written so far stays in the conversation.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable

from ..generation.batching import Sequence
from ..generation.prompt import apply_chat_template
from .app import Choice, Server
from .protocol import ApiError

HELP = "/reset: forget the conversation · /system TEXT: set the system message · /exit: leave"


class Conversation:
    """A conversation with ``server``'s model: ``say(text, write)`` streams the answer to ``write`` and keeps both
    turns in ``history``."""

    def __init__(self, server: Server, *, system: str | None = None, temperature: float = 0.0,
                 top_p: float | None = None, max_tokens: int | None = None, seed: int | None = None):
        if server.engine is None:
            raise ApiError(400, f"{server.name} writes no text: pretune chat needs a decoder with an LM head")
        if server.chat_source is None:
            raise ApiError(400, f"{server.name} has no chat template (chat_template.jinja or tokenizer_config.json)")
        self.server, self.system = server, system
        self.temperature, self.top_p, self.max_tokens, self.seed = temperature, top_p, max_tokens, seed
        self.history: list[dict] = []
        self.turns = 0

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def say(self, text: str, write: Callable[[str], None]) -> str:
        """Answer ``text`` (streamed to ``write``); returns the answer. Raises ApiError when it does not fit."""
        server = self.server
        messages = self.messages() + [{"role": "user", "content": text}]
        ids = server.tok.encode(apply_chat_template(server.chat_source, messages))
        budget = server.budget(len(ids), self.max_tokens)
        events: queue.SimpleQueue = queue.SimpleQueue()
        choice = Choice(server, [])
        seed = None if self.seed is None else self.seed + self.turns  # each turn its own draw, reproducibly
        seq = Sequence(prompt=ids, max_new_tokens=budget, temperature=self.temperature, top_p=self.top_p, seed=seed,
                       stop_ids=server.eos, on_token=lambda s, t: events.put(t),
                       on_end=lambda s, reason: events.put(None))
        server.engine.submit(seq)
        try:
            while True:
                try:
                    token = events.get(timeout=0.1)  # (a timeout: Ctrl-C is seen at once)
                except queue.Empty:
                    continue
                if token is None:
                    break
                choice.ids.append(token.id)
                write(choice.delta())
        except KeyboardInterrupt:  # stop the answer; keep what was written
            seq.cancel()
        write(choice.last_delta())
        answer = choice.final_text()
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        self.turns += 1
        return answer

    def command(self, line: str) -> str | None:
        """Apply a /command; returns a note to show, or None for /exit."""
        name, _, rest = line.partition(" ")
        if name == "/reset":
            self.history = []
            return "(conversation reset)"
        if name == "/system":
            self.system = rest.strip() or None
            self.history = []
            return f"(system message {'set' if self.system else 'removed'}; conversation reset)"
        if name in ("/exit", "/quit"):
            return None
        return f"(unknown command {name}; {HELP})"


def chat_loop(conv: Conversation, *, read: Callable[[str], str] | None = None, out=None) -> None:
    """Read lines (``read(prompt)``, default ``input``) until /exit or end of input; answer each through ``conv``."""
    out = out or sys.stdout
    read = read or input

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write(f"chatting with {conv.server.name} ({HELP})\n")
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            note = conv.command(line)
            if note is None:
                return
            write(note + "\n")
            continue
        try:
            conv.say(line, write)
        except ApiError as e:
            write(f"({e.message})")
        write("\n")
