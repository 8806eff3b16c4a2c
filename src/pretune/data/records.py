"""Labelled records: one row of a JSONL/CSV/TSV/Parquet file with where it came from, and checked field access.

Finetuning tasks, prompting and the benchmarks read their data as records; every error names ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .readers import DataError, iter_records

__all__ = ["Record", "read_records", "get_field"]


@dataclass
class Record:
    """One labelled row: where it came from (``file:line``, the path as given; error messages use it) and its raw
    fields."""

    where: str
    data: dict
    file_fields: frozenset = field(default=None, repr=False, compare=False)  # the fields any record of its file has
    # (read_records fills it in; None: unknown), so a missing field can tell "this row lacks it" from "no row has it"

    @property
    def row(self) -> str:
        """``name:line``, the file's name without its folder (how predictions name their rows)."""
        path, sep, line = self.where.rpartition(":")
        return f"{Path(path).name}{sep}{line}" if sep else self.where


def read_records(path: str | Path, *, errors: str = "strict") -> list[Record]:
    """Every record of a JSONL/CSV/TSV/Parquet file; an empty file is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = [Record(f"{path}:{n}", rec) for n, rec in iter_records(path, errors=errors)]
    fields = frozenset().union(*(r.data for r in records))
    for r in records:
        r.file_fields = fields
    return records


def get_field(rec: Record, name: str, kind: type | tuple[type, ...] = str, *, what: str = "", hint: str = "") -> Any:
    """``rec.data[name]`` checked for presence and type; errors name the row and the fields it has, and, when no
    record of the file has the field, ``hint`` (how to point the reader at another field); when other records have
    it, only this row lacks it."""
    if name in rec.data and rec.data[name] is None:
        raise DataError(f"{rec.where}: field {name!r} is null; expected {what or 'a value'} (drop the record or fill "
                        "it in)")
    if name not in rec.data:
        have = ", ".join(sorted(map(str, rec.data))) or "none"
        others = rec.file_fields is not None and name in rec.file_fields  # then this row lacks it, not the file
        advice = "Other records of the file have it: fill it in or drop the record" if others else hint
        raise DataError(f"{rec.where}: missing field {name!r}{f' ({what})' if what else ''}; the record has: {have}."
                        + (f" {advice}" if advice else ""))
    value = rec.data[name]
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{rec.where}: field {name!r} should be {names}, got {type(value).__name__} {value!r:.60}")
    return value
