"""Input and output: checkpoints (atomic save, strict load), where a command may write (``outputs``), tokenizers
(``tokenization``, SentencePiece conversion in ``spm``), the offline real checkpoints (``realmodels``) and the
progress bars (``progress``: tqdm's on a terminal, a few plain lines in a log).
Hugging Face interop (``pretune.interop``) and data (``pretune.data``) are of this layer too, in folders of their
own; docs/architecture.md has the table."""
