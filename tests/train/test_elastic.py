"""torchrun's restarts (issue 38): a restart of the launch that started a run resumes it with no flag, a restart
before its first checkpoint starts it over, and a launch that did not start the run keeps a first start's rules
(an existing run is refused). The decision in isolation, then through `pretune pretrain` in this process as torchrun
would start it (TORCHELASTIC_RESTART_COUNT set, one process). The real torchrun restarts: tests/train/test_nodes.py."""

import json

import pytest

from pretune.cli import main
from pretune.io.outputs import owned_entries
from pretune.train import elastic
from pretune.train.elastic import LAUNCH_FILE, decide


def _recorded_run(path, agents, *, checkpoint=True):
    path.mkdir()
    (path / "run.yaml").write_text("train: {}\n")
    (path / LAUNCH_FILE).write_text(json.dumps({"agents": agents}))
    if checkpoint:
        (path / "checkpoints" / "step-00000004").mkdir(parents=True)
        (path / "checkpoints" / "step-00000004" / "trainer.pt").write_bytes(b"")
    return path


def test_a_restart_of_the_launch_that_started_the_run_resumes_it(tmp_path):
    run = _recorded_run(tmp_path / "run", ["node-a:100", "node-b:200"])
    assert decide(run, ["node-b:200", "node-c:300"], restart=1, resume=False, overwrite=False)[:2] == (True, False)
    assert decide(run, ["node-a:100"], restart=2, resume=False, overwrite=True)[:2] == (True, False)
    assert decide(run, ["node-a:100"], restart=0, resume=False, overwrite=False) == (False, False, "")  # first start
    # another launch (its first start was refused: the folder holds a run it did not start): the flags as given
    resume, overwrite, note = decide(run, ["node-a:999"], restart=1, resume=False, overwrite=False)
    assert (resume, overwrite) == (False, False) and "holds no run this launch started" in note


def test_a_restart_before_the_first_checkpoint_starts_the_run_over(tmp_path):
    run = _recorded_run(tmp_path / "run", ["node-a:100"], checkpoint=False)
    resume, overwrite, note = decide(run, ["node-a:100"], restart=1, resume=False, overwrite=False)
    assert (resume, overwrite) == (False, True) and "no checkpoint yet; starting it over" in note


def test_pretrain_restarted_by_torchrun_resumes_its_own_run_and_no_other(tmp_path, small_corpus, tokenizers_by_kind,
                                                                         monkeypatch, capsys):
    def pretrain(steps):
        return main(["pretrain", "--preset", "tiny-gpt2", "--objective", "clm", "--tokenizer",
                     str(tokenizers_by_kind["bpe"]), "--data", str(small_corpus), "--out", str(run), "--quiet",
                     f"train.steps={steps}", "train.batch_size=4", "data.block_size=32", "train.save_every=2",
                     "train.eval_every=100", "train.log_every=1", "train.threads=1", "train.plot=false",
                     "train.tensorboard=false"])

    run = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's first start
    assert pretrain(4) == 0
    assert LAUNCH_FILE in owned_entries(run)  # --overwrite removes it with the run
    assert json.loads((run / LAUNCH_FILE).read_text())["agents"] == [elastic.launch_key()]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted: continues (a longer run, as --resume allows)
    assert pretrain(6) == 0
    out = capsys.readouterr().out
    assert "torchrun restart 1: resuming the run" in out and "resumed from step 4" in out
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert steps[-2:] == [5, 6]
    monkeypatch.setattr(elastic, "launch_key", lambda: "elsewhere:1")  # another launch's restart: refused
    assert pretrain(8) == 2
    err = capsys.readouterr().err
    assert "already holds a run (run.yaml): continue it with --resume" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["x", "1.5"])
def test_a_bad_restart_count_is_named(monkeypatch, value):
    from pretune.config import ConfigError

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", value)
    with pytest.raises(ConfigError, match=f"TORCHELASTIC_RESTART_COUNT='{value}': expected a whole number"):
        elastic.restart_count()


def test_torchrun_sharing_its_store_with_processes_it_may_restart_is_warned_about(tmp_path, monkeypatch):
    """pytorch/pytorch#135712: with the rendezvous store shared (torchrun's default), a restarted process may read
    its lost peer's address; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (TORCHELASTIC_USE_AGENT_STORE=False) avoids it."""
    from pretune.train.dist import DistInfo

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    lines = []
    assert elastic.restart_mode(tmp_path, DistInfo(), resume=False, overwrite=False, log=lines.append) == (False,
                                                                                                          False)
    assert lines == [elastic.SHARED_STORE] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not elastic.shares_store()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # nothing restarts: nothing to warn about
    assert not elastic.shares_store()


def test_a_run_stopped_while_preparing_under_torchrun_starts_again_without_a_flag(tmp_path):
    """Killed before its first step (the launch recorded, the token store written, no run.yaml yet): a new start
    needs no --overwrite, as a run stopped while preparing outside torchrun."""
    from pretune.io.outputs import check_folder, mark

    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / LAUNCH_FILE).write_text(json.dumps({"agents": ["node-a:100"]}))
    mark(run, ["data", LAUNCH_FILE])
    assert check_folder(run, what="run") == run
