"""``pretune bench ...``: pretune side by side with the reference implementations (the measurements are in
:mod:`pretune.bench`; BENCHMARKS.md says how each figure is taken)."""

from __future__ import annotations

import importlib


def cmd_bench(args) -> int:
    from ..bench.model import bench_model, format_rows

    rows = bench_model(families=args.models, dtypes=args.dtypes, rounds=args.rounds, steps=args.steps,
                       warmup=args.warmup, batch=args.batch, seq=args.seq, threads=args.threads,
                       dropout=args.dropout, loop=args.loop)
    from ..bench.common import report

    return report(rows, format_rows(rows), args.json)


def cmd_bench_pretrain(args) -> int:
    from ..bench.pretrain import run_cli

    return run_cli(args)


def add_bench_parser(sub) -> None:
    """Register ``bench`` and its subcommands on the ``pretune`` subparsers."""
    s = sub.add_parser("bench", help="benchmarks against the reference implementations")
    from ..bench.common import add_run_arguments

    bsub = s.add_subparsers(dest="what", metavar="WHAT", required=True)
    b = bsub.add_parser("model", help="forward+backward tokens/s and MFU: pretune vs transformers",
                        description="Times a training step (forward + backward) of a GPT-2-style and a "
                        "BERT-style model (6 layers, dim 512, 8 heads, vocab 8192) against transformers' "
                        "GPT2LMHeadModel / BertForMaskedLM. Every measurement runs in its own process, "
                        "implementations alternate, medians over --rounds are reported.")
    b.add_argument("--models", nargs="+", default=["gpt", "bert"], choices=["gpt", "bert", "llama"])
    b.add_argument("--loop", default="objective", choices=["objective", "labels"],
                   help="objective: pretune's objective functions, forward + backward (default); labels: the loop "
                   "users write, model(input_ids, labels=...).loss + backward + AdamW on both sides, on each "
                   "family's real vocabulary (GPT-2 50257, BERT 30522 with 15%% of rows labelled, Llama 32000), "
                   "with peak memory")
    b.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="bf16 = fp32 weights under torch.autocast(bfloat16)")
    add_run_arguments(b, threads="torch's default")
    b.add_argument("--steps", type=int, default=8, help="timed steps per run (median taken)")
    b.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    b.add_argument("--batch", type=int, default=8)
    b.add_argument("--seq", type=int, default=256)
    b.add_argument("--dropout", type=float, default=0.1, help="dropout in both models (default 0.1, as GPT-2/BERT)")
    b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("pretrain", help="MLM pretraining tokens/s vs transformers + tokenize-to-store MB/s",
                        description="Times MLM pretraining steps of a BERT-style model (6 layers, dim 512, vocab "
                        "30522: the real MiniLM tokenizer) with pretune's trainer against transformers' "
                        "BertForMaskedLM + DataCollatorForLanguageModeling on the same blocks of the bundled "
                        "corpus, each run in its own process, alternating; also times tokenizing the corpus "
                        "into a token store.")
    from ..bench.pretrain import add_arguments

    add_arguments(b)
    b.set_defaults(func=cmd_bench_pretrain)
    for name, help_, description in (  # each bench.NAME module brings its flags and its run_cli
        ("finetune", "finetuning MiniLM on sms_spam: wall time and test accuracy vs transformers",
         "Finetunes MiniLM (all-MiniLM-L6-v2) on sms_spam for one epoch with pretune "
         "finetune and with transformers' Trainer (same hyperparameters, each run in its own process, "
         "alternating) and reports the wall time of training + one dev evaluation, the test "
         "accuracy of each, their ratio and whether pretune is >= 1.3x faster at equal accuracy "
         "(+- 0.5 points)."),
        ("generate", "greedy decoding tokens/s (batch 1 and 8) vs transformers' generate",
         "Times greedy generation of 128 new tokens after a 32-token prompt with "
         "SmolLM2-135M (fp32, CPU) by pretune's generate (eager, and with compile=True) and "
         "transformers' generate (EOS ignored on every side), each run in its own process, "
         "alternating, and reports tokens/s, the ratios, the compiled side's first-call (compile) "
         "time and, at batch 1, whether each pretune side meets its target (eager >= 1.3x, "
         "compiled >= 1.5x transformers' tokens/s)."),
        ("peft", "LoRA step time and peak memory vs full finetuning and vs peft + transformers",
         "GPT-2 shape (6 layers, dim 512, batch 8 x 256): pretune full finetuning, "
         "pretune LoRA r=8 (q, k, v), transformers full finetuning and peft LoRA r=8 (c_attn), each "
         "run in its own process, alternating; reports the median step time (forward, backward, "
         "AdamW), peak RSS, and whether pretune's LoRA step is >= 1.15x faster than peft's."),
        ("sft", "LoRA SFT step tokens/s and peak memory on SmolLM2 vs transformers + peft and TRL",
         "LoRA r=8 (q_proj, v_proj) SFT step of SmolLM2-135M-Instruct on a batch of 8 x 256 chat tokens with "
         "labels on the assistant turns only, pretune against transformers + peft and (when installed) TRL's "
         "SFTTrainer on identical token ids and labels, each run in its own process, alternating; TRL recomputes "
         "activations by default, so it is compared with pretune-ac (pretune recomputing each block) too. "
         "Reports tokens/s, peak RSS, whether pretune is >= 1.5x faster at <= 0.8x the memory, and how fast the "
         "SFT task scores test records by generation."),
        ("dpo", "LoRA DPO step pairs/s and peak memory on SmolLM2 vs TRL's DPOTrainer; the reference pass's share",
         "LoRA r=8 (q_proj, v_proj) sigmoid DPO step of SmolLM2-135M-Instruct on 4 preference pairs of <= 256 "
         "tokens (WordNet glosses, chat-rendered), pretune's dpo task against TRL's DPOTrainer on the same records, "
         "beta and precision (--precision fp32 by default), the reference being the adapter switched off on both; "
         "each run in its own process, alternating. Reports pairs/s, peak RSS, their ratios and whether pretune is "
         ">= 1.5x faster at <= 0.8x the memory, and the share of pretune's step spent in the reference pass, with "
         "the reference computed at each step (pretune) and precomputed once (pretune-pre, "
         "task.precompute_reference=true)."),
        ("grpo", "LoRA GRPO step steps/s and peak memory on SmolLM2 vs TRL's GRPOTrainer; the sampling's share",
         "LoRA r=8 (q_proj, v_proj) GRPO step of SmolLM2-135M-Instruct: 4 two-digit-addition prompts x G 8 completions "
         "of exactly 64 tokens (EOS forbidden until then on both sides) at temperature 1, exact-match reward, dapo "
         "loss, beta 0; pretune finetune --task grpo's Trainer step against TRL's GRPOTrainer (transformers "
         "generation, no vLLM) at the same precision (--precision auto: bf16 where the CPU computes it natively), "
         "each run in its own process, alternating. Reports steps/s, peak RSS, their ratios and whether pretune is "
         ">= 2x faster at <= 0.8x the memory, the tokens each side generated and read (checked equal) and the share "
         "of each step spent sampling."),
        ("embed", "MiniLM sentence-embedding training pairs/s and peak memory vs sentence-transformers' fit; encode "
         "texts/s",
         "all-MiniLM-L6-v2 trained with MultipleNegativesRankingLoss (scale 20) on pairs from the bundled WordNet "
         "glosses (definition -> usage example), batch 32, max_len 128, AdamW lr 5e-5, fp32 (--dtypes fp32 bf16 for "
         "a bf16 autocast row too): pretune finetune --task embedding's Trainer step against SentenceTransformer + "
         "SentenceTransformerTrainer; and the same texts embedded by pretune embed's embed_texts against "
         "SentenceTransformer.encode (fp32, normalised, 32 a forward); 2 threads, each run in its own process, "
         "alternating. Reports pairs/s, peak RSS and whether pretune is >= 1.5x faster at <= 0.8x the memory, and "
         "texts/s against a >= 1.5x target."),
        ("serve", "pretune serve vs transformers serve: 1, 4, 16 streaming clients' tokens/s and time to first token",
         "Starts pretune serve and transformers serve (each its own process, alternating, --rounds rounds) on "
         "SmolLM2-135M-Instruct (fp32, CPU) and runs 1, 4 and 16 concurrent clients, each streaming greedy "
         "completions over HTTP; reports total tokens/s, time to first token p50/p95 and the ratios."),
        ("distributed", "peak memory per process DDP vs FSDP, and activation checkpointing's memory and time",
         "Under torchrun with 2 processes, a gpt2-medium-sized model's AdamW step with DDP and with FSDP (peak RSS per "
         "process, step time); in one process, a gpt2-sized step at sequence length 1024 with and without activation "
         "checkpointing (the step's peak memory, step time, largest gradient difference). Each run in its own "
         "process, alternating."),
    ):
        module = importlib.import_module(f"pretune.bench.{name}")
        b = bsub.add_parser(name, help=help_, description=description)
        module.add_arguments(b)
        b.set_defaults(func=module.run_cli)
