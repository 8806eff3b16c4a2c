"""The ``pretune`` command: subcommands that call plain functions; no logic of its own."""

from __future__ import annotations

import argparse
import re
import sys

EPILOG = """examples:
  pretune tokenizer train CORPUS/*.txt.gz --kind wordpiece --vocab-size 8000 --out tok/tokenizer.json
  pretune data clean raw/*.jsonl.gz --out clean.jsonl.gz      C4-style cleaning with a per-rule report
  pretune data tokenize CORPUS/*.txt.gz --tokenizer tok/tokenizer.json --out store/
  pretune pretrain --preset tiny-bert-base --objective mlm --tokenizer tok/tokenizer.json --data CORPUS/*.txt.gz
  pretune pretrain --config configs/pretrain/bert-mlm.yaml train.lr=1e-3 --resume
  pretune distill --teacher runs/bert/model --preset distilbert-base --init-from-teacher every_other --data CORPUS
  pretune show bert-base                 architecture and parameter counts of a preset
  pretune show path/to/checkpoint        ... or of a saved checkpoint / Hugging Face folder
  pretune convert --from-hf HF_DIR --out CKPT_DIR
  pretune convert --to-hf CKPT_DIR --out HF_DIR
  pretune bench model                    training throughput vs transformers (BENCHMARKS.md)
  pretune bench pretrain                 MLM pretraining tokens/s vs transformers, tokenize-to-store MB/s
  pretune bench finetune                 MiniLM on sms_spam, 1 epoch: wall time and accuracy vs HF Trainer
  pretune bench generate                 greedy decoding tokens/s of SmolLM2-135M vs transformers' generate
  pretune finetune --model CKPT --task classification --train train.jsonl --dev dev.jsonl --test test.jsonl
  pretune evaluate runs/finetune/model test.jsonl      accuracy, F1, MCC, ... of a finetuned model
  pretune predict runs/finetune/model new.jsonl --out predictions.jsonl
  pretune eval MODEL --tasks hellaswag,arc_easy   lm-evaluation-harness benchmarks (--include-path: your task YAMLs)
  pretune embed MODEL_DIR sentences.txt --out emb.npy   sentence embeddings (--similarity ranks pairs)
  pretune mine MODEL_DIR --data pairs.jsonl --out triplets.jsonl   hard negatives for --task embedding
  pretune generate MODEL "Once upon a time" --max-new-tokens 40   greedy / --do-sample / --num-beams 4, streamed
  pretune prompt MODEL --data test.jsonl --template 'Message: {text}\\nSpam? Answer:' --labels 'ham=No,spam=Yes' \\
      --shots 4 --shots-from train.jsonl      few-shot classification by label-word likelihood (--cot: reasoning)
  pretune serve MODEL --adapter NAME=DIR   the OpenAI HTTP API on 127.0.0.1:8000, continuous batching, a chat page
  pretune chat MODEL                     a multi-turn chat in the terminal, streamed
  pretune quickstart                     tokenizer -> MLM pretraining -> finetune vs scratch vs MiniLM, a table + plot
  pretune sweep configs/sweep/lora-lr.yaml --jobs 2   grid / random search x seeds: results, mean ± std table, plots
  pretune experiment list                 the lectures' findings re-run: pretune experiment NAME -> table + verdict
  pretune data bundled --copy data       the bundled real corpus and task files (list them, or copy them to data/)
"""


OVERRIDE = re.compile(r"^-{0,2}[A-Za-z_]\w*\.[\w.]+=")  # a `section.key=value` config override
_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # a negative number is a value, not a flag (argparse's own test)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors also name the nearest option of each flag it does not know (``--epohcs``:
    did you mean ``--epochs``?). Subcommands' parsers are of the same class (``add_subparsers`` makes its parent's)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)  # what this (sub)command's parser was handed
        return super().parse_known_args(args, namespace)

    def unknown_flags(self) -> list[str]:
        """The flags given to this parser that are none of its options, nor an abbreviation of one."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        out = []
        for arg in getattr(self, "_given", []):
            if arg == "--":
                break
            flag = arg.split("=", 1)[0]
            if flag.startswith("-") and not _NUMBER.match(flag) and flag not in self._option_string_actions and \
                    not any(o.startswith(flag) for o in options):
                out.append(flag)
        return out

    def error(self, message: str):
        import difflib

        options = [o for o in self._option_string_actions if o.startswith("--")]
        hints = []
        for flag in dict.fromkeys(self.unknown_flags()):
            near = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
            if near:
                hints.append(f"did you mean {near[0]}" + ("" if flag in message else f" for {flag}") + "?")
        super().error(message + (f" ({'; '.join(hints)})" if hints else ""))


def _command_parser(parser: Parser) -> Parser:
    """The parser of the (sub)command that ``parser``'s one parse ran (``pretune tokenizer train`` -> the ``train``
    parser): among each level's subcommands, the one that was handed arguments."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        used = [p for p in (subs[0].choices.values() if subs else ()) if hasattr(p, "_given")]
        if not used:
            return parser
        parser = used[0]


def build_parser() -> argparse.ArgumentParser:
    """The ``pretune`` parser: each command's subparser is added by the module that holds the command."""
    p = Parser(prog="pretune", description="Pretrain once, finetune many times: transformer language models end to "
               "end.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from .. import __version__

    p.add_argument("--version", action="version", version=f"pretune {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from .bench import add_bench_parser
    from .chat import add_chat_parser
    from .data import add_data_parsers
    from .embed import add_embed_parser
    from .experiment import add_experiment_parser
    from .finetune import add_finetune_parsers
    from .generate import add_generate_parser
    from .lmeval import add_eval_parser
    from .mine import add_mine_parser
    from .model import add_model_parsers
    from .peft import add_peft_parser
    from .pretrain import add_pretrain_parsers
    from .prompt import add_prompt_parser
    from .quickstart import add_quickstart_parser
    from .serve import add_serve_parser
    from .sweep import add_sweep_parser

    for add in (add_model_parsers, add_bench_parser, add_data_parsers, add_pretrain_parsers, add_finetune_parsers,
                add_eval_parser, add_embed_parser, add_mine_parser, add_peft_parser, add_prompt_parser,
                add_generate_parser, add_sweep_parser,
                add_experiment_parser, add_quickstart_parser, add_serve_parser, add_chat_parser):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``pretune`` command line. pretune's errors print one line, ``pretune CMD: message`` (exit 2); an
    interrupted run says how to continue it (exit 130 for Ctrl-C, 143 for SIGTERM); anything unexpected prints one
    line and asks for ``--debug`` (which shows the traceback instead)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    overrides: list[str] = []
    if argv and argv[0] in ("pretrain", "distill", "finetune"):  # section.key=value (or --section.key=value) anywhere
        overrides = [a.lstrip("-") for a in argv[1:] if OVERRIDE.match(a)]
        argv = [argv[0]] + [a for a in argv[1:] if not OVERRIDE.match(a)]
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's parser says so, with its usage and the nearest of its options
        _command_parser(parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("pretrain", "distill", "finetune"):
        args.overrides = overrides
    try:
        return args.func(args) or 0
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line (or, with --debug, the traceback)
        if debug or isinstance(e, SystemExit):
            raise
        sub = getattr(args, "what", None) or getattr(args, "peft_command", None)
        return _report(f"{args.command} {sub}" if sub else args.command, e)


def _report(command: str, e: BaseException) -> int:
    """Print one line for ``e`` and return the exit code."""
    import errno

    from ..config import ConfigError
    from ..data.readers import DataError
    from ..data.store import StoreError
    from ..interop import InteropError
    from ..io.checkpoint import CheckpointError
    from ..io.tokenization import TokenizerError
    from ..train.loop import Interrupted, TrainingDiverged

    where = f"pretune {command}"
    if isinstance(e, BrokenPipeError):  # `pretune ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if isinstance(e, Interrupted):
        print(f"{where}: {e}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        print(f"{where}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if isinstance(e, TrainingDiverged):
        print(f"{where}: {e}", file=sys.stderr)
        return 3
    if isinstance(e, (ConfigError, CheckpointError, InteropError, DataError, StoreError, TokenizerError)):
        print(f"{where}: {e}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):
        name = f" {e.filename}" if getattr(e, "filename", None) else ""
        if e.errno == errno.ENOSPC:
            print(f"{where}: no space left on the device while writing{name}; free some space (a checkpoint being "
                  "written was discarded, the ones before it are intact) and run again (--resume for a run)",
                  file=sys.stderr)
        else:
            print(f"{where}: {e.strerror or e}{':' + name if name else ''}", file=sys.stderr)
        return 2
    from ..io.checkpoint import disk_full

    full = disk_full(e, ".") if isinstance(e, Exception) else None  # safetensors' / torch's own words for it
    if full is not None:
        print(f"{where}: no space left on the device; free some space and run again (--resume for a run)",
              file=sys.stderr)
        return 2
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    print(f"{where}: unexpected {type(e).__name__}{': ' + first if first else ''}; run with --debug for the "
          "traceback", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
