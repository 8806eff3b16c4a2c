"""The local tasks' data (lm-eval's ``custom_dataset``): JSONL files beside this one, so nothing is downloaded."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def gloss_word(**_) -> datasets.DatasetDict:
    """32 WordNet glosses (bundled wordnet_reverse_dictionary test split), each with its word among 4 choices."""
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_rows("wordnet_gloss_word.jsonl"))})


def sms_spam(**_) -> datasets.DatasetDict:
    """24 SMS messages (bundled sms_spam test split, 2 ham : 1 spam); ``answer`` 1 for spam."""
    rows = [{**r, "answer": int(r["label"] == "spam")} for r in _rows("sms_spam_yn.jsonl")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
