"""Real data that ships inside the package, so the quickstart, the README tour and the example
configs run offline on a fresh install. Provenance and licences: ``README.md`` in this folder.

    from pretune import bundled
    bundled.path("tasks/sms_spam/train.jsonl")      # a Path inside the installed package
    bundled.corpus()                                # the pretraining text files (*.txt.gz)
    bundled.task("sms_spam")                        # {"train": Path, "dev": Path, "test": Path}
    bundled.copy_to("data")                         # a copy to read, edit or point commands at

On the command line: ``pretune data bundled`` lists the files, ``pretune data bundled --copy DIR``
copies them (``DIR/corpus/*.txt.gz``, ``DIR/tasks/<task>/{train,dev,test}.jsonl``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["ROOT", "DESCRIPTIONS", "copy_to", "corpus", "files", "path", "task", "tasks"]

ROOT = Path(__file__).resolve().parent
DATA_DIRS = ("corpus", "tasks")
NOTICE = "README.md"  # provenance and licence notes; copied along with the data

# one line per bundled data set (what `pretune data bundled` prints)
DESCRIPTIONS: dict[str, str] = {
    "corpus/austen_emma_pride.txt.gz": "Jane Austen, Emma + Pride and Prejudice (public domain)",
    "corpus/enwiki_sample.txt.gz": "106 English Wikipedia articles, markup stripped (CC BY-SA)",
    "corpus/mobydick_ch1-20.txt.gz": "Melville, Moby Dick chapters 1-20 (public domain)",
    "corpus/web_bible_gospels.txt.gz": "World English Bible, the four gospels (public domain)",
    "tasks/sms_spam": "classification: SMS ham/spam (text, label; CC BY 4.0)",
    "tasks/wordnet_supersense": "classification: WordNet gloss -> one of 45 supersenses (text, label)",
    "tasks/wordnet_defines": "pair: does gloss text_b define word text_a? (text_a, text_b, label)",
    "tasks/wordnet_pos": "multilabel: every part of speech (noun/verb/adj/adv) a word has (text, label: a list)",
    "tasks/austen_edit_similarity": "regression: 0-5 similarity of a sentence and its edited copy (text_a, text_b)",
    "tasks/austen_ner": "tagging: PER/LOC names in Austen sentences, BIO (tokens, tags)",
    "tasks/wordnet_qa": "qa: 'What does W mean?' over dictionary entries, SQuAD 2.0 (context, question, answers)",
    "tasks/wordnet_reverse_dictionary": "seq2seq: WordNet gloss -> the word it defines (source, target)",
}


def files() -> list[str]:
    """Every bundled data file, as a path relative to the bundle (``"tasks/sms_spam/train.jsonl"``)."""
    return sorted(str(p.relative_to(ROOT)).replace("\\", "/") for d in DATA_DIRS for p in (ROOT / d).rglob("*")
                  if p.is_file() and not p.name.startswith("."))


def path(name: str) -> Path:
    """The installed location of a bundled file or folder, e.g. ``path("tasks/sms_spam/train.jsonl")``.

    Raises:
        FileNotFoundError: naming the closest bundled files.
    """
    p = ROOT / name
    if name and not Path(name).is_absolute() and ".." not in Path(name).parts and p.exists():
        return p
    import difflib

    close = difflib.get_close_matches(name, files() + list(DESCRIPTIONS), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise FileNotFoundError(f"no bundled file {name!r}{hint} (`pretune data bundled` lists them)")


def corpus() -> list[Path]:
    """The bundled pretraining text files (gzip, UTF-8, paragraphs separated by blank lines)."""
    return sorted((ROOT / "corpus").glob("*.txt.gz"))


def tasks() -> list[str]:
    """Names of the bundled labelled data sets (folders under ``tasks/``)."""
    return sorted(p.name for p in (ROOT / "tasks").iterdir() if p.is_dir())


def task(name: str) -> dict[str, Path]:
    """The splits of a bundled task: ``{"train": ..., "dev": ..., "test": ...}`` (JSONL files)."""
    folder = path(f"tasks/{name}")
    return {split: folder / f"{split}.jsonl" for split in ("train", "dev", "test")
            if (folder / f"{split}.jsonl").is_file()}


def copy_to(dest: str | Path) -> list[Path]:
    """Copy the bundled data (and its README with the licence notes) into ``dest``; returns the copied files.
    Existing files of the same name are overwritten; nothing else in ``dest`` is touched."""
    dest = Path(dest)
    out = []
    for name in files() + [NOTICE]:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
        out.append(target)
    return out
