"""``pretune bench ...``: pretune side by side with the reference implementations, each measurement in its own
process, the sides alternating over several rounds (BENCHMARKS.md says how each figure is measured).

    model     training-step throughput vs transformers (GPT-2 and BERT shapes)
    pretrain  MLM pretraining with pretune's trainer vs transformers + its MLM collator
    finetune  MiniLM on sms_spam vs transformers' Trainer
    peft      a LoRA step vs peft + transformers
    generate  greedy decoding vs transformers' generate
    embed     sentence-embedding training (MNRL) and encoding of MiniLM vs sentence-transformers' fit and encode
"""
