"""The jobs: each prepares (config → model, objective or task, data), runs the one ``Trainer`` and exports —
pretraining (``pretrain``; distillation, ``distill``, is a pretraining run), finetuning (``finetune``), evaluating
and predicting with a finetuned model (``inference``), sentence embeddings (``embed``), prompt evaluation
(``prompting``), the quickstart (``quickstart``) and a plain model from a training checkpoint (``consolidate``).
The CLI (``pretune.cli``) calls them; docs/architecture.md has the layer table."""
