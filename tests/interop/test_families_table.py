"""docs/convert.md's families table (between ``<!-- families -->`` and ``<!-- /families -->``) is true.

One row per Hugging Face ``model_type``: ``import`` (the transformers classes pretune.from_hf reads), ``export`` (the
class pretune.to_hf writes for each pretune head, ``Class (head, head + flag)``) and ``presets`` (the non-tiny presets
that export as that family). Checked against the code: the rows are exactly interop._families(); every preset that
exports is in its family's row and no other; every class exists in transformers; a tiny model with each head a row
claims exports to that class (config.json's ``architectures``) and imports back with that head, and a head the row
does not claim does not export as the family; transformers' own random-weight model of each ``import`` class
imports. A new family, head or preset makes this fail until the table says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pretune.config import TASK_HEADS, ConfigError
from pretune.interop import InteropError, _families, _family_for_config, from_hf, to_hf
from pretune.model import build_model
from pretune.presets import PRESETS, get_preset

T = pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "convert.md"
COLUMNS = ["family", "import", "export", "presets"]
HEADS = ("none", "lm", "mlm", "rtd", *TASK_HEADS)
FLAGS = ("pair_head",)  # boolean ModelConfig fields an export entry may add to its head ("mlm + pair_head")
NUM_LABELS = {"classification": 3, "regression": 1, "tagging": 5, "qa": 2}

# a tiny config of each model_type: (preset, overrides); a new family needs a line here
TINY = {
    "bert": ("tiny-bert-base", {}), "roberta": ("tiny-roberta-base", {}), "distilbert": ("tiny-distilbert-base", {}),
    "albert": ("tiny-albert-base", {}), "electra": ("tiny-electra-small", {}),
    "deberta-v2": ("tiny-deberta-v3-xsmall", {}), "modernbert": ("tiny-modernbert-base", {}),
    "openai-gpt": ("tiny-gpt", {"ffn_dim": 128}),  # GPT-1's MLP is 4 x dim wide; the tiny twin's is not
    "gpt2": ("tiny-gpt2", {}), "llama": ("tiny-llama", {}), "qwen2": ("tiny-llama", {"qkv_bias": True}),
    "qwen3": ("tiny-llama", {"qk_norm": True, "head_dim": 12}), "mistral": ("tiny-llama", {"sliding_window": 4}),
    "gemma": ("tiny-llama", {"norm": "rmsnorm_plus_one", "ffn": "geglu_tanh", "scale_embeddings": True}),
    "gemma2": ("tiny-llama", {"norm": "rmsnorm_plus_one", "ffn": "geglu_tanh", "scale_embeddings": True,
                              "norm_placement": "sandwich", "sliding_window": 4, "sliding_layers": [0]}),
    "t5": ("tiny-t5-small", {}), "bart": ("tiny-bart-base", {}),
}
# what a sequence head needs beyond the tiny config to read the sentence vector the family's class reads
SEQ = {"bert": {"pooler": True}}


def _cells(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), f"not a table row: {line!r}"
    return [c.strip() for c in line[1:-1].split("|")]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _table() -> dict[str, dict]:
    """model_type -> {"types", "import": [class], "export": {class: [(head, flags)]}, "presets": [name]}."""
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- families -->\n(.*?)<!-- /families -->", text, flags=re.S)
    assert len(blocks) == 1, f"{DOC}: expected one <!-- families --> ... <!-- /families --> block, got {len(blocks)}"
    lines = [line.strip() for line in blocks[0].strip().splitlines()]
    assert _cells(lines[0]) == COLUMNS, f"header {lines[0]!r}"
    assert all(set(c) <= set("-: ") for c in _cells(lines[1])), f"separator {lines[1]!r}"
    rows: dict[str, dict] = {}
    for line in lines[2:]:
        cells = dict(zip(COLUMNS, _cells(line), strict=True))
        types = _names(cells["family"])
        assert types, f"no model_type in {line!r}"
        export: dict[str, list[tuple[str, dict]]] = {}
        entries = re.findall(r"`(\w+)`\s*\(([^)]*)\)", cells["export"])
        assert [cls for cls, _ in entries] == _names(cells["export"]), f"{types}: export entries are `Class` (heads)"
        for cls, heads in entries:
            for spec in heads.split(","):
                head, *flags = [w.strip().strip("`") for w in spec.split("+")]
                assert head in HEADS and set(flags) <= set(FLAGS), f"{types}: unknown head {spec.strip()!r} ({cls})"
                export.setdefault(cls, []).append((head, dict.fromkeys(flags, True)))
        row = {"types": types, "import": _names(cells["import"]), "export": export,
               "presets": _names(cells["presets"])}
        for mt in types:
            assert mt not in rows, f"model_type {mt!r} has two rows"
            rows[mt] = row
    return rows


TABLE = _table()
ROWS = {row["types"][0]: row for row in TABLE.values()}  # one entry per row


def _build(mt: str, head: str, flags: dict | None = None):
    assert mt in TINY, f"add a tiny config of {mt!r} to TINY in this file"
    preset, overrides = TINY[mt]
    fields = {**overrides, "head": head, "pair_head": False, **(flags or {})}
    if head in NUM_LABELS:
        fields["num_labels"] = NUM_LABELS[head]
    if head in ("classification", "regression"):
        fields.update(SEQ.get(mt, {}))
    return build_model(preset, **fields)


def _exported_type(cfg) -> str | None:
    """The model_type a config exports as, or None when no family takes it."""
    try:
        return _family_for_config(cfg).config_to_hf(cfg)["model_type"]
    except InteropError:
        return None


def test_the_table_has_a_row_per_family():
    table, code = set(TABLE), set(_families())
    assert table == code, f"only in the table: {sorted(table - code)}; only in the code: {sorted(code - table)}"


def test_presets_are_in_the_row_of_the_family_they_export_as():
    named = [p for row in ROWS.values() for p in row["presets"]]
    assert len(named) == len(set(named)), f"a preset in two rows: {named}"
    for name in named:
        assert name in PRESETS and not name.startswith("tiny-"), f"{name!r}: not a preset (or a tiny- twin)"
    want: dict[str, set[str]] = {mt: set() for mt in ROWS}
    for name in PRESETS:
        mt = None if name.startswith("tiny-") else _exported_type(get_preset(name))
        if mt is not None:
            want[TABLE[mt]["types"][0]].add(name)
    wrong = {mt: {"missing": sorted(want[mt] - set(row["presets"])), "extra": sorted(set(row["presets"]) - want[mt])}
             for mt, row in ROWS.items() if set(row["presets"]) != want[mt]}
    assert not wrong, f"presets column vs the family each preset exports as: {wrong}"


def test_every_class_named_exists_in_transformers():
    named = {cls for row in ROWS.values() for cls in [*row["import"], *row["export"]]}
    missing = sorted(cls for cls in named if not hasattr(T, cls))
    assert not missing, f"not in transformers {T.__version__}: {missing}"


@pytest.mark.parametrize("mt", list(ROWS))
def test_each_head_exports_as_the_class_the_row_names(mt, tmp_path):
    row = ROWS[mt]
    claimed = set()
    for cls, heads in row["export"].items():
        assert cls in row["import"], f"{mt}: {cls} is exported but not in the import column"
        for head, flags in heads:
            claimed.add(head)
            folder = tmp_path / "-".join([head, *flags])
            to_hf(_build(mt, head, flags), folder)
            hf = json.loads((folder / "config.json").read_text())
            assert hf["model_type"] in row["types"] and hf["architectures"] == [cls], \
                f"{mt} head={head}: exported as {hf['model_type']} {hf['architectures']}"
            back = from_hf(folder).config
            assert (back.head, back.pair_head) == (head, flags.get("pair_head", False)), f"{mt}: {cls} re-imported"
    for head in set(HEADS) - claimed:  # a head the row does not claim does not export as this family
        try:
            cfg = _build(mt, head).config
        except ConfigError:
            continue
        assert _exported_type(cfg) not in row["types"], f"{mt}: head={head!r} exports; add it to the table"


@pytest.mark.parametrize("mt", list(ROWS))
def test_transformers_models_of_each_import_class_import(mt, tmp_path):
    row = ROWS[mt]
    cls, [(head, flags), *_] = next(iter(row["export"].items()))
    to_hf(_build(mt, head, flags), tmp_path / "export")
    config = T.AutoConfig.from_pretrained(tmp_path / "export")
    for name in row["import"]:
        model = getattr(T, name)(config)
        model.save_pretrained(tmp_path / name)
        try:
            from_hf(tmp_path / name)
        except Exception as e:  # noqa: BLE001 - any refusal fails the row, naming the class
            pytest.fail(f"{mt}: {name} (transformers' random-weight model) does not import: {e}")
