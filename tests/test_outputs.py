"""Never lose a user's work: which folders and files pretune may write (pretune.io.outputs), and how it writes into a
folder that also holds the user's own files (checkpoint.atomic_folder)."""

import json
import os

import pytest

import pretune
from pretune.cli import main
from pretune.io.checkpoint import CheckpointError, atomic_folder
from pretune.io.outputs import MARKER, OutputError, check_file, check_folder, clean_run_folder, mark, owned_entries


def _user_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "sub").mkdir()
    (folder / "sub" / "a.csv").write_text("1,2")
    return {"notes.txt": "mine", "sub/a.csv": "1,2"}


def _unchanged(folder, files):
    return all((folder / k).read_text() == v for k, v in files.items())


def test_check_folder_accepts_new_and_empty_folders(tmp_path):
    assert check_folder(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_folder(tmp_path / "empty") == tmp_path / "empty"


def test_check_folder_refuses_the_users_files_naming_them(tmp_path):
    _user_files(tmp_path / "v")
    with pytest.raises(OutputError, match=r"holds what pretune did not write \(notes.txt, sub\).*--overwrite"):
        check_folder(tmp_path / "v")
    assert check_folder(tmp_path / "v", overwrite=True) == tmp_path / "v"  # written beside them


def test_check_folder_refuses_an_earlier_output_and_a_run_without_the_flags(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    mark(out, ["config.json"])
    with pytest.raises(OutputError, match="already holds an earlier pretune output"):
        check_folder(out)
    (out / "run.yaml").write_text("train: {}\n")
    with pytest.raises(OutputError, match=r"already holds a run \(run.yaml\).*--resume.*--overwrite"):
        check_folder(out)
    assert check_folder(out, resume=True) == out
    assert check_folder(out, overwrite=True) == out


def test_a_run_folder_with_only_its_token_store_cache_may_start_again(tmp_path):
    run = tmp_path / "run"
    (run / "data" / "train").mkdir(parents=True)
    mark(run, ["data"])
    assert check_folder(run, what="run") == run  # a run stopped while it tokenized its data
    with pytest.raises(OutputError):
        check_folder(run, what="output")


def test_files_and_parents_that_are_files(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is a file; the output must be a folder"):
        check_folder(tmp_path / "f")
    with pytest.raises(OutputError, match="its parent .*f is a file"):
        check_folder(tmp_path / "f" / "out")
    with pytest.raises(OutputError, match="its parent .*f is a file"):
        check_file(tmp_path / "f" / "p.jsonl")
    with pytest.raises(OutputError, match="already exists; pass --overwrite"):
        check_file(tmp_path / "f")
    assert check_file(tmp_path / "f", overwrite=True) == tmp_path / "f"
    with pytest.raises(OutputError, match="is a folder; the output must be a file path"):
        check_file(tmp_path)


def test_atomic_folder_replaces_its_own_output_and_keeps_the_users(tmp_path):
    out = tmp_path / "out"
    files = _user_files(out)
    with atomic_folder(out) as tmp:
        (tmp / "a.json").write_text("1")
        (tmp / "stale.bin").write_text("old")
    assert owned_entries(out) == {"a.json", "stale.bin"} and _unchanged(out, files)
    with atomic_folder(out) as tmp:  # the next write: a.json replaced, stale.bin (pretune's, not written now) gone
        (tmp / "a.json").write_text("2")
    assert (out / "a.json").read_text() == "2" and not (out / "stale.bin").exists()
    assert owned_entries(out) == {"a.json"} and _unchanged(out, files)
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def test_atomic_folder_never_replaces_a_user_file_of_the_same_name(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("the user's")
    with pytest.raises(CheckpointError, match="holds config.json, which pretune did not write"):
        with atomic_folder(out) as tmp:
            (tmp / "config.json").write_text("{}")
    assert (out / "config.json").read_text() == "the user's"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temp folder left


def test_atomic_folder_on_the_current_folder(tmp_path, monkeypatch):
    files = _user_files(tmp_path / "here")
    monkeypatch.chdir(tmp_path / "here")
    with atomic_folder(".") as tmp:
        (tmp / "x.json").write_text("{}")
    assert (tmp_path / "here" / "x.json").is_file() and _unchanged(tmp_path / "here", files)
    assert sorted(os.listdir(tmp_path)) == ["here"]
    assert sorted(os.listdir(tmp_path / "here")) == [MARKER, "notes.txt", "sub", "x.json"]


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    with atomic_folder(out) as tmp:
        (tmp / "a.json").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_folder(out) as tmp:
            (tmp / "a.json").write_text("2")
            raise RuntimeError("killed")
    assert (out / "a.json").read_text() == "1" and sorted(os.listdir(tmp_path)) == ["out"]


def test_clean_run_folder_removes_what_the_run_wrote_only(tmp_path):
    run = tmp_path / "run"
    files = _user_files(run)
    for name in ("run.yaml", "metrics.jsonl", "results.json"):
        (run / name).write_text("x")
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "data").mkdir()
    (run / "loss.png").write_text("the user's own plot, named like a run's")
    mark(run, ["run.yaml", "metrics.jsonl", "results.json", "checkpoints", "data"])
    removed = clean_run_folder(run)
    assert set(removed) == {"run.yaml", "metrics.jsonl", "results.json", "checkpoints"}
    assert (run / "data").is_dir() and _unchanged(run, files)  # the token-store cache stays for the next run
    assert (run / "loss.png").read_text().startswith("the user's")  # not in the marker: not pretune's
    assert owned_entries(run) == {"data"}


def test_a_run_folder_from_before_markers_is_still_recognised(tmp_path):
    run = tmp_path / "old-run"
    files = _user_files(run)
    for name in ("run.yaml", "metrics.jsonl"):
        (run / name).write_text("x")
    (run / "checkpoints").mkdir()
    assert set(clean_run_folder(run)) == {"run.yaml", "metrics.jsonl", "checkpoints"} and _unchanged(run, files)


def test_overwrite_refuses_to_write_over_a_users_entry_named_like_a_runs(tmp_path):
    from pretune.io.outputs import prepare_run_folder

    run = tmp_path / "proj"
    files = _user_files(run)
    (run / "model").mkdir()
    (run / "model" / "weights.bin").write_text("the user's model")
    (run / "results.json").write_text("{}")
    with pytest.raises(OutputError, match=r"holds model, results.json, which pretune did not write"):
        prepare_run_folder(run, {}, resume=False, overwrite=True, log=lambda *a: None)
    assert (run / "model" / "weights.bin").read_text() == "the user's model" and _unchanged(run, files)
    assert not (run / MARKER).exists() or "model" not in owned_entries(run)
    (run / "model" / "weights.bin").unlink()
    (run / "model").rmdir()
    (run / "results.json").unlink()
    (run / "data").mkdir()  # a user's data folder where pretraining would put its token store
    with pytest.raises(OutputError, match="holds data, which pretune did not write"):
        prepare_run_folder(run, {}, resume=False, overwrite=True, log=lambda *a: None, writes=("data",))
    assert prepare_run_folder(run, {}, resume=False, overwrite=True, log=lambda *a: None) == run  # no store: fine
    assert "data" not in owned_entries(run) and _unchanged(run, files)


def test_atomic_folder_never_moves_an_existing_folder(tmp_path, monkeypatch):
    real = tmp_path / "real"
    with atomic_folder(real) as tmp:
        (tmp / "a.json").write_text("1")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    inode = real.stat().st_ino
    with atomic_folder(link) as tmp:  # a symlink to pretune's own output: written through, still a symlink
        (tmp / "a.json").write_text("2")
    assert link.is_symlink() and (real / "a.json").read_text() == "2" and real.stat().st_ino == inode
    monkeypatch.chdir(real)
    with atomic_folder(".") as tmp:  # the current folder, holding only pretune's output: stays where it is
        (tmp / "b.json").write_text("3")
    assert os.getcwd() == str(real) and real.stat().st_ino == inode and sorted(os.listdir(real)) == [MARKER, "b.json"]
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_files_written_beside_a_saved_model_are_recorded(tmp_path):
    from pretune.jobs.inference import save_task
    from pretune.tasks.base import TaskConfig

    pretune.save(pretune.build_model("tiny-bert-base"), tmp_path / "m")
    save_task(tmp_path / "m", TaskConfig(name="classification"))
    assert owned_entries(tmp_path / "m") == {"config.json", "model.safetensors", "task.json"}


def test_the_quickstart_refuses_a_users_entry_among_its_names(tmp_path, capsys):
    out = tmp_path / "qs"
    files = _user_files(out)
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("the user's")
    assert main(["quickstart", "--out", str(out), "--fast", "--quiet", "--overwrite"]) == 2
    assert "holds data, which pretune did not write" in capsys.readouterr().err
    assert (out / "data" / "train.jsonl").read_text() == "the user's" and _unchanged(out, files)


def test_convert_overwrite_writes_beside_the_users_files_and_replaces_its_own(tmp_path, capsys):
    pretune.save(pretune.build_model("tiny-bert-base"), tmp_path / "ours")
    victim = tmp_path / "victim"
    files = _user_files(victim)
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(victim)]) == 2
    assert "notes.txt" in capsys.readouterr().err and _unchanged(victim, files)
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(victim), "--overwrite"]) == 0
    assert (victim / "config.json").is_file() and _unchanged(victim, files)
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(victim)]) == 2  # still the user's
    assert "notes.txt" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 2  # its own: ask
    assert "already holds an earlier pretune output" in capsys.readouterr().err
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(victim), "--overwrite"]) == 0
    assert json.loads((victim / MARKER).read_text())["entries"] == sorted(owned_entries(victim))
    assert _unchanged(victim, files)


def test_written_files_get_the_users_permissions_not_0600(tmp_path):
    from pretune.train.logging import plot_losses  # noqa: F401 - one of the mkstemp writers

    umask = os.umask(0o022)
    try:
        pretune.save(pretune.build_model("tiny-bert-base"), tmp_path / "m")  # safetensors writes 0600 files
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    finally:
        os.umask(umask)
    assert modes["model.safetensors"] == modes["config.json"] == 0o644


def test_write_atomic_writes_whole_files_with_umask_permissions_and_leaves_nothing_on_failure(tmp_path):
    import os

    from pretune.io.outputs import write_atomic

    f = tmp_path / "sub" / "out.json"
    write_atomic(f, "é\n")
    assert f.read_text(encoding="utf-8") == "é\n"
    umask = os.umask(0)
    os.umask(umask)
    assert f.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    write_atomic(f, b"\x00\x01")
    assert f.read_bytes() == b"\x00\x01"

    def broken(fh):
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(f, broken)
    assert f.read_bytes() == b"\x00\x01"  # the old file, whole
    assert [p.name for p in f.parent.iterdir()] == ["out.json"]  # no temporary file left
