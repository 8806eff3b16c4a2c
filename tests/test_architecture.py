"""The package's shape, read from its code: imports go down the layers of docs/architecture.md (no cycles,
counting imports inside functions), and architecture knowledge stays in the model package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "pretune"
DOC = ROOT / "docs" / "architecture.md"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every pretune module ``name`` imports, at module level or inside functions (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` imports never run
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            parent = pkg[: len(pkg) - node.level + 1] if node.level else []
            base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layers() -> dict[str, tuple[str, list[str]]]:
    """The layer table of docs/architecture.md: layer -> (the modules in it, the layers it may import)."""
    text = DOC.read_text()
    table = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        layer, modules, may = cells
        out[layer.strip("`")] = (re.findall(r"`([\w.*]+)`", modules), re.findall(r"`([\w]+)`", may))
    return out


LAYERS = _layers()


def _layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, (patterns, _) in LAYERS.items():
        for pat in patterns:
            prefix = pat[:-2] if pat.endswith(".*") else pat
            inside = module == prefix or (pat.endswith(".*") and module.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if _layer_of(m) is None]
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


FOLDERS = sorted({".".join(m.split(".")[:2]) for m, p in MODULES.items()
                  if p.parent != PKG})  # pretune.jobs, pretune.io, ...: the folders of src/pretune/


def test_the_layers_go_by_folder():
    """A row names a folder whole (``pretune.jobs.*``) or a module at the package root: no folder is split
    between layers, and a new module in a folder takes the folder's layer."""
    bad = []
    for layer, (patterns, _) in LAYERS.items():
        for pat in patterns:
            name = pat.removesuffix(".*")
            if pat.endswith(".*") and name not in FOLDERS:
                bad.append(f"{layer}: {pat} is not a folder of src/pretune/")
            if not pat.endswith(".*") and name != "pretune" and (name in FOLDERS or name.count(".") != 1):
                bad.append(f"{layer}: {pat} names a folder or a module inside one (write {name.split('.')[0]}."
                           f"{name.split('.')[1]}.* for the folder)")
    assert not bad, "\n".join(bad)
    layers_of = {f: {_layer_of(m) for m in MODULES if m == f or m.startswith(f + ".")} for f in FOLDERS}
    assert all(len(v) == 1 for v in layers_of.values()), layers_of


def _against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, targets in graph.items():
        layer = _layer_of(m)
        allowed = set(LAYERS[layer][1]) | {layer}
        for t in sorted(targets):
            if _layer_of(t) not in allowed:
                bad.append(f"{m} ({layer}) imports {t} ({_layer_of(t)})")
    return bad


def test_imports_follow_the_layers():
    bad = _against_the_layers(GRAPH)
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_the_layer_check_catches_an_import_up():
    """An input/output module importing a job, a job importing the CLI or a study, and a new module in a folder
    taking its folder's layer: the check sees each."""
    assert _layer_of("pretune.jobs.new_job") == "jobs" and _layer_of("pretune.io.new_format") == "io"
    graph = {"pretune.io.checkpoint": {"pretune.jobs.finetune"}, "pretune.jobs.new_job": {"pretune.cli"},
             "pretune.jobs.finetune": {"pretune.sweep.engine", "pretune.tasks.run"},
             "pretune.generation.decode": {"pretune.cli.generate"}}
    assert _against_the_layers(graph) == [
        "pretune.io.checkpoint (io) imports pretune.jobs.finetune (jobs)",
        "pretune.jobs.new_job (jobs) imports pretune.cli (cli)",
        "pretune.jobs.finetune (jobs) imports pretune.sweep.engine (studies)",
        "pretune.generation.decode (generation) imports pretune.cli.generate (cli)"]


def test_no_import_cycles():
    cycles = []
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# --------------------------------------------------------------------------------------- architecture knowledge
ARCH_OWNERS = ("pretune.model", "pretune.interop", "pretune.config", "pretune.presets")


def _compares_arch(node: ast.AST) -> bool:
    def is_arch(n):
        return (isinstance(n, ast.Attribute) and n.attr == "arch") or (isinstance(n, ast.Name) and n.id == "arch")

    if isinstance(node, ast.Compare):
        return any(is_arch(x) for x in [node.left, *node.comparators])
    if isinstance(node, ast.Subscript):  # {"encoder": ...}[cfg.arch]
        return is_arch(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return any(is_arch(a) for a in node.args)  # MAPPING.get(cfg.arch)
    return False


def test_only_the_model_package_decides_by_arch():
    """Objectives, tasks, generation, scoring, embedding and the jobs ask the model's layout (model/layout.py)
    instead of comparing ``cfg.arch`` themselves."""
    offenders = []
    for m, path in MODULES.items():
        if m.startswith(ARCH_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _compares_arch(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"code outside {ARCH_OWNERS} decides by arch: {offenders}"


def test_the_checks_catch_what_they_forbid(tmp_path):
    """The AST checks themselves: an arch comparison and a function-level import are seen."""
    src = "def f(cfg):\n    from .model import layout\n    return cfg.arch == 'decoder' or {'a': 1}[cfg.arch]\n"
    tree = ast.parse(src)
    assert sum(_compares_arch(n) for n in ast.walk(tree)) == 2
    (tmp_path / "x.py").write_text(src)
    assert "pretune.model" in _imports("pretune.x", tmp_path / "x.py")


@pytest.mark.parametrize("registry,module", [
    ("OBJECTIVES", "pretune.objectives"), ("TASKS", "pretune.tasks"), ("METHODS", "pretune.peft.methods"),
    ("POSITIONS", "pretune.model.position"), ("FFNS", "pretune.model.layers"), ("NORMS", "pretune.model.layers"),
    ("ACTIVATIONS", "pretune.model.layers"), ("HEADS", "pretune.model.heads"), ("LAYOUTS", "pretune.model.layout"),
    ("PRESETS", "pretune.presets")])
def test_the_documented_registries_exist(registry, module):
    import importlib

    assert registry in DOC.read_text()
    assert isinstance(getattr(importlib.import_module(module), registry), dict)


# ------------------------------------------------------------------------------------------------ the fast wing
REFERENCE_FILES = ("transformer", "attention", "layers", "position", "cache", "heads")
SPEED_MACHINERY = ("mkldnn", "_linear_pointwise", "autograd.Function", "FusedLinears", "_StackedLinear", "onednn",
                   "_fused_qkv", "fused_ce")


def test_only_the_model_package_and_generation_import_the_fast_wing():
    """model/fast/ is swapped in by the model package's __init__ (``accelerate``) and its flat decoding step is used
    by generation; no other module reaches into it (the reference files least of all)."""
    bad = [f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
           if (t == "pretune.model.fast" or t.startswith("pretune.model.fast."))
           and not (m.startswith("pretune.model.fast") or m == "pretune.model" or m.startswith("pretune.generation"))]
    assert not bad, "\n".join(bad)


def test_the_reference_model_files_name_no_speed_machinery():
    """The reference files say what the maths is, one path per module: fused or stacked weights, written-out
    backwards and kernels picked per CPU live in model/fast/ (comments included)."""
    bad = []
    for name in REFERENCE_FILES:
        text = (PKG / "model" / f"{name}.py").read_text()
        bad += [f"model/{name}.py names {word!r}" for word in SPEED_MACHINERY if word in text]
    assert not bad, "\n".join(bad)
