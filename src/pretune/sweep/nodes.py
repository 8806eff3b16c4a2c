"""Trials that are themselves multi-node (``pretune sweep --executor slurm --slurm-nodes N``): each trial is one
Slurm job of N nodes with one task per node (submitit's ``nodes=N, tasks_per_node=1``); every task starts the
torchrun launcher of its node, and the launchers meet at a c10d rendezvous on the first node of the allocation:

    python -m torch.distributed.run --nnodes N --nproc-per-node P --node-rank R --rdzv-backend c10d
        --rdzv-endpoint FIRST_NODE:PORT --rdzv-id pretune-JOB -m pretune CMD ...

P is the GPUs per node (``--slurm-gpus``), else 1; PORT is a function of the job id, so the nodes agree on it
without talking. The same launch runs under submitit's local executor (``--executor local``) as N tasks on this
machine, the rendezvous on loopback: a rehearsal of the cluster launch, and how the tests check it.

Node 0's output goes to the trial's log (``logs/<trial>.log``), node R's to ``logs/<trial>.node<R>.log``; each
starts with the command its node ran."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..config import ConfigError

PORT_BASE, PORT_SPAN = 20000, 20000  # the rendezvous port: PORT_BASE + the job id's number mod PORT_SPAN
__all__ = ["launch_settings", "rendezvous_port", "torchrun_command", "node_command", "node_log", "run_on_nodes"]


def launch_settings(cluster: dict, *, executor: str, command: str) -> dict | None:
    """The multi-node launch the submitit parameters ``cluster`` ask for with ``nodes`` (``--slurm-nodes``), or None.
    ``cluster`` is changed in place into what submitit gets: Slurm ``nodes=N, tasks_per_node=1``; the local executor
    (one machine) ``tasks_per_node=N``, one task per node. Returns ``nproc_per_node`` (the GPUs per node, else 1),
    ``host`` (the rendezvous host: None for the allocation's first node, loopback for the local executor) and
    ``per_machine`` (the trial's processes that share one machine's cores)."""
    nodes = cluster.pop("nodes", None)
    if nodes is None:
        return None
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"--slurm-nodes {nodes!r}: expected a whole number of nodes per trial, at least 1")
    if executor not in ("slurm", "local"):
        raise ConfigError(f"--slurm-nodes {nodes}: multi-node trials are submitit jobs; use --executor slurm (or "
                          f"--executor local, to rehearse the launch on this machine), not --executor {executor}")
    if command not in ("pretrain", "finetune"):
        raise ConfigError(f"--slurm-nodes {nodes}: a {command} sweep's trials run in one process; multi-node trials "
                          "are pretrain and finetune sweeps")
    nproc = int(cluster.get("gpus_per_node") or 1)
    if executor == "slurm":
        cluster.update(nodes=nodes, tasks_per_node=1)
        return {"nproc_per_node": nproc, "host": None, "per_machine": nproc}
    cluster["tasks_per_node"] = nodes
    return {"nproc_per_node": nproc, "host": "127.0.0.1", "per_machine": nodes * nproc}


def rendezvous_port(job_id: str) -> int:
    """The rendezvous port of a job: every node computes the same one from the job id (``12345`` or an array
    task's ``12345_7``), and two jobs that share a node rarely collide."""
    digits = "".join(c for c in str(job_id) if c.isdigit())
    if not digits:
        raise ConfigError(f"job id {job_id!r}: expected a number (Slurm's SLURM_JOB_ID) to derive the rendezvous "
                          "port from")
    return PORT_BASE + int(digits) % PORT_SPAN


def torchrun_command(argv: list[str], *, nnodes: int, nproc_per_node: int, node_rank: int, host: str, port: int,
                     run_id: str, local_addr: str | None = None) -> list[str]:
    """A trial's command line ``[python, "-m", "pretune", CMD, ...]`` as node ``node_rank``'s torchrun launch of
    ``nnodes`` nodes with ``nproc_per_node`` processes each, meeting at ``host:port`` (c10d rendezvous ``run_id``);
    ``local_addr``: the address this node's agent gives the others (torchrun's ``--local-addr``)."""
    if argv[1:3] != ["-m", "pretune"]:
        raise ConfigError(f"a multi-node trial runs `python -m pretune ...` under torchrun; got {' '.join(argv)!r}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank {node_rank}: expected 0 to {nnodes - 1} (nnodes {nnodes})")
    return [argv[0], "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
            "--rdzv-id", run_id, *(["--local-addr", local_addr] if local_addr else []), *argv[1:]]


def node_log(log_path: str | os.PathLike, node_rank: int) -> Path:
    """Where node ``node_rank``'s output goes: the trial's log for node 0, ``<trial>.node<R>.log`` beside it else."""
    path = Path(log_path)
    return path if node_rank == 0 else path.with_name(f"{path.stem}.node{node_rank}{path.suffix}")


def node_command(argv: list[str], *, nproc_per_node: int = 1, host: str | None = None) -> list[str]:
    """Inside a task of a multi-node trial's job: this node's torchrun launch of the trial's ``argv``, from
    submitit's job environment (the tasks, one per node: ``nnodes``; this task's rank: ``node_rank``; the job id: the
    rendezvous port and id). ``host``: the rendezvous host, and every agent's own address (the local executor:
    loopback); default: the allocation's first node, each agent on its node's address."""
    import submitit

    job = submitit.JobEnvironment()
    return torchrun_command(argv, nnodes=job.num_tasks, nproc_per_node=nproc_per_node, node_rank=job.global_rank,
                            host=host or job.hostnames[0], port=rendezvous_port(job.job_id),
                            run_id=f"pretune-{job.job_id}", local_addr=host)


def run_on_nodes(argv: list[str], *, env: dict, log_path: str, cwd: str | None = None, nproc_per_node: int = 1,
                 host: str | None = None) -> dict:
    """What each task of a multi-node trial's job runs (one task per node): :func:`node_command`, its output appended
    to :func:`node_log`, which starts with the command; returns ``{"returncode", "seconds"}``."""
    import subprocess

    import submitit

    job = submitit.JobEnvironment()
    cmd = node_command(argv, nproc_per_node=nproc_per_node, host=host)
    t0 = time.time()
    with open(node_log(log_path, job.global_rank), "ab") as f:
        f.write(f"=== node {job.global_rank} of {job.num_tasks} ({job.hostname}): {' '.join(cmd)}\n".encode())
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd).returncode
    return {"returncode": rc, "seconds": time.time() - t0}
