"""Trackers (train.report_to): the rows of metrics.jsonl in MLflow and W&B (offline), the config as parameters, the
plots and results.json as artifacts; a tracker that fails never stops training; only process 0 tracks."""

import json
import socket
import struct
import sys
import warnings
from pathlib import Path

import pytest

from pretune.config import ConfigError
from pretune.io.outputs import owned_entries
from pretune.jobs.finetune import finetune, load_finetune_config
from pretune.jobs.pretrain import load_run_config, pretrain
from pretune.runconfig import TrainConfig, check_resume, section
from pretune.train.logging import read_metrics
from pretune.train.state import list_checkpoints
from pretune.train.trackers import RECORD_FILE, Trackers, open_trackers

QUIET = dict(show_progress=False, log=lambda *a: None)


@pytest.fixture
def tracker_env(monkeypatch):
    """No tracker settings from the machine running the tests."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_report_to_names_the_trackers_and_tensorboard_is_an_alias():
    def trackers(**values):
        return section("train", TrainConfig, values).trackers

    assert trackers() == ("tensorboard",)  # pretraining's default, as train.tensorboard=true was
    assert trackers(report_to=["mlflow", "wandb", "mlflow"]) == ("mlflow", "wandb")
    assert trackers(report_to="wandb") == ("wandb",)  # `train.report_to=wandb` on the command line
    assert trackers(report_to=["mlflow"], tensorboard=True) == ("tensorboard", "mlflow")  # true adds it
    assert trackers(report_to=["tensorboard", "mlflow"], tensorboard=False) == ("mlflow",)  # false removes it
    assert load_finetune_config(None, []).train.trackers == ()  # finetuning: none by default, as before
    with pytest.raises(ConfigError, match=r"train.report_to='mlfow' is not one of .*did you mean 'mlflow'"):
        section("train", TrainConfig, {"report_to": ["mlfow"]})
    with pytest.raises(ConfigError, match="train.tensorboard='yes': expected true or false or null"):
        section("train", TrainConfig, {"tensorboard": "yes"})
    # logging settings: a resumed run may change them (a run.yaml from before report_to lacks the keys)
    assert check_resume({"train": {"tensorboard": True}}, {"train": {"tensorboard": None, "report_to": ["mlflow"]}},
                        source="run.yaml")


def test_a_missing_package_names_it_and_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    train = section("train", TrainConfig, {"report_to": ["wandb"]})
    with pytest.raises(ConfigError, match=r"the wandb package is not installed .*pip install 'pretune\[track\]'"):
        open_trackers(train, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_only_process_0_tracks(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not even imported on the other processes
    train = section("train", TrainConfig, {"report_to": ["mlflow", "wandb"]})
    trackers = open_trackers(train, tmp_path / "run", enabled=False)
    assert trackers.runs == [] and not (tmp_path / "run").exists()
    trackers.log(1, "train", {"loss": 1.0})  # nothing to reach, nothing raised
    trackers.close()


def test_a_tracker_failing_mid_run_warns_once_and_is_dropped():
    class Failing:  # what a tracker does when its server goes away after the run started
        name = "mlflow"

        def __init__(self):
            self.calls = 0

        def log(self, step, split, values):
            self.calls += 1
            raise ConnectionError("server gone")

    run = Failing()
    trackers = Trackers([run])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 4):
            trackers.log(step, "train", {"loss": 1.0})
        trackers.close()
    assert run.calls == 1 and trackers.runs == []
    assert [str(w.message) for w in caught] == [
        "mlflow tracking failed (logging step 1: ConnectionError: server gone); training goes on without it, "
        "metrics.jsonl keeps every row"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: nothing listens there


def test_an_unreachable_mlflow_server_warns_once_and_the_run_finishes(tmp_path, small_corpus, tokenizers_by_kind,
                                                                     tracker_env):
    tracker_env.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    tracker_env.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once instead of MLflow's backoff
    tracker_env.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    cfg = load_run_config(overrides=[
        "model.preset=tiny-bert-base", "objective.name=mlm", f"tokenizer={tokenizers_by_kind['wordpiece']}",
        f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", f"data.store={tmp_path / 'store'}",
        "data.block_size=32", "model.max_seq_len=64", "train.steps=3", "train.batch_size=4", "train.log_every=1",
        "train.eval_every=0", "train.keep_last=1", "train.report_to=[mlflow]", "train.plot=false"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = pretrain(cfg, **QUIET)
    about = [str(w.message) for w in caught if "mlflow" in str(w.message)]
    assert len(about) == 1 and about[0].startswith("mlflow tracking could not start"), about
    assert result.steps == 3 and (result.model_dir / "model.safetensors").is_file()
    assert [c.name for c in list_checkpoints(result.run_dir)] == ["step-00000003"]
    assert [r["step"] for r in read_metrics(result.run_dir) if r["split"] == "train"] == [1, 2, 3]
    assert json.loads((result.run_dir / RECORD_FILE).read_text()) == {}  # no tracked run to resume


def _wandb_records(path):
    """The records of a W&B offline run file (``run-ID.wandb``): its LevelDB-style log of 32 KiB blocks, each record
    split into chunks with a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last) after a 7-byte
    file header (``:W&B``, magic, version) — what ``wandb sync`` reads."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the zero padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _jsonl_series(rows):
    """{"split/metric": [(step, value), ...]} from metrics.jsonl's rows."""
    out = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "split"):
                out.setdefault(f"{r['split']}/{k}", []).append((r["step"], v))
    return out


def test_mlflow_and_wandb_hold_the_rows_of_metrics_jsonl(tmp_path, sentences_data, tokenizers_by_kind, tracker_env):
    from mlflow.tracking import MlflowClient

    # the user's MLflow store, which pretune uses as it is: a file store here (created in milliseconds; a new sqlite
    # store, the default in the run folder, takes 7-10 s to create its tables: the slow tests below use that one)
    store = (tmp_path / "mlruns").as_uri()
    tracker_env.setenv("MLFLOW_TRACKING_URI", store)
    tracker_env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.13 refuses file stores without it
    run_dir = tmp_path / "run"
    cfg = load_finetune_config(None, [
        "model.preset=tiny-bert-base", f"tokenizer={tokenizers_by_kind['wordpiece']}", "task.name=classification",
        f"data.train={sentences_data['train']}", f"data.dev={sentences_data['dev']}",
        f"data.test={sentences_data['test']}", f"train.out={run_dir}", "train.batch_size=8", "tune.epochs=0",
        "train.steps=4", "train.eval_every=2", "train.log_every=1", "train.lr=2e-3",
        "train.report_to=[mlflow,wandb]", "train.tags=[smoke]", "train.group=g1"])
    result = finetune(cfg, **QUIET)
    rows = read_metrics(run_dir)
    series = _jsonl_series(rows)
    assert {r["split"] for r in rows} == {"train", "eval"} and "eval/dev_accuracy" in series
    assert {RECORD_FILE, "wandb"} <= owned_entries(run_dir)  # --overwrite removes them
    assert not (run_dir / "mlruns.db").exists()  # $MLFLOW_TRACKING_URI wins

    # MLflow: the run in the user's store, each metric's history equal to the JSONL's rows
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("pretune").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.tags["pretune.job"] == "finetune" and run.data.tags["pretune.group"] == "g1"
    assert "smoke" in run.data.tags
    assert run.data.params["train.steps"] == "4" and run.data.params["task.name"] == "classification"
    for key, points in series.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == points, key
    assert set(run.data.metrics) == set(series)
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "loss.png", "run.yaml"} <= artifacts
    results = json.loads((run_dir / "results.json").read_text())
    assert results["test"] == result.test

    # W&B offline: the run's file holds one history row per JSONL row, the name, group and tags, the saved files
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    records = list(_wandb_records(next(offline.glob("run-*.wandb"))))
    kinds = [r.WhichOneof("record_type") for r in records]
    head = records[kinds.index("run")].run
    assert (head.display_name, head.run_group, list(head.tags), head.job_type) == ("run", "g1", ["smoke"], "finetune")
    config = {u.key: json.loads(u.value_json) for u in head.config.update}
    assert config["train"]["steps"] == 4 and config["task"]["name"] == "classification"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [{k: v for k, v in h.items() if not k.startswith("_")} for h in history] == [
        {"step": r["step"], **{f"{r['split']}/{k}": v for k, v in r.items() if k not in ("step", "split")}}
        for r in rows]
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert {"results.json", "loss.png", "run.yaml"} <= saved
    assert (offline / "files" / "results.json").read_text() == (run_dir / "results.json").read_text()
    assert head.run_id == json.loads((run_dir / RECORD_FILE).read_text())["wandb"]["id"]


@pytest.fixture
def sentences_data(tmp_path):
    """A small labelled set of real sentences (long or short)."""
    from conftest import corpus_paragraphs

    sents = [s.strip() + "." for p in corpus_paragraphs("austen.txt.gz", 60)
             for s in p.replace("\n", " ").split(".") if len(s.split()) >= 4][:72]
    rows = [{"text": s, "label": "long" if len(s.split()) > 14 else "short"} for s in sents]
    out = {}
    for name, part in (("train", rows[:48]), ("dev", rows[48:60]), ("test", rows[60:72])):
        out[name] = tmp_path / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    return out


@pytest.mark.slow  # its own sqlite store and two runs (about 15 s on 2 cores)
def test_the_run_folders_store_and_a_resumed_run_goes_on_in_the_same_tracked_runs(tmp_path, small_corpus,
                                                                                  tokenizers_by_kind, tracker_env):
    from mlflow.tracking import MlflowClient

    def cfg(steps):
        return load_run_config(overrides=[
            "model.preset=tiny-bert-base", "objective.name=mlm", f"tokenizer={tokenizers_by_kind['wordpiece']}",
            f"data.train=[{small_corpus}]", f"train.out={tmp_path / 'run'}", f"data.store={tmp_path / 'store'}",
            "data.block_size=32", "model.max_seq_len=64", f"train.steps={steps}", "train.batch_size=4",
            "train.log_every=1", "train.eval_every=0", "train.save_every=2", "train.keep_last=1", "train.plot=false",
            "train.report_to=[mlflow,wandb]"])

    pretrain(cfg(2), **QUIET)
    first = json.loads((tmp_path / "run" / RECORD_FILE).read_text())
    assert {"mlruns.db", "mlartifacts", "wandb"} <= owned_entries(tmp_path / "run")  # --overwrite removes them
    pretrain(cfg(4), resume=True, **QUIET)  # a longer run, continued from its step-2 checkpoint
    again = json.loads((tmp_path / "run" / RECORD_FILE).read_text())
    assert again["mlflow"] == first["mlflow"] and again["wandb"]["id"] == first["wandb"]["id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlruns.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretune").experiment_id])
    assert run.info.run_id == first["mlflow"]["run_id"] and run.info.status == "FINISHED"
    rows = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (r["step"], r["loss"]) for r in rows] and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert run.data.params["train.steps"] == "2"  # parameters stay as first logged; run.yaml holds the new ones
    assert "run.yaml" in {f.path for f in client.list_artifacts(run.info.run_id)}  # the artifacts: in mlartifacts/
    # W&B offline cannot reopen a run: the second part is a second folder under the same run id (wandb sync both)
    folders = sorted(str(p) for p in (tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert folders == sorted([first["wandb"]["dir"], again["wandb"]["dir"]]) and len(set(folders)) == 2
    assert all(first["wandb"]["id"] in Path(f).name for f in folders)
