"""pretune.catalog (the names and one-line help every help text lists) is the registries, name for name and in
order, and the help texts list all of it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import subprocess
import sys

import pytest

from pretune import catalog
from pretune.cli import main
from pretune.interop import _families
from pretune.objectives import OBJECTIVES
from pretune.peft import METHOD_HELP, PeftConfig
from pretune.peft.methods import METHODS
from pretune.tasks import TASKS, TaskConfig

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


# -------------------------------------------------------------------------------------------- owned settings
@pytest.mark.parametrize("base, owners", [(TaskConfig, {n: c.Settings for n, c in TASKS.items()}),
                                          (PeftConfig, {n: m.Settings for n, m in METHODS.items()})])
def test_each_owner_declares_its_settings_and_a_shared_key_has_one_default(base, owners):
    """Every task's and method's Settings extend the shared section; a key two of them have (pair's and
    classification's label_field, prefix's and prompt's n_virtual) has one default, the one a config's bottom layer
    (runconfig.union_defaults) gives it."""
    defaults: dict = {}
    for name, cls in owners.items():
        assert issubclass(cls, base), f"{name}.Settings does not extend {base.__name__}"
        for f in dataclasses.fields(cls):
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if f.name in (base.SELECTOR,):
                continue
            assert defaults.setdefault(f.name, (value, name))[0] == value, \
                f"{f.name}: {defaults[f.name][1]} has default {defaults[f.name][0]!r}, {name} {value!r}"
