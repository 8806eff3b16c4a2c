"""C4-style cleaning of documents ("pages"), each rule switchable, with a report of what each rule removed.

The rules follow the Colossal Clean Crawled Corpus (Raffel et al. 2019, §2.2). A page goes through
them in this order, and each removal is counted under the first rule that removed it:

1. (``unwrap``) hard-wrapped paragraphs become one logical line each, so the line rules see the
   logical lines a web page would have (novels from Project Gutenberg wrap at ~70 columns);
2. line rules, per logical line: strip citation markers, drop lines mentioning "javascript",
   drop policy boilerplate, keep lines ending in terminal punctuation, keep lines with >= 5 words;
3. page rules, on the lines left: drop pages with "lorem ipsum", with "{", with a bad word,
   with fewer than 3 sentences;
4. dedup: remove every three-sentence span that occurred earlier in the data set (the first
   occurrence stays), then drop the page if too few sentences are left.

A cleaned page is its kept lines joined with "\\n" (no blank lines inside).

    report = CleanReport()
    for page in clean_documents(iter_documents("corpus/"), CleanConfig(), report):
        ...
    print(report.format())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pretune.data.readers import DataError, DocSplit, Errors, Sources, expand_sources, iter_documents
from pretune.data.text import sentence_spans
from pretune.io.progress import progress

# rule names, in the order they run; report keys; each is a CleanConfig switch
LINE_RULES = ("strip_citations", "drop_javascript", "drop_policy", "require_terminal_punct", "require_min_words")
PAGE_RULES = ("drop_lorem_ipsum", "drop_curly_brace", "drop_bad_words", "require_min_sentences")
RULES = LINE_RULES + PAGE_RULES + ("dedup",)
EMPTY = "empty"  # report key: pages left with no line by the line rules (those lines count under the line rules)

# C4 keeps lines ending in . ? ! " ; we add the closing quotes of typeset text and the ellipsis
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "\u201d", "\u2019", "\u00bb", "\u2026")
# C4's citation pattern (Wikipedia's [1], [12], [edit], [citation needed]); the space before goes too
_CITATION = re.compile(r"\s*\[(?:\d+|edit|citation needed)\]", re.IGNORECASE)
POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_CONTINUATION = (",", ";", ":", "-", "\u2013", "\u2014")  # a line ending so goes on (unwrap)
_WRAP_FILL = 0.75  # in a hard-wrapped paragraph every line but the last fills >= 75% of the widest (menus don't)
_WRAP_MIN_WIDTH = 40  # nobody hard-wraps prose narrower; short lines are headings, menus, verse
_DASHES = ("-", "\u2013", "\u2014")
_OPENERS = "\"'\u201c\u2018([\u00ab"
_WORD = re.compile(r"\w+")
DEDUP_SPAN = 3  # sentences per hashed span (C4: "any three-sentence span")

# A short built-in list of unambiguous English obscenities and explicit sexual terms. Words with an
# innocent sense in books (dick, ass, cock, bastard, whore, tit, ...) are left out on purpose; for
# C4's behaviour pass the full LDNOOBW list (github.com/LDNOOBW, file "en") as bad_words_file.
BUILTIN_BAD_WORDS = (
    "fuck", "fucks", "fucked", "fucker", "fuckers", "fucking", "fuckin", "motherfucker", "motherfuckers",
    "motherfucking", "fuckwit", "shit", "shits", "shitty", "shitting", "bullshit", "horseshit", "cunt", "cunts",
    "asshole", "assholes", "arsehole", "arseholes", "dickhead", "dickheads", "wanker", "wankers", "twat", "twats",
    "cocksucker", "cocksuckers", "jizz", "cumshot", "cumshots", "blowjob", "blowjobs", "handjob", "handjobs",
    "rimjob", "dildo", "dildos", "porn", "porno", "pornhub", "slut", "sluts", "slutty", "clit", "gangbang",
)


@dataclass
class CleanConfig:
    """Which cleaning rules run (all by default) and their thresholds."""

    unwrap: bool = True  # join each hard-wrapped paragraph into one line before the line rules (see logical_lines)
    unwrap_max_width: int = 100  # widest line a hard-wrapped paragraph may have (Gutenberg wraps at ~70-75)
    strip_citations: bool = True  # delete markers [1], [12], [edit], [citation needed]; a line left empty goes
    drop_javascript: bool = True  # drop lines containing "javascript" (C4: "please enable JavaScript" nags)
    drop_policy: bool = True  # drop lines with policy boilerplate ("terms of use", "privacy policy", cookies)
    require_terminal_punct: bool = True  # keep only lines ending in . ! ? or a closing quote (no menus, headings)
    require_min_words: bool = True  # keep only lines with >= min_words whitespace-separated words
    min_words: int = 5  # C4: 5; higher drops more short dialogue lines
    drop_lorem_ipsum: bool = True  # drop pages containing "lorem ipsum" (placeholder text)
    drop_curly_brace: bool = True  # drop pages containing "{" (code; C4) -- also pages quoting LaTeX or templates
    drop_bad_words: bool = True  # drop pages with a word or phrase of the bad-words list (whole words, any case)
    bad_words_file: str | None = None  # word list replacing the built-in one: a word/phrase a line, e.g. LDNOOBW "en"
    require_min_sentences: bool = True  # drop pages with fewer than min_sentences sentences (after the line rules)
    min_sentences: int = 3  # C4: 3; sentences as pretune.data.text.sentence_spans counts them
    dedup: bool = True  # remove 3-sentence spans seen earlier in the data set (first kept); memory grows with data

    def __post_init__(self) -> None:
        for name in ("unwrap_max_width", "min_words", "min_sentences"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CleanConfig.{name} ({value!r}) must be an integer >= 1")


@dataclass
class CleanReport:
    """What the cleaner saw and removed. ``pages_removed[rule]``: pages the rule removed;
    ``lines_removed[rule]``: logical lines it removed (for a page rule: the lines of the pages it
    removed; for dedup: lines whose every sentence was a duplicate, plus the lines of pages dropped
    after dedup), so ``lines_in == lines_out + sum(lines_removed.values())``. Lines are logical lines
    (after unwrapping), not counting blank ones."""

    pages_in: int = 0
    pages_out: int = 0
    lines_in: int = 0
    lines_out: int = 0
    chars_in: int = 0  # characters of the input pages
    chars_out: int = 0  # characters of the output pages
    citations_stripped: int = 0  # citation markers deleted (lines kept unless left empty)
    sentences_deduped: int = 0  # sentences removed by dedup
    pages_removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES + (EMPTY,), 0))
    lines_removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))

    def to_dict(self) -> dict:
        """The report as plain data (for JSON)."""
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A readable table: for each rule the pages and lines it removed, then what was kept."""
        def pct(part: int, whole: int) -> str:
            return f"{100 * part / whole:.1f}%" if whole else "-"

        rows = [("in", f"{self.pages_in:,}", f"{self.lines_in:,}")]
        for rule in RULES + (EMPTY,):
            pages = self.pages_removed.get(rule, 0)
            lines = self.lines_removed.get(rule)
            rows.append((f"- {rule}", f"{pages:,}", "-" if lines is None else f"{lines:,}"))
        rows.append(("out", f"{self.pages_out:,}", f"{self.lines_out:,}"))
        rows.append(("kept", pct(self.pages_out, self.pages_in), pct(self.lines_out, self.lines_in)))
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':{width}}  {'pages':>12}  {'lines':>12}"]
        lines += [f"{name:{width}}  {p:>12}  {ln:>12}" for name, p, ln in rows]
        lines.append(f"chars: {self.chars_in:,} in, {self.chars_out:,} out ({pct(self.chars_out, self.chars_in)} "
                     f"kept); {self.citations_stripped:,} citation markers stripped, "
                     f"{self.sentences_deduped:,} duplicate sentences removed")
        return "\n".join(lines)


@dataclass
class DedupState:
    """Hashes of every three-sentence span seen so far in the data set (8 bytes of BLAKE2b of the
    normalised sentences each; a Python set costs ~70 bytes per span, so ~7 GB per 100M sentences)."""

    seen: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.seen)


# ------------------------------------------------------------------------------------ line rules


def ends_in_terminal_punct(line: str) -> bool:
    """Whether ``line`` (trailing spaces ignored) ends in . ! ? or a closing quote/ellipsis."""
    return line.rstrip().endswith(TERMINAL_PUNCT)


def _is_hard_wrapped(para: list[str], max_width: int) -> bool:
    width = max(len(line) for line in para)
    return (len(para) >= 2 and _WRAP_MIN_WIDTH <= width <= max_width
            and all(len(line) >= _WRAP_FILL * width for line in para[:-1])
            and not all(ends_in_terminal_punct(line) for line in para[:-1]))


def _join(left: str, right: str) -> str:
    glued = left.endswith(_DASHES) and not left[:-1].endswith(" ")  # "self-\ndenying" -> "self-denying"
    return left + ("" if glued else " ") + right


def _join_continued(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith(_CONTINUATION) and (line[0].isalnum() or line[0] in _OPENERS):
            out[-1] = _join(out[-1], line)
        else:
            out.append(line)
    return out


def logical_lines(text: str, cfg: CleanConfig) -> list[str]:
    """The non-blank lines of ``text``, stripped, as the line rules see them.

    With ``cfg.unwrap``, lines are joined (single spaces; none after a dash ending a word):

    - a paragraph (lines between blank lines) that looks hard-wrapped becomes one line: it has >= 2
      lines, the longest 40 to ``cfg.unwrap_max_width`` characters long, every line but the last at least
      3/4 as long as the longest, and some line before the last not ending in terminal punctuation.
      So sentence-per-line text keeps its lines, paragraph-per-line text (Wikipedia dumps) has
      lines too wide to count as wrapped, and a short menu item or heading is never glued to prose;
    - in any other paragraph, a line ending in , ; : or a dash continues onto the next line if that
      starts with a letter, digit, opening quote or bracket (a sentence running over several
      Bible verses), but not onto a list item, heading or table row.
    """
    out: list[str] = []
    para: list[str] = []
    for raw in text.split("\n") + [""]:
        line = raw.rstrip()
        if line:
            para.append(line)
            continue
        if not para:
            continue
        if not cfg.unwrap:
            out.extend(p.strip() for p in para)
        elif _is_hard_wrapped(para, cfg.unwrap_max_width):
            joined = para[0].strip()
            for p in para[1:]:
                joined = _join(joined, p.strip())
            out.append(joined)
        else:
            out.extend(_join_continued([p.strip() for p in para]))
        para = []
    return out


def _line_rule(line: str, cfg: CleanConfig) -> str | None:
    """The first line rule (after citation stripping) that removes ``line``, or None."""
    lower = line.lower()
    if cfg.drop_javascript and "javascript" in lower:
        return "drop_javascript"
    if cfg.drop_policy and any(p in lower for p in POLICY_PHRASES):
        return "drop_policy"
    if cfg.require_terminal_punct and not ends_in_terminal_punct(line):
        return "require_terminal_punct"
    if cfg.require_min_words and len(line.split()) < cfg.min_words:
        return "require_min_words"
    return None


# ------------------------------------------------------------------------------------ page rules


@dataclass(frozen=True)
class BadWords:
    """A bad-words list as a matcher: :meth:`find` returns the first entry found in a text (whole
    words, any case) or None."""

    words: frozenset[str]  # entries that are one \w+ token, lower case
    phrases: re.Pattern | None  # the other entries (several words, or symbols), as whole words

    def find(self, text: str) -> str | None:
        lower = text.lower()
        for token in _WORD.findall(lower):
            if token in self.words:
                return token
        m = self.phrases.search(lower) if self.phrases is not None else None
        return m.group(0) if m else None


@functools.lru_cache(maxsize=8)
def load_bad_words(path: str | None = None) -> BadWords:
    """The bad-words matcher for ``path`` (one word or phrase per line, blank lines and "#" comments
    skipped) or, for None, the built-in list. Cached per path."""
    if path is None:
        entries = list(BUILTIN_BAD_WORDS)
    else:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"bad_words_file {path!r}: no such file; expected a text file with one "
                                    f"word or phrase per line (e.g. LDNOOBW's 'en')")
        with open(path, encoding="utf-8") as f:
            entries = [s.strip() for s in f if s.strip() and not s.lstrip().startswith("#")]
        if not entries:
            raise DataError(f"{path}: bad-words file has no entries; expected one word or phrase per line")
    words = {e.lower() for e in entries if _WORD.fullmatch(e)}
    others = [e.lower().split() for e in entries if not _WORD.fullmatch(e)]
    phrases = None
    if others:
        alternatives = sorted((r"\s+".join(map(re.escape, parts)) for parts in others), key=len, reverse=True)
        phrases = re.compile(rf"(?<!\w)(?:{'|'.join(alternatives)})(?!\w)")
    return BadWords(frozenset(words), phrases)


def count_sentences(lines: list[str]) -> int:
    """Sentences in ``lines`` (each line has at least one; see pretune.data.text.sentence_spans)."""
    return sum(len(sentence_spans(line)) for line in lines)


def _page_rule(lines: list[str], cfg: CleanConfig) -> str | None:
    """The first page rule that removes the page made of ``lines``, or None."""
    page = "\n".join(lines)
    if cfg.drop_lorem_ipsum and "lorem ipsum" in page.lower():
        return "drop_lorem_ipsum"
    if cfg.drop_curly_brace and "{" in page:
        return "drop_curly_brace"
    if cfg.drop_bad_words and load_bad_words(cfg.bad_words_file).find(page) is not None:
        return "drop_bad_words"
    if cfg.require_min_sentences and count_sentences(lines) < cfg.min_sentences:
        return "require_min_sentences"
    return None


# ----------------------------------------------------------------------------------------- dedup


def _span_hash(normalised: list[str]) -> int:
    digest = hashlib.blake2b("\n".join(normalised).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _dedup(lines: list[str], state: DedupState, report: CleanReport) -> list[str]:
    """``lines`` without the sentences of every three-sentence span seen before: in an earlier page,
    or earlier in this page without overlapping it (so "A. A. A. A." stays, "A. A. A. A. A. A." loses
    its second half). Spans run across line boundaries. Adds this page's spans to ``state``."""
    sents = [(i, s, e) for i, line in enumerate(lines) for s, e in sentence_spans(line)]
    keys = [" ".join(lines[i][s:e].lower().split()) for i, s, e in sents]
    drop = [False] * len(sents)
    first_here: dict[int, int] = {}  # span hash -> first start in this page
    for j in range(len(sents) - DEDUP_SPAN + 1):
        h = _span_hash(keys[j : j + DEDUP_SPAN])
        if h in state.seen or (h in first_here and first_here[h] + DEDUP_SPAN <= j):
            drop[j : j + DEDUP_SPAN] = [True] * DEDUP_SPAN
        else:
            first_here.setdefault(h, j)
    state.seen.update(first_here)
    if not any(drop):
        return lines
    report.sentences_deduped += sum(drop)
    kept: list[list[str]] = [[] for _ in lines]
    for (i, s, e), d in zip(sents, drop):
        if not d:
            kept[i].append(lines[i][s:e])
    out = [" ".join(parts) for parts in kept if parts]
    report.lines_removed["dedup"] += len(lines) - len(out)
    return out


# ------------------------------------------------------------------------------------------ api


def clean_document(text: str, cfg: CleanConfig, report: CleanReport, state: DedupState | None) -> str | None:
    """Clean one page.

    Args:
        text: the page (lines separated by "\\n"; blank lines separate paragraphs).
        cfg: which rules run.
        report: updated in place with what was seen and removed.
        state: the spans seen so far in the data set (updated); None (or ``cfg.dedup`` False): no dedup.

    Returns:
        The kept logical lines joined with "\\n", or None if the page was removed.
    """
    report.pages_in += 1
    report.chars_in += len(text)
    lines = logical_lines(text, cfg)
    report.lines_in += len(lines)
    kept: list[str] = []
    for line in lines:
        rule = None
        if cfg.strip_citations:
            line, n = _CITATION.subn("", line)
            if n:
                report.citations_stripped += n
                line = line.strip()
                rule = None if line else "strip_citations"
        rule = rule or _line_rule(line, cfg)
        if rule is None:
            kept.append(line)
        else:
            report.lines_removed[rule] += 1
    if not kept:
        report.pages_removed[EMPTY] += 1
        return None
    rule = _page_rule(kept, cfg)
    if rule is None and cfg.dedup and state is not None:
        kept = _dedup(kept, state, report)
        if not kept or (cfg.require_min_sentences and count_sentences(kept) < cfg.min_sentences):
            rule = "dedup"
    if rule is not None:
        report.pages_removed[rule] += 1
        report.lines_removed[rule] += len(kept)
        return None
    page = "\n".join(kept)
    report.pages_out += 1
    report.lines_out += len(kept)
    report.chars_out += len(page)
    return page


def clean_documents(docs: Iterable[str], cfg: CleanConfig, report: CleanReport | None = None) -> Iterator[str]:
    """The cleaned pages of ``docs`` (removed ones skipped), streamed, with one dedup state for all.

    Args:
        docs: the pages, e.g. from :func:`pretune.data.readers.iter_documents`.
        cfg: which rules run.
        report: updated in place as pages go through (pass one to read it afterwards).
    """
    report = CleanReport() if report is None else report
    state = DedupState() if cfg.dedup else None
    for doc in docs:
        page = clean_document(doc, cfg, report, state)
        if page is not None:
            yield page


_OUTPUT_EXTS = (".jsonl", ".jsonl.gz", ".txt", ".txt.gz")


@contextlib.contextmanager
def _open_text_output(path: Path, compressed: bool) -> Iterator[IO[str]]:
    with open(path, "wb") as raw:
        if not compressed:
            with io.TextIOWrapper(raw, encoding="utf-8", newline="\n") as f:
                yield f
            return
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:  # mtime 0: same bytes every run
            with io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as f:
                yield f


def clean_files(sources: Sources, out: str | Path, cfg: CleanConfig, *, field: str = "text",
                doc_split: DocSplit = "blank_line", errors: Errors = "strict",
                show_progress: bool = True) -> CleanReport:
    """Read documents (:func:`~pretune.data.readers.iter_documents`), clean them, write the kept ones.

    Args:
        sources: files, folders or globs (see :func:`~pretune.data.readers.expand_sources`).
        out: ``.jsonl`` / ``.jsonl.gz`` (one ``{"text": page}`` per line) or ``.txt`` / ``.txt.gz``
            (pages separated by a blank line; pages hold no blank lines, so reading it back with
            ``doc_split="blank_line"`` gives the same pages). Written to a temporary file beside it
            and renamed at the end: ``out`` is never half-written.
        cfg: which rules run.
        field, doc_split, errors: passed to ``iter_documents``.
        show_progress: a progress bar over input documents.

    Returns:
        The report (``report.format()`` prints it).
    """
    out = Path(out)
    name = out.name.lower()
    ext = next((e for e in sorted(_OUTPUT_EXTS, key=len, reverse=True) if name.endswith(e)), None)
    if ext is None:
        raise ValueError(f"output {str(out)!r}: unknown file type; expected a name ending in {', '.join(_OUTPUT_EXTS)}")
    as_jsonl = ext.startswith(".jsonl")
    paths = expand_sources(sources)  # a bad source fails here, before any output exists
    report = CleanReport()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with _open_text_output(tmp, ext.endswith(".gz")) as f, progress(
            iter_documents(paths, field=field, doc_split=doc_split, errors=errors),
            desc="clean", unit="doc", disable=not show_progress, mininterval=0.5,
        ) as docs:
            for i, page in enumerate(clean_documents(docs, cfg, report)):
                if as_jsonl:
                    f.write(json.dumps({"text": page}, ensure_ascii=False) + "\n")
                else:
                    f.write(("\n" if i else "") + page + "\n")
                if i % 1000 == 0:
                    docs.set_postfix(kept=f"{report.pages_out:,}/{report.pages_in:,}", refresh=False)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return report
