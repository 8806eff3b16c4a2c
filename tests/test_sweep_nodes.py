"""Multi-node sweep trials (issue 38, ``pretune sweep --slurm-nodes N``): the flags become submitit's ``nodes=N,
tasks_per_node=1``, the job Slurm gets asks for them (submitit's own mocked Slurm: no cluster here), and each node's
task runs a torchrun launch with the rendezvous on the allocation's first node; bad combinations are named. Slow: a
real sweep of two-node trials through submitit's local executor (two launchers on this machine, loopback)."""

import json
import sys

import pytest

from pretune.cli import build_parser
from pretune.cli.sweep import cluster_parameters
from pretune.config import ConfigError
from pretune.sweep import run_sweep
from pretune.sweep.nodes import launch_settings, node_command, node_log, rendezvous_port, torchrun_command
from test_sweep import QUIET, _spec, data  # noqa: F401 - data: the fixture, by name

submitit = pytest.importorskip("submitit")
TRIAL = [sys.executable, "-m", "pretune", "finetune", "--config", "sw/configs/t.yaml", "train.threads=4", "--quiet"]


def _params(*flags):
    return cluster_parameters(build_parser().parse_args(["sweep", "spec.yaml", "--executor", "slurm", *flags]))


def test_slurm_nodes_submit_one_task_per_node_whose_command_is_a_torchrun_launch(tmp_path, monkeypatch):
    from submitit.core.test_core import MockedSubprocess

    from pretune.sweep.engine import Submitit
    from pretune.sweep.nodes import run_on_nodes

    params = _params("--slurm-nodes", "2", "--slurm-gpus", "4", "--slurm-cpus", "16", "--slurm-time", "2:00:00")
    launch = launch_settings(params, executor="slurm", command="finetune")
    assert params == {"nodes": 2, "tasks_per_node": 1, "gpus_per_node": 4, "cpus_per_task": 16, "timeout_min": 120}
    assert launch == {"nproc_per_node": 4, "host": None, "per_machine": 4}
    mock = MockedSubprocess(known_cmds=["srun"])  # submitit's stand-in for sbatch / sacct (its own tests use it)
    with mock.context():
        job, _ = Submitit(tmp_path / "submitit", "slurm", params, launch=launch).start(
            TRIAL, {"OMP_NUM_THREADS": "4"}, tmp_path / "t.log")
    sbatch = job.paths.submission_file.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=16", "#SBATCH --time=120"):
        assert line in sbatch, sbatch
    call = job.submission()  # what every task (node) of the job calls
    assert call.function is run_on_nodes and call.args == (TRIAL,)
    assert call.kwargs["nproc_per_node"] == 4 and call.kwargs["host"] is None
    # inside the job, on its second node: Slurm's environment as srun gives it to task 1 of 2
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": job.job_id, "SLURM_NTASKS": "2",
                       "SLURM_PROCID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                       "SLURM_JOB_NODELIST": "gpu-[07-08]"}.items():
        monkeypatch.setenv(key, value)
    port = rendezvous_port(job.job_id)
    assert port == 20000 + int(job.job_id) % 20000
    assert node_command(TRIAL, nproc_per_node=call.kwargs["nproc_per_node"], host=call.kwargs["host"]) == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"gpu-07:{port}", "--rdzv-id", f"pretune-{job.job_id}",
        "-m", "pretune", "finetune", "--config", "sw/configs/t.yaml", "train.threads=4", "--quiet"]
    assert node_log(tmp_path / "t.log", 1) == tmp_path / "t.node1.log"


def test_the_local_executor_rehearses_the_nodes_on_this_machine():
    params = {"nodes": 3, "timeout_min": 5}
    assert launch_settings(params, executor="local", command="pretrain") == {"nproc_per_node": 1,
                                                                             "host": "127.0.0.1", "per_machine": 3}
    assert params == {"tasks_per_node": 3, "timeout_min": 5}  # submitit's local executor runs one machine
    assert launch_settings({"timeout_min": 5}, executor="slurm", command="finetune") is None  # no --slurm-nodes
    assert torchrun_command(TRIAL, nnodes=3, nproc_per_node=1, node_rank=0, host="127.0.0.1", port=20001,
                            run_id="pretune-7", local_addr="127.0.0.1")[3:17] == [
        "--nnodes", "3", "--nproc-per-node", "1", "--node-rank", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        "127.0.0.1:20001", "--rdzv-id", "pretune-7", "--local-addr", "127.0.0.1"]


@pytest.mark.parametrize("params,executor,command,expected", [
    ({"nodes": 0}, "slurm", "finetune", "--slurm-nodes 0: expected a whole number of nodes per trial, at least 1"),
    ({"nodes": 2}, "processes", "finetune", "use --executor slurm (or --executor local"),
    ({"nodes": 2}, "slurm", "prompt", "a prompt sweep's trials run in one process"),
])
def test_bad_multi_node_settings_are_named(params, executor, command, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        launch_settings(dict(params), executor=executor, command=command)


def test_a_trial_command_that_is_not_pretune_is_refused():
    with pytest.raises(ConfigError, match="runs `python -m pretune ...` under torchrun; got 'python train.py'"):
        torchrun_command(["python", "train.py"], nnodes=2, nproc_per_node=1, node_rank=0, host="h", port=1,
                         run_id="r")
    with pytest.raises(ConfigError, match="job id 'abc': expected a number"):
        rendezvous_port("abc")


@pytest.mark.slow  # a two-node finetuning trial through submitit's local executor, ~40 s (make test-slow)
def test_a_sweep_of_two_node_trials_through_the_local_executor(tmp_path, data, tokenizers_by_kind):  # noqa: F811
    spec = _spec(tokenizers_by_kind["wordpiece"], data, tmp_path / "sweep", grid={"train.lr": [1e-3]})
    result = run_sweep(spec, executor="local", cluster={"nodes": 2, "timeout_min": 10}, **QUIET)
    assert [r["status"] for r in result.rows] == ["done"], result.rows
    logs = tmp_path / "sweep" / "logs"
    node0, node1 = (logs / "lr=0.001,seed=0.log").read_text(), (logs / "lr=0.001,seed=0.node1.log").read_text()
    for rank, text in ((0, node0), (1, node1)):
        assert f"=== node {rank} of 2 " in text and f"--nnodes 2 --nproc-per-node 1 --node-rank {rank} " \
            "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" in text, text[-3000:]
    # one run of two processes, one per node (process 0, which logs, is on either: c10d numbers the nodes itself)
    assert "2 processes (ddp)" in node0 + node1
    results = json.loads((tmp_path / "sweep" / "trials" / "lr=0.001,seed=0" / "results.json").read_text())
    assert 0 <= results["test"]["accuracy"] <= 1
