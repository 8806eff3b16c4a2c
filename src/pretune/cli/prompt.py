"""``pretune prompt``: evaluate a prompt on a labelled file with a pretrained LM, no training.

Two modes: label words (classification by comparing label-word likelihoods; accuracy and macro-F1) and
``--cot`` (generate a reasoning path, extract the answer; ``--self-consistency K`` samples K paths and takes
the majority; accuracy against a gold answer field).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path

from ..data.records import Record
from ..generation.prompt import (
    ORDERS,
    FewShotPrompt,
    PromptError,
    PromptTemplate,
    Verbalizer,
    load_chat_template,
    random_labels,
    select_shots,
)
from .quantize import add_quantize_argument, apply_quantize, check_quantize

PROMPT_DESCRIPTION = (
    "Evaluate a prompt on a labelled JSONL/CSV/TSV/Parquet file with a decoder (or encoder-decoder) LM, without "
    "training. The template names record fields as {field} placeholders and has one answer slot ({label}, or "
    "the --solution-field with --cot; appended after a space when absent). Label-word mode scores each label's "
    "word (--labels / --verbalizer) after the prompt and predicts the most likely one; shots (--shots K "
    "--shots-from FILE) are demonstrations put before the query, drawn with --seed and ordered by --order. "
    "--cot generates a reasoning path per record and extracts its answer (default: the number after the last "
    "'The answer is', else the last number); --self-consistency K samples K paths and takes the majority answer "
    "(ties: the answer of the earliest path). Prints accuracy (label words: also macro-F1) and writes one JSON "
    "line per record with --out.")

PROMPT_EPILOG = r"""escapes: \n, \t and \\ in --template, --instruction, --sep, --system and --stop are turned into
newline, tab and backslash.

examples:
  pretune prompt MODEL --data test.jsonl --template 'Message: {text}\nIs this message spam? Answer:' \
      --labels 'ham=No,spam=Yes' --shots 4 --shots-from train.jsonl --seed 0 --balanced --out predictions.jsonl
  pretune prompt MODEL --data test.jsonl --template ... --labels ... --shots 4 --shots-from train.jsonl \
      --order shuffle --order-seed 1          same 4 examples as --order-seed 0, another order
  pretune prompt MODEL --data test.jsonl --template 'Review: {text}\nSentiment: {label}' \
      --labels 'pos=positive,neg=negative' --chat --length-norm mean
  pretune prompt MODEL --data problems.jsonl --cot --template 'Q: {question}\nA: {solution}' \
      --shots 2 --shots-from worked.jsonl --shot-ids 0,1 --self-consistency 5 --temperature 0.7
"""

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str | None) -> str | None:
    r"""``\n``, ``\t`` and ``\\`` typed on a command line -> newline, tab, backslash."""
    return None if text is None else re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row numbers, got {text!r}") from None


def add_prompt_parser(sub) -> argparse.ArgumentParser:
    """Register ``prompt`` on an argparse subparsers object (``func=cmd_prompt``); returns its parser."""
    s = sub.add_parser("prompt", help="evaluate a zero/few-shot prompt (label words, chain-of-thought, "
                       "self-consistency) on labelled data", description=textwrap.fill(PROMPT_DESCRIPTION, 100),
                       epilog=PROMPT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", metavar="MODEL", help="pretune checkpoint or Hugging Face folder (decoder or "
                   "encoder-decoder with an LM head)")
    s.add_argument("--data", required=True, metavar="FILE", help="labelled records to evaluate on")
    s.add_argument("--template", required=True, metavar="TEXT",
                   help="prompt template with {field} placeholders and one answer slot, e.g. "
                   "'Message: {text}\\nSpam? Answer: {label}'")
    s.add_argument("--instruction", metavar="TEXT", default="", help="text put before the shots and the query")
    s.add_argument("--sep", metavar="TEXT", default="\\n\\n",
                   help="separator between instruction, shots and query (default: a blank line)")
    s.add_argument("--limit", type=int, metavar="N", help="evaluate only the first N records of --data")
    s.add_argument("--out", metavar="FILE", help="predictions JSONL, one line per record (a new file, written "
                   "atomically)")
    s.add_argument("--json", metavar="FILE", help="also write the metrics and settings to this JSON file (a new file)")
    s.add_argument("--overwrite", action="store_true", help="replace --out / --json if they exist")
    s.add_argument("--show-prompt", action="store_true", help="print the first record's whole prompt")
    s.add_argument("--quiet", action="store_true", help="no progress bar")

    g = s.add_argument_group("label words (classification)")
    words = g.add_mutually_exclusive_group()
    words.add_argument("--labels", metavar="SPEC", help="label=word pairs, comma separated: 'ham=No,spam=Yes' "
                       "(a bare 'positive,negative' uses each label as its word); multi-token words are summed")
    words.add_argument("--verbalizer", metavar="FILE",
                       help="label -> word file: a JSON object, or label=word / label<TAB>word lines")
    g.add_argument("--label-field", default="label", metavar="NAME",
                   help="the records' gold label field, also the template's slot name (default label)")
    g.add_argument("--length-norm", choices=["sum", "mean"], default="sum",
                   help="a word's score: total log-probability of its tokens (sum, default) or per token (mean)")
    g.add_argument("--calibrate", nargs="?", const="", metavar="TEXTS",
                   help="contextual calibration (Zhao et al. 2021): also score the prompt with every field set to "
                   "content-free inputs (default: 'N/A', '' and '[MASK]', averaged; or a '|'-separated list of your "
                   "own) and divide each label's probability by its content-free one; helps when the raw "
                   "predictions pile onto one label; the uncalibrated scores are reported too")
    g.add_argument("--strategy", choices=["cache", "rows"], default="cache",
                   help="cache (default): run the shared shots once and reuse their key/value cache, score every "
                   "label from one pass per query; rows: one full prompt+word row per label (slower reference)")

    g = s.add_argument_group("shots (few-shot demonstrations)")
    g.add_argument("--shots", type=int, default=0, metavar="K", help="number of demonstrations (default 0: zero-shot)")
    g.add_argument("--shots-from", metavar="FILE", help="labelled file the demonstrations come from (e.g. train)")
    g.add_argument("--seed", type=int, default=0, help="which shots are drawn; --cot: sampling seed (record i "
                   "uses seed + i) (default 0)")
    g.add_argument("--balanced", action="store_true",
                   help="K // labels shots per label (the remainder to labels drawn with --seed) instead of a "
                   "uniform draw")
    g.add_argument("--order", choices=list(ORDERS), default=None,
                   help="shuffle (default: file order shuffled with --order-seed), file (file order), interleave "
                   "(labels alternate)")
    g.add_argument("--order-seed", type=int, metavar="N", help="seed of --order shuffle (default: --seed); another "
                   "value gives the same examples in another order")
    g.add_argument("--shot-ids", type=_int_list, metavar="I,J,...",
                   help="exact demonstrations: 0-based rows of --shots-from, in this order (replaces --shots, "
                   "--seed's draw, --balanced and --order)")
    g.add_argument("--random-labels", action="store_true",
                   help="demonstrations with random labels (Min et al. 2022): each shot keeps its input, its label "
                   "word is that of a label drawn uniformly from the label set with --label-seed (some are right by "
                   "chance); the labels shown are reported")
    g.add_argument("--label-seed", type=int, metavar="N", help="seed of --random-labels (default: --seed); another "
                   "value gives the same examples with other random labels")

    g = s.add_argument_group("chain-of-thought (--cot)")
    g.add_argument("--cot", action="store_true", help="generate a reasoning path and extract its answer instead "
                   "of scoring label words")
    g.add_argument("--self-consistency", type=int, default=1, metavar="K",
                   help="sample K reasoning paths and majority-vote their answers (default 1: one greedy path)")
    g.add_argument("--answer-field", default="answer", metavar="NAME", help="gold answer field (default answer)")
    g.add_argument("--solution-field", default="solution", metavar="NAME",
                   help="the shots' worked solution (ending e.g. 'The answer is 11.'); the template's slot name "
                   "in --cot mode (default solution)")
    g.add_argument("--answer-regex", metavar="REGEX", help="answer extraction: last match, group 1 if it has one "
                   "(default: number after the last 'The answer is', else the last number)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens per path (default 128)")
    g.add_argument("--temperature", type=float, default=0.7, help="sampling temperature for K > 1 (default 0.7)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop a path at this text (repeatable; default: --sep, none with --chat)")

    g = s.add_argument_group("model and context")
    g.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or folder, if MODEL holds none")
    g.add_argument("--base", metavar="DIR", help="an adapter folder's base model (default: the path it recorded)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message with the model's chat template (tokenizer_config.json "
                   "/ chat_template.jinja); the answer starts the assistant's reply")
    g.add_argument("--system", metavar="TEXT", help="system message with --chat (default: the template's own)")
    g.add_argument("--bos", choices=["auto", "yes", "no"], default="auto",
                   help="BOS before the prompt: auto (what the tokenizer's post-processor adds, e.g. Llama's <s>; "
                   "none for GPT-2/SmolLM2), yes, no")
    g.add_argument("--max-len", type=int, metavar="N", help="context window in tokens, when smaller than the model's "
                   "max_seq_len")
    g.add_argument("--fit", choices=["error", "drop-shots"], default="error",
                   help="a prompt longer than the context window: stop with an error naming the record (default), "
                   "or drop that prompt's earliest shots until it fits (the count is reported)")
    g.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per forward pass (default 8)")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    g.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="inference precision")
    add_quantize_argument(g)
    s.set_defaults(func=cmd_prompt)
    return s


# --------------------------------------------------------------------------------------------- running
def _records(path: str, limit: int | None, what: str) -> list[Record]:
    from ..data.records import read_records

    recs = read_records(path)
    if not recs:
        raise PromptError(f"{what} {path} holds no records")
    return recs[:limit] if limit else recs


def _write_jsonl(rows: Sequence[dict], out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def cmd_prompt(args) -> int:
    import torch

    from ..io.outputs import check_file
    from ..io.progress import progress
    from ..jobs.prompting import evaluate_cot, evaluate_labels
    from ..loading import load_pretrained

    for out in (args.out, args.json):
        if out:
            check_file(out, overwrite=args.overwrite, what="output file")
    template_text, sep = unescape(args.template), unescape(args.sep)
    if args.cot:
        if args.labels or args.verbalizer:
            raise PromptError("--cot compares generated answers with --answer-field; --labels/--verbalizer are for "
                              "label-word mode")
        if args.balanced or args.order == "interleave":
            raise PromptError("--balanced and --order interleave need labels; they apply to label-word mode")
        verbalizer = None
        template = PromptTemplate(template_text, slot=args.solution_field, name="--template")
    else:
        if not (args.labels or args.verbalizer):
            raise PromptError("give the label words with --labels 'label=word,...' or --verbalizer FILE (or use --cot)")
        verbalizer = Verbalizer.load(args.verbalizer) if args.verbalizer else Verbalizer.parse(args.labels)
        template = PromptTemplate(template_text, slot=args.label_field, name="--template")
    if args.self_consistency < 1:
        raise PromptError(f"--self-consistency {args.self_consistency} must be >= 1")
    if args.cot and args.calibrate is not None:
        raise PromptError("--calibrate applies to label words, not --cot")
    if args.self_consistency > 1 and not args.cot:
        raise PromptError("--self-consistency samples reasoning paths: add --cot")
    k = len(args.shot_ids) if args.shot_ids is not None else args.shots
    if k and not args.shots_from:
        raise PromptError(f"{k} shots need --shots-from FILE (a labelled file, e.g. the training split)")
    if args.shot_ids is not None and (args.order or args.balanced):
        raise PromptError("--shot-ids fixes the examples and their order; drop --order/--balanced")
    if args.random_labels and (args.cot or not k):
        raise PromptError("--random-labels replaces the label words of the demonstrations: it needs label-word mode "
                          "(no --cot) and shots (--shots K or --shot-ids)")
    if args.label_seed is not None and not args.random_labels:
        raise PromptError("--label-seed seeds --random-labels; add --random-labels or drop it")
    shots: list[Record] = []
    if k:
        pool = _records(args.shots_from, None, "--shots-from")
        shots = select_shots(pool, k, seed=args.seed, label_field=args.answer_field if args.cot else args.label_field,
                             labels=None if verbalizer is None else verbalizer.labels, balanced=args.balanced,
                             order=args.order or "shuffle", order_seed=args.order_seed, ids=args.shot_ids)
    targets = [s.data.get(args.solution_field) if args.cot else verbalizer.word_of(s, args.label_field) for s in shots]
    shown = None  # --random-labels: the label each demonstration shows, in prompt order
    if args.random_labels:
        shown = random_labels(len(shots), verbalizer.labels,
                              seed=args.seed if args.label_seed is None else args.label_seed)
        targets = [verbalizer.words[label] for label in shown]
    if args.cot and (missing := [s.where for s, t in zip(shots, targets) if not isinstance(t, str)]):
        raise PromptError(f"{missing[0]}: a --cot shot needs its worked solution in the field "
                          f"{args.solution_field!r} (--solution-field)")
    prompt = FewShotPrompt(template, shots=shots, targets=targets, instruction=unescape(args.instruction) or "",
                           sep=sep)
    records = _records(args.data, args.limit, "--data")
    for r in records[:1]:
        template.check(r)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    check_quantize(args.quantize, device=device)
    loaded = load_pretrained(args.model, tokenizer=args.tokenizer or None, base=args.base)
    model, tok = loaded.model, loaded.tokenizer
    model = apply_quantize(model, args.quantize)
    model.to(device).eval().requires_grad_(False)  # only run: frozen weights are held once (FusedLinears)
    chat = load_chat_template(loaded.folders) if args.chat else None
    common = dict(chat=chat, system=unescape(args.system), max_len=args.max_len,
                  fit=args.fit.replace("-", "_"), add_bos={"auto": None, "yes": True, "no": False}[args.bos])
    if args.show_prompt:
        print(_shown_prompt(prompt, records[0], chat, common["system"]))
    bar = progress(total=len(records), desc="prompt", unit="rec", disable=args.quiet, leave=False)
    amp = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if args.precision == "bf16" \
        else contextlib.nullcontext()
    with amp:
        if args.cot:
            metrics, rows = evaluate_cot(
                model, tok, prompt, records, answer_field=args.answer_field, progress=bar.update,
                k=args.self_consistency, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                max_new_tokens=args.max_new_tokens, seed=args.seed, pattern=args.answer_regex,
                stop=[unescape(x) for x in args.stop] if args.stop else None, **common)
        else:
            metrics, rows = evaluate_labels(
                model, tok, prompt, verbalizer, records, label_field=args.label_field, progress=bar.update,
                length_norm=args.length_norm, content_free=_content_free(args.calibrate), batch_size=args.batch_size,
                strategy=args.strategy, **common)
    bar.close()
    demos = [{"row": s.row} for s in shots]  # the demonstrations in prompt order (label words: gold and shown)
    if not args.cot:
        for d, s, label in zip(demos, shots, shown or [None] * len(shots)):
            d["label"] = verbalizer.label_of(s, args.label_field)
            d["shown"] = d["label"] if label is None else label
    _report(args, metrics, len(records), demos, verbalizer)
    if args.out:
        _write_jsonl(rows, args.out)
        print(f"wrote {len(rows)} predictions to {args.out}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "func"}
        Path(args.json).write_text(json.dumps({"metrics": metrics, "settings": settings, "demonstrations": demos},
                                              indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _content_free(arg: str | None) -> tuple[str, ...] | None:
    """--calibrate's content-free inputs: none (no --calibrate), Zhao et al.'s three (a bare --calibrate) or the
    user's '|'-separated texts."""
    from ..generation.scoring import CONTENT_FREE

    if arg is None:
        return None
    return tuple(unescape(t) for t in arg.split("|")) if arg else CONTENT_FREE


def _shown_prompt(prompt: FewShotPrompt, rec: Record, chat, system) -> str:
    from ..generation.prompt import apply_chat_template

    text = prompt.text(rec)
    if chat is not None:
        text = apply_chat_template(chat, ([{"role": "system", "content": system}] if system else [])
                                   + [{"role": "user", "content": text}])
    return f"--- prompt of {rec.row} ---\n{text}\n--- end of prompt ---"


def _report(args, metrics: dict, n: int, demos: list[dict], verbalizer) -> None:
    mode = "chain-of-thought" + (f", self-consistency over {args.self_consistency} paths"
                                 if args.self_consistency > 1 else ", greedy") if args.cot else "label words"
    order = "rows " + ",".join(map(str, args.shot_ids)) if args.shot_ids is not None else \
        f"seed {args.seed}, order {args.order or 'shuffle'}" + (
            f" (order seed {args.order_seed})" if args.order_seed is not None else "") + (
            ", balanced" if args.balanced else "")
    print(f"{Path(args.data).name}: {n} records, {mode}, {len(demos)} shots" + (f" ({order})" if demos else ""))
    if args.random_labels:
        seed = args.seed if args.label_seed is None else args.label_seed
        print(f"  random labels (label seed {seed}): shown " + ", ".join(d["shown"] for d in demos) + "; gold "
              + ", ".join(d["label"] for d in demos) + f" ({sum(d['shown'] == d['label'] for d in demos)} of "
              f"{len(demos)} right by chance)")
    if verbalizer is not None:
        print("  label words: " + ", ".join(f"{k} -> {v!r}" for k, v in verbalizer.words.items()))
        runs = [("", metrics)]
        if "uncalibrated" in metrics:
            shown = ", ".join(repr(t) for t in _content_free(args.calibrate))
            runs = [(f" (calibrated, content-free {shown})", metrics),
                    (" (uncalibrated)", metrics["uncalibrated"])]
        for what, m in runs:
            print(f"  accuracy {m['accuracy']:.4f}   macro_f1 {m['macro_f1']:.4f}   predicted: "
                  + ", ".join(f"{k} {m['predicted'].get(k, 0)}" for k in verbalizer.labels) + what)
        print("  gold: " + ", ".join(f"{k} {metrics['gold'].get(k, 0)}" for k in verbalizer.labels))
        if "auc" in metrics:
            a, b = verbalizer.labels
            print(f"  ROC AUC of log p({verbalizer.words[b]!r}) - log p({verbalizer.words[a]!r}) for {b!r}: "
                  f"{metrics['auc']:.4f} (threshold-free: how well the scores rank, whatever the bias)")
    else:
        print(f"  accuracy {metrics['accuracy']:.4f}   mean agreement {metrics['mean_agreement']:.3f}   "
              f"paths without an answer {metrics['unanswered_paths']}")
    if metrics["dropped_shots"]:
        print(f"  {metrics['dropped_shots']} of {n} prompts dropped shots to fit the context window")
