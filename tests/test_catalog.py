"""pretune.catalog (the names and one-line help every help text lists) is the registries, name for name and in
order, and the help texts list all of it."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from pretune import catalog
from pretune.cli import main
from pretune.interop import _families
from pretune.objectives import OBJECTIVES
from pretune.peft import METHOD_HELP
from pretune.peft.methods import METHODS
from pretune.tasks import TASKS

REGISTRIES = {"objectives": (catalog.OBJECTIVES, OBJECTIVES), "tasks": (catalog.TASKS, TASKS),
              "peft methods": (catalog.PEFT_METHODS, METHODS), "families": (catalog.FAMILIES, _families())}


@pytest.mark.parametrize("kind", REGISTRIES)
def test_the_catalog_is_the_registry(kind):
    listed, registry = REGISTRIES[kind]
    assert list(listed) == list(registry), f"pretune/catalog.py's {kind} differ from the registry's"
    for name, text in listed.items():
        assert text and "\n" not in text and len(text) <= 110, f"{kind} {name}: one line of help"


def test_the_peft_method_help_is_the_catalogs():
    assert METHOD_HELP == catalog.PEFT_METHODS


def test_the_catalog_imports_nothing_heavy():
    code = "import sys, pretune.catalog; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'numpy', 'transformers', 'omegaconf')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _help(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return buf.getvalue()


def test_finetune_help_names_every_task_and_method():
    text = _help("finetune")
    for name in TASKS:
        assert f"\n  {name} " in text, f"`pretune finetune --help` does not list task {name}"
    for name in METHODS:
        assert f"\n  {name} " in text, f"`pretune finetune --help` does not list PEFT method {name}"
    top = " ".join(_help().split())  # `pretune --help`: the finetune line names every task, the pretrain line every
    for name in [*TASKS, *OBJECTIVES]:  # objective
        assert name in top, name


@pytest.mark.parametrize("argv, names", [(("pretrain",), OBJECTIVES), (("convert",), _families()),
                                         (("peft",), METHODS)])
def test_help_lists_every_entry(argv, names):
    text = _help(*argv)
    missing = [n for n in names if f"\n  {n} " not in text]
    assert not missing, f"`pretune {' '.join(argv)} --help` does not list {missing}"
