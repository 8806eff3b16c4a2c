"""Prompting without training, the text side: templates with a label slot, verbalizers (label -> word),
few-shot example selection and order, prompt assembly, chat templates, chain-of-thought answer
extraction and the self-consistency vote. The model side (label-word scoring, sampling reasoning paths)
is in ``scoring.py``.

    template = PromptTemplate("Message: {text}\\nSpam or not? Answer: {label}")
    verbalizer = Verbalizer.parse("ham=no,spam=yes")
    train = read_records("train.jsonl")
    shots = select_shots(train, 4, seed=0, balanced=True, labels=verbalizer.labels)   # order="shuffle"
    prompt = FewShotPrompt(template, shots=shots, targets=[verbalizer.word_of(s) for s in shots])
    prompt.prefix()            # "Message: ...\\nSpam or not? Answer: no\\n\\nMessage: ...: yes\\n\\n"
    prompt.template.context(rec)   # ("Message: <text>\\nSpam or not? Answer:", " ")  the query and the gap

A template names record fields as ``{field}`` placeholders plus one *slot* (``{label}`` by default) where
the answer goes: the verbalizer's word in a demonstration, the text the model is scored on (or generates)
in the query. A template without the slot gets `` {label}`` appended. What precedes the slot is the
query's context; its trailing whitespace (the *gap*) is moved to the front of the answer, as
lm-evaluation-harness does, so that byte-level BPE sees `` spam`` (one token) rather than a lone space.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from ..config import ConfigError
from ..data.readers import DataError
from ..data.records import Record, get_field

__all__ = ["ORDERS", "ChatTemplate", "FewShotPrompt", "PromptError", "PromptTemplate", "Verbalizer", "Vote",
           "apply_chat_template", "extract_answer", "load_chat_template", "majority_vote", "normalize_answer",
           "random_labels", "select_shots", "self_consistency", "SelfConsistency"]

Order = Literal["shuffle", "file", "interleave"]
ORDERS: tuple[str, ...] = ("shuffle", "file", "interleave")


class PromptError(ConfigError):
    """A bad template, verbalizer, shot selection or chat template; the message names it."""


# ------------------------------------------------------------------------------------------ templates
class PromptTemplate:
    """A prompt template: ``{field}`` placeholders filled from a record, and one answer slot.

    Args:
        text: the template, Python ``str.format`` syntax with plain names only (``{{``/``}}`` are literal
            braces), e.g. ``"Review: {text}\\nSentiment: {label}"``.
        slot: the placeholder where the answer goes (``label`` for classification; the shots' worked
            solution field for chain-of-thought). Absent from ``text``: `` {slot}`` is appended.
        name: what error messages call the template (e.g. ``--template``).
    """

    def __init__(self, text: str, *, slot: str = "label", name: str = "template"):
        if not isinstance(text, str) or not text.strip():
            raise PromptError(f"the {name} is empty; expected text with placeholders such as {{text}}")
        self.name, self.slot = name, slot
        names = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as e:  # a lone '{' or '}'
            raise PromptError(f"the {name} {text!r} is not a valid template ({e}); write literal braces as "
                              "{{ and }}") from None
        for _, fname, spec, conv in parsed:
            if fname is None:
                continue
            if not fname.isidentifier() or spec or conv:
                raise PromptError(f"the {name} {text!r} has the placeholder {{{fname}{'!' + conv if conv else ''}"
                                  f"{':' + spec if spec else ''}}}; placeholders are plain field names like "
                                  "{text}")
            names.append(fname)
        if names.count(slot) > 1:
            raise PromptError(f"the {name} {text!r} has the answer slot {{{slot}}} {names.count(slot)} times; "
                              "it takes one")
        self.fields: list[str] = list(dict.fromkeys(n for n in names if n != slot))  # record fields, in order
        if not self.fields:
            raise PromptError(f"the {name} {text!r} has no input placeholder (such as {{text}}): every prompt would "
                              "be the same text")
        self.text = text if slot in names else text + " {" + slot + "}"

    def __repr__(self) -> str:
        return f"PromptTemplate({self.text!r}, slot={self.slot!r})"

    def check(self, rec: Record, *, what: str = "") -> None:
        """Raise a DataError naming the template and the field when ``rec`` lacks a placeholder's field."""
        for f in self.fields:
            if f not in rec.data or rec.data[f] is None:
                have = ", ".join(sorted(map(str, rec.data))) or "none"
                raise DataError(f"{rec.where}: the {self.name} {self.text!r} uses the placeholder {{{f}}}, but the "
                                f"{what or 'record'} has no field {f!r} (it has: {have})")

    def _values(self, rec: Record) -> dict[str, str]:
        self.check(rec)
        return {f: str(get_field(rec, f, (str, int, float))) for f in self.fields}

    def render(self, rec: Record, answer: str) -> str:
        """The whole template for ``rec`` with ``answer`` in the slot (a demonstration)."""
        return self.text.format_map({**self._values(rec), self.slot: answer})

    def context(self, rec: Record) -> tuple[str, str]:
        """``(context, gap)``: the text before the slot without its trailing whitespace, and that whitespace
        (which belongs in front of the answer: the query's continuation is ``gap + answer``)."""
        marker = "\x00slot\x00"
        before = self.text.format_map({**self._values(rec), self.slot: marker}).split(marker)[0]
        ctx = before.rstrip()
        return ctx, before[len(ctx):]


# ---------------------------------------------------------------------------------------- verbalizer
class Verbalizer:
    """Label -> word map (``{"ham": "no", "spam": "yes"}``); the label order is the score column order.

    Words may span several tokens ("not spam"): their log-probabilities are summed (or averaged).
    """

    def __init__(self, words: Mapping[Any, Any]):
        if not words:
            raise PromptError("the label set is empty: give label=word pairs, e.g. --labels 'ham=no,spam=yes'")
        self.words: dict[str, str] = {}
        for label, word in words.items():
            label, word = str(label).strip(), str(word)
            if not label or not word.strip():
                raise PromptError(f"label {label!r} -> word {word!r}: labels and words must be non-empty")
            if label in self.words:
                raise PromptError(f"label {label!r} appears twice in the verbalizer")
            self.words[label] = word.strip()
        seen = Counter(self.words.values())
        if dup := [w for w, n in seen.items() if n > 1]:
            raise PromptError(f"the word {dup[0]!r} stands for several labels "
                              f"({', '.join(k for k, v in self.words.items() if v == dup[0])}); they could never be "
                              "told apart")
        if len(self.words) < 2:
            raise PromptError(f"the verbalizer has one label ({next(iter(self.words))!r}); classification needs two "
                              "or more")

    @property
    def labels(self) -> list[str]:
        return list(self.words)

    def __repr__(self) -> str:
        return f"Verbalizer({self.words})"

    @classmethod
    def parse(cls, spec: str) -> Verbalizer:
        """``"ham=not spam,spam=spam"`` (label=word, comma separated); a bare ``"positive,negative"`` uses
        each label as its own word."""
        pairs: dict[str, str] = {}
        for item in (s for s in spec.split(",") if s.strip()):
            label, eq, word = item.partition("=")
            label = label.strip()
            if label in pairs:
                raise PromptError(f"label {label!r} appears twice in {spec!r}")
            pairs[label] = word if eq else label
        return cls(pairs)

    @classmethod
    def load(cls, path: str | Path) -> Verbalizer:
        """A verbalizer file: a JSON object ``{"label": "word", ...}`` or lines ``label=word`` / ``label<TAB>word``
        (``#`` starts a comment)."""
        path = Path(path)
        if not path.is_file():
            raise PromptError(f"verbalizer file {str(path)!r} does not exist")
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}: not valid JSON ({e})") from None
            return cls(data)
        pairs: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            sep = "\t" if "\t" in line else "="
            label, found, word = line.partition(sep)
            if not found:
                raise PromptError(f"{path}:{n}: expected label=word or label<TAB>word, got {line!r}")
            if label.strip() in pairs:
                raise PromptError(f"{path}:{n}: label {label.strip()!r} appears twice")
            pairs[label.strip()] = word
        return cls(pairs)

    def word_of(self, rec: Record, label_field: str = "label") -> str:
        """The word of a record's label; a DataError names the record when the label has no word."""
        return self.words[self.label_of(rec, label_field)]

    def label_of(self, rec: Record, label_field: str = "label") -> str:
        """A record's gold label, checked against the label set."""
        label = str(get_field(rec, label_field, (str, int, float, bool), what="the gold label")).strip()
        if label not in self.words:
            raise DataError(f"{rec.where}: label {label!r} is not in the verbalizer's label set {self.labels}")
        return label


# --------------------------------------------------------------------------------------------- shots
def select_shots(records: Sequence[Record], k: int, *, seed: int = 0, label_field: str = "label",
                 labels: Sequence[str] | None = None, balanced: bool = False, order: Order = "shuffle",
                 order_seed: int | None = None, ids: Sequence[int] | None = None) -> list[Record]:
    """Pick ``k`` demonstrations from labelled records and put them in order.

    Args:
        records: the pool (e.g. ``read_records("train.jsonl")``).
        k: how many examples; 0 gives zero-shot.
        seed: which examples are drawn (``random.Random(seed)``).
        label_field: the records' label field (used by ``balanced``, ``interleave`` and ``labels``).
        labels: when given, only records with these labels are eligible (the verbalizer's label set),
            and this is the label order of ``balanced`` and ``interleave``; else the sorted labels found.
        balanced: ``k // n_labels`` examples per label; the ``k % n_labels`` left over go to labels drawn
            with ``seed``. Off: a uniform draw, so the shots follow the pool's label distribution.
        order: ``"shuffle"``: the drawn examples, sorted by file position, then shuffled with ``order_seed``
            (the same examples in a different order for another ``order_seed``); ``"file"``: file order;
            ``"interleave"``: labels alternate (in ``labels`` order), each label's examples in file order.
        order_seed: the shuffle's seed (default: ``seed``).
        ids: exact rows instead of a draw (0-based positions in ``records``), used in the order given;
            ``seed``, ``balanced`` and ``order`` do not apply.
    Returns:
        The demonstrations, in prompt order.
    """
    if k < 0:
        raise PromptError(f"shots={k} must be >= 0")
    if order not in ORDERS:
        raise PromptError(f"order={order!r} is not one of {', '.join(ORDERS)}")
    if ids is not None:
        bad = [i for i in ids if not 0 <= i < len(records)]
        if bad:
            raise PromptError(f"shot ids {bad} are outside the {len(records)} records (0-based rows)")
        return [records[i] for i in ids]
    if k == 0:
        return []

    def label(i: int) -> str:
        return str(get_field(records[i], label_field, (str, int, float, bool), what="label of a shot")).strip()

    pool = list(range(len(records)))
    if labels is not None:
        allowed = {str(x) for x in labels}
        pool = [i for i in pool if label(i) in allowed]
    by_label: dict[str, list[int]] = {}
    for i in pool:
        by_label.setdefault(label(i), []).append(i)
    label_order = [str(x) for x in labels if str(x) in by_label] if labels is not None else sorted(by_label)
    where = records[0].where.rsplit(":", 1)[0] if records else "the shots file"
    if k > len(pool):
        raise PromptError(f"shots={k} but {where} has only {len(pool)} usable examples")
    rng = random.Random(seed)
    if balanced:
        if labels is not None and (missing := [x for x in labels if str(x) not in by_label]):
            raise PromptError(f"balanced shots need every label, but {where} has no example of {missing}")
        per = {lab: k // len(label_order) for lab in label_order}
        for lab in rng.sample(label_order, k % len(label_order)):
            per[lab] += 1
        chosen = []
        for lab in label_order:
            if per[lab] > len(by_label[lab]):
                raise PromptError(f"balanced shots need {per[lab]} examples of {lab!r}, {where} has "
                                  f"{len(by_label[lab])}")
            chosen += rng.sample(by_label[lab], per[lab])
    else:
        chosen = rng.sample(pool, k)
    chosen.sort()  # file order: the canonical order the shuffle starts from
    if order == "shuffle":
        random.Random(seed if order_seed is None else order_seed).shuffle(chosen)
    elif order == "interleave":
        queues = [[i for i in chosen if label(i) == lab] for lab in label_order]
        chosen = [q[j] for j in range(max(map(len, queues), default=0)) for q in queues if j < len(q)]
    return [records[i] for i in chosen]


def random_labels(k: int, labels: Sequence[str], *, seed: int = 0) -> list[str]:
    """``k`` labels drawn uniformly at random, with replacement, from ``labels``: the labels of random-label
    demonstrations (Min et al. 2022, "Rethinking the Role of Demonstrations", §4.1: each demonstration keeps its
    input and gets a label sampled uniformly from the label set, so some are right by chance).

    Args:
        k: how many (one per demonstration, in prompt order).
        labels: the label set (e.g. ``verbalizer.labels``).
        seed: ``random.Random(seed)``; the same seed draws the same labels.
    """
    if not labels:
        raise PromptError("random labels need a label set; it is empty")
    rng = random.Random(seed)
    return [str(rng.choice(list(labels))) for _ in range(k)]


@dataclass
class FewShotPrompt:
    """Instruction + demonstrations + query, joined by ``sep``.

    ``prefix(n)`` is the text shared by every query (instruction and the last ``n`` shots, ending in ``sep``);
    the query is ``template.context(rec)``. Dropping shots to fit a context window drops the first ones, so
    the examples nearest the query stay.
    """

    template: PromptTemplate
    shots: list[Record] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # what fills each shot's slot (label word, worked solution)
    instruction: str = ""  # text before the shots, e.g. "Classify each SMS as spam or not."
    sep: str = "\n\n"  # between instruction, shots and query

    def __post_init__(self):
        if len(self.shots) != len(self.targets):
            raise PromptError(f"{len(self.shots)} shots but {len(self.targets)} targets")
        for s in self.shots:
            self.template.check(s, what="shot")

    def prefix(self, n_shots: int | None = None) -> str:
        """The shared text before the query: instruction and the last ``n_shots`` demonstrations."""
        n = len(self.shots) if n_shots is None else n_shots
        start = len(self.shots) - n
        parts = [self.instruction] if self.instruction else []
        parts += [self.template.render(s, t) for s, t in zip(self.shots[start:], self.targets[start:])]
        return "".join(p + self.sep for p in parts)

    def text(self, rec: Record, answer: str = "", n_shots: int | None = None) -> str:
        """The whole prompt for ``rec`` as one string (context, then ``gap + answer`` when an answer is given)."""
        ctx, gap = self.template.context(rec)
        return self.prefix(n_shots) + ctx + (gap + answer if answer else "")


# ------------------------------------------------------------------------------------- chat templates
@dataclass
class ChatTemplate:
    """A Jinja chat template and the special-token strings it may use (``bos_token``, ``eos_token``, ...)."""

    template: str
    special_tokens: dict[str, Any] = field(default_factory=dict)
    source: str = ""


_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise PromptError(f"{file}: not a readable JSON file ({e})") from None
    return data if isinstance(data, dict) else {}


def _special_token_strings(folder: Path) -> dict[str, Any]:
    """The special tokens a template sees, as transformers' ``special_tokens_map`` holds them."""
    out: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's values win
        if not (folder / name).is_file():
            continue
        data = _read_json(folder / name)
        for key in _TOKEN_KEYS:
            value = data.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        extra = data.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return out


def load_chat_template(source: str | Path | Sequence[str | Path], name: str | None = None) -> ChatTemplate:
    """The chat template of a Hugging Face model or tokenizer folder (or of the folder of a tokenizer.json).

    Looked for, as transformers does: ``chat_template.jinja`` (plus named ones in
    ``additional_chat_templates/*.jinja``), else ``chat_template.json``, else ``tokenizer_config.json``'s
    ``"chat_template"`` (a string, or a list of ``{"name", "template"}``). ``name`` picks a named template
    (default: ``"default"``). A list of folders (``Pretrained.folders``: a tokenizer given explicitly, the model
    folder, an adapter's base) is searched in order; the first that has a template is used.
    """
    if not isinstance(source, (str, Path)):
        folders = list(source)
        for i, f in enumerate(folders):
            try:
                return load_chat_template(f, name)
            except PromptError:
                if i == len(folders) - 1:
                    raise
        raise PromptError("no folder to look for a chat template in")
    folder = Path(source).expanduser()
    folder = folder.parent if folder.is_file() else folder
    if not folder.is_dir():
        raise PromptError(f"no such tokenizer folder: {str(source)!r}")
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        for f in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        value = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(value, str):
            templates["default"] = value
    if not templates and (folder / "tokenizer_config.json").is_file():
        value = _read_json(folder / "tokenizer_config.json").get("chat_template")
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            templates = {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
    if not templates:
        raise PromptError(f"{folder} has no chat template (no chat_template.jinja, chat_template.json or "
                          "\"chat_template\" in tokenizer_config.json); it is not a chat model, or give the template")
    key = name or "default"
    if key not in templates:
        raise PromptError(f"{folder}: no chat template named {key!r}; it has {sorted(templates)}")
    return ChatTemplate(templates[key], _special_token_strings(folder), str(folder))


def _compile_chat_template(text: str):
    """Jinja2 with the settings transformers renders chat templates with: a sandbox, trim_blocks and
    lstrip_blocks, loop controls, a ``tojson`` that leaves non-ASCII and HTML characters alone,
    ``raise_exception`` and ``strftime_now``; ``{% generation %}`` blocks render their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}  # marks assistant text for training masks; here it just renders its body

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise PromptError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


def apply_chat_template(source: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                        template_name: str | None = None, **kwargs: Any) -> str:
    """Render a conversation with a model's chat template, as ``tokenizer.apply_chat_template(messages,
    tokenize=False, add_generation_prompt=...)`` does in transformers.

    Args:
        source: a Hugging Face folder (or a tokenizer.json in one), a :class:`ChatTemplate`, or an object with
            a ``chat_template`` attribute (a transformers tokenizer).
        messages: ``[{"role": "system"|"user"|"assistant", "content": "..."}, ...]``.
        add_generation_prompt: end with the header of an assistant turn, so the model writes the reply.
        template_name: a named template when the folder has several.
        kwargs: extra template variables (they override the special tokens of the same name).
    Returns:
        The prompt text; tokenize it with ``Tokenizer.encode`` (its special-token strings become their ids and
        no further special tokens are added, like transformers' ``tokenize=True`` path).
    """
    if isinstance(source, ChatTemplate):
        chat = source
    elif isinstance(source, (str, Path)):
        chat = load_chat_template(source, template_name)
    elif getattr(source, "chat_template", None) is not None:
        tpl = source.chat_template
        if isinstance(tpl, dict):
            tpl = tpl[template_name or "default"]
        chat = ChatTemplate(tpl, dict(getattr(source, "special_tokens_map", {}) or {}))
    else:
        raise PromptError(f"no chat template in {type(source).__name__}; give a Hugging Face folder with one")
    if isinstance(messages, (str, Mapping)) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise PromptError("messages must be a list of {'role': ..., 'content': ...} dicts")
    import jinja2

    try:
        return _compile_chat_template(chat.template).render(
            messages=[dict(m) for m in messages], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**chat.special_tokens, **kwargs})
    except jinja2.TemplateError as e:
        raise PromptError(f"the chat template of {chat.source or 'the tokenizer'} failed: {e}") from None


# ------------------------------------------------------------------------- chain of thought and voting
# "The answer is 11." (Wei et al. 2022's exemplars end this way); else the last number of the reasoning.
ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_answer(text: str | None) -> str | None:
    """A comparable form of an answer: numbers canonical (``"1,000.0"`` -> ``"1000"``, ``"-3.50"`` ->
    ``"-3.5"``); other text stripped of surrounding space and a final period, lowercased."""
    if text is None:
        return None
    s = str(text).strip().rstrip(".").strip()
    plain = s.replace(",", "").lstrip("$")
    try:
        value = float(plain)
    except ValueError:
        return s.lower() or None
    if value != value or value in (float("inf"), float("-inf")):
        return s.lower()
    return str(int(value)) if value == int(value) else repr(value)


def extract_answer(text: str, pattern: str | re.Pattern | None = None) -> str | None:
    """The final answer of a reasoning path, normalised (:func:`normalize_answer`), or None.

    Default: the number after the last "the answer is", else the last number in the text. A custom
    ``pattern`` (regex): its last match, group 1 if it has groups, else the whole match.
    """
    if pattern is not None:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        matches = list(rx.finditer(text))
        if not matches:
            return None
        m = matches[-1]
        return normalize_answer(m.group(1) if rx.groups else m.group(0))
    found = ANSWER_IS.findall(text) or NUMBER.findall(text)
    return normalize_answer(found[-1]) if found else None


@dataclass
class Vote:
    """The outcome of a majority vote over extracted answers."""

    answer: str | None  # the winner; None when no path gave an answer
    counts: dict[str, int]  # answer -> votes, most votes first (ties: first appearance first)
    n_paths: int  # reasoning paths sampled
    n_unanswered: int  # paths with no extractable answer (they do not vote)

    @property
    def agreement(self) -> float:
        """Share of all paths that voted for the winner."""
        return self.counts.get(self.answer, 0) / self.n_paths if self.n_paths and self.answer is not None else 0.0


def majority_vote(answers: Sequence[str | None]) -> Vote:
    """Self-consistency's aggregation (Wang et al. 2023): the most frequent answer among the paths.

    Paths without an answer (None) do not vote. Ties are broken deterministically by first appearance:
    of the tied answers, the one produced by the earliest path wins (with a fixed sampling seed the result
    is reproducible, and with k=1 it is that path's answer).
    """
    first: dict[str, int] = {}
    counts: Counter[str] = Counter()
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] += 1
        first.setdefault(a, i)
    ranked = sorted(counts, key=lambda a: (-counts[a], first[a]))
    return Vote(answer=ranked[0] if ranked else None, counts={a: counts[a] for a in ranked}, n_paths=len(answers),
                n_unanswered=sum(a is None for a in answers))


@dataclass
class SelfConsistency:
    """Sampled reasoning paths, the answer extracted from each, and their vote."""

    paths: list[str]
    answers: list[str | None]
    vote: Vote


def self_consistency(sample: Callable[[int], Sequence[str]], k: int, *,
                     pattern: str | re.Pattern | None = None) -> SelfConsistency:
    """Sample ``k`` reasoning paths with ``sample(k)``, extract each one's answer, majority-vote them.

    ``sample`` is any function returning ``k`` completions, e.g. ``lambda k: sample_paths(model, tok, ids, n=k,
    do_sample=True, temperature=0.7, seed=0)`` (scoring.py), or a stub in tests. k=1 with greedy decoding is
    plain chain-of-thought.
    """
    if k < 1:
        raise PromptError(f"self-consistency needs k >= 1 reasoning paths, got {k}")
    paths = list(sample(k))
    if len(paths) != k:
        raise PromptError(f"the sampler returned {len(paths)} paths for k={k}")
    answers = [extract_answer(p, pattern) for p in paths]
    return SelfConsistency(paths, answers, majority_vote(answers))
