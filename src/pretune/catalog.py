"""What pretune offers, by name, with one line of help each: the objectives, the finetuning tasks, the PEFT methods
and the Hugging Face families. Every help text that lists them is written from here, so ``pretune --help`` and its
commands name all of them without importing torch (the registries import it). ``tests/test_catalog.py`` holds each
mapping equal, name for name and in order, to its registry: ``pretune.objectives.OBJECTIVES``,
``pretune.tasks.TASKS``, ``pretune.peft.methods.METHODS`` and the families of ``pretune.interop`` (by
``model_type``). A new entry of a registry is a new line here too.
"""

from __future__ import annotations

# pretraining objectives (`pretune pretrain --objective NAME`): which families serve each, what it trains
OBJECTIVES: dict[str, str] = {
    "clm": "decoders: causal LM, each token predicted from the ones before it (GPT)",
    "prefix_lm": "encoder-decoders, decoders: read a prefix, predict its continuation",
    "mlm": "encoders: masked LM, 15% of tokens selected (80% [MASK], 10% random, 10% kept) (BERT)",
    "nsp": "encoders: masked LM + next-sentence prediction on [CLS] A [SEP] B [SEP] (BERT)",
    "sop": "encoders: masked LM + sentence-order prediction, B after A or the two swapped (ALBERT)",
    "electra": "encoders: replaced-token detection against a small masked-LM generator (ELECTRA)",
    "span": "encoder-decoders, decoders: spans of mean length 3 -> one sentinel each; target the spans (T5)",
    "iid_spans": "encoder-decoders, decoders: i.i.d. noised tokens, consecutive ones sharing a sentinel (T5)",
    "bert_style": "encoder-decoders, decoders: BERT-style masking; target the original text (T5)",
    "iid_mask": "encoder-decoders, decoders: i.i.d. noised tokens masked; target the original text (T5)",
    "drop_tokens": "encoder-decoders, decoders: i.i.d. noised tokens dropped; target the dropped tokens (T5)",
    "deshuffle": "encoder-decoders, decoders: the tokens shuffled; target the original text (T5)",
    "denoise": "encoder-decoders, decoders: masking, deletion, span infilling, sentence permutation, rotation (BART)",
    "distill": "encoders, decoders: a student learns a frozen teacher's soft predictions (DistilBERT)",
}

# finetuning tasks (`pretune finetune --task NAME`): the record fields they read (task.<x>_field renames), what they do
TASKS: dict[str, str] = {
    "classification": "text, label: one text -> a label ([CLS]/mean pooling; decoders: the last token)",
    "pair": "text_a, text_b, label: BERT [CLS] a [SEP] b [SEP] or GPT [START] a [DELIM] b [EXTRACT]",
    "regression": "text (or text_a, text_b), label (a number): STS-B style, mean squared error",
    "tagging": "tokens, tags: one tag per word (BIO for NER), scored with seqeval",
    "qa": "context, question, answers: extractive spans, sliding window (task.stride), SQuAD 2.0",
    "seq2seq": "source, target: text-to-text with task.prefix; greedy generation",
    "sft": "prompt, completion (or messages, or text): instruction / chat finetuning of decoders (TRL's SFT)",
    "choice": "text, label: classification by the LM's likelihood of each label's answer text (T-Few)",
    "multilabel": "text, label (a list): a set of labels per text, a sigmoid each",
    "dpo": "prompt, chosen, rejected: preference tuning of decoders (DPO, IPO, hinge, SimPO, ORPO; TRL's)",
    "kto": "prompt, completion, label (true/false): preference tuning of decoders on unpaired feedback (TRL's KTO)",
    "reward": "prompt, chosen, rejected (margin): a reward model, a scalar head on a decoder (TRL's RewardTrainer)",
    "grpo": "prompt (+ fields the rewards read): RL from verifiable rewards (TRL's GRPO); --reward NAME, --steps N",
    "embedding": "anchor, positive (negative) or text_a, text_b, score: sentence embeddings, MNRL / CoSENT (ST's)",
    "rerank": "query, positive, negative (or document, label): a cross-encoder scores pairs, listwise or BCE",
}

# parameter-efficient methods (`pretune finetune --peft NAME`, or a '+' combination)
PEFT_METHODS: dict[str, str] = {
    "lora": "low-rank update W0 + (alpha/r) B A of the target linear layers (Hu et al. 2021)",
    "adapter": "Houlsby bottleneck (down, nonlinearity, up, residual) after attention and after the FFN",
    "prefix": "trainable key/value prefixes at every self-attention layer (Li & Liang 2021)",
    "prompt": "a soft prompt of n_virtual trainable embeddings prepended to the input (Lester et al. 2021)",
    "ia3": "learned vectors rescaling keys, values and the FFN inner activation (Liu et al. 2022, T-Few)",
    "embeddings": "train the token embedding matrix only (language adaptation)",
    "bitfit": "train only the bias terms (+ the task head) (Ben Zaken et al. 2021)",
}

# Hugging Face families (`pretune convert`, `pretune.from_hf` / `to_hf`), by the model_type of their config.json
FAMILIES: dict[str, str] = {
    "bert": "BERT: post-norm encoder, masked LM and next-sentence heads",
    "roberta": "RoBERTa: BERT with <s>/</s> tokens and offset positions",
    "electra": "ELECTRA: the discriminator (replaced-token detection) and the generator",
    "distilbert": "DistilBERT: BERT without token types or pooler",
    "gpt2": "GPT-2: pre-norm decoder with learned positions",
    "openai-gpt": "GPT-1: post-norm decoder (Radford et al. 2018)",
    "t5": "T5 v1.0 and v1.1: encoder-decoder with relative position buckets",
    "bart": "BART: post-norm encoder-decoder (denoising)",
    "llama": "Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention",
    "qwen2": "Qwen2 / Qwen2.5: Llama with q/k/v biases",
    "qwen3": "Qwen3: Llama with query/key norms",
    "mistral": "Mistral: Llama with sliding-window attention",
    "gemma": "Gemma: Llama with (1 + w) RMSNorm, scaled embeddings and GeGLU",
    "gemma2": "Gemma 2: Gemma with sandwich norms, local/global layers and soft-capping",
    "modernbert": "ModernBERT: pre-norm encoder with RoPE, GeGLU and local/global attention",
    "deberta-v2": "DeBERTa-v2 and v3: encoder with disentangled relative attention",
    "albert": "ALBERT: factorised embeddings, one layer shared across depth",
}


def listing(entries: dict[str, str], indent: int = 2) -> str:
    """One line per entry, ``  name   help``, names in a column."""
    width = max(map(len, entries)) + 2
    return "\n".join(f"{' ' * indent}{name:<{width}}{text}" for name, text in entries.items())


def names(entries: dict[str, str], last: str = "or") -> str:
    """``a, b, c or d``."""
    keys = list(entries)
    return ", ".join(keys[:-1]) + f" {last} {keys[-1]}" if len(keys) > 1 else "".join(keys)
