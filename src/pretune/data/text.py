"""Plain-text helpers shared by cleaning and the token store: sentence spans and word counts."""

from __future__ import annotations

import re

# a sentence ends at . ! ? (or …), optionally followed by closing quotes/brackets, then whitespace;
# a newline that ends a line with terminal punctuation also ends a sentence
_SENT_END = re.compile(r"""[.!?…]+["'”’)\]]*(?=\s+|$)""")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans (start, end) of the sentences of ``text``, whitespace excluded.

    A simple rule-based splitter (terminal punctuation followed by whitespace), good enough for
    NSP/SOP segments, BART sentence permutation and C4's "≥ 3 sentences" rule. Text without
    terminal punctuation is one sentence. The spans cover every non-space character in order.
    """
    spans: list[tuple[int, int]] = []
    pos = 0
    n = len(text)
    for m in _SENT_END.finditer(text):
        end = m.end()
        start = pos
        while start < end and text[start].isspace():
            start += 1
        if start < end:
            spans.append((start, end))
        pos = end
    start = pos
    while start < n and text[start].isspace():
        start += 1
    end = n
    while end > start and text[end - 1].isspace():
        end -= 1
    if start < end:
        spans.append((start, end))
    return spans


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` as strings (see :func:`sentence_spans`)."""
    return [text[s:e] for s, e in sentence_spans(text)]
