"""Beyond one machine, on one machine (issue 38): two torchrun launchers (``--nnodes 2``, ``--node-rank 0/1``, one
process each, gloo) meet at a c10d rendezvous on loopback. Two nodes train as one process on the whole batch
(pretraining and finetuning, DDP and FSDP); a node's worker SIGKILLed mid-run is restarted by torchrun
(``--max-restarts 1``) and the run resumes by itself to the bits of an uninterrupted run; an elastic
``--nnodes 1:2`` launch that loses a whole node continues on the other (FSDP re-cuts its checkpoint; DDP refuses
with the number of processes to use). The launch helpers and tolerances are test_parallel's."""

import socket
import subprocess
import sys
import time

import pytest
import test_parallel
import torch
from test_parallel import HELPER, _close, _curve, _env, _results, _run, _same_metrics, _weights

pretrain_args, finetune_args = test_parallel.pretrain_args, test_parallel.finetune_args  # its fixtures, by name
pytestmark = pytest.mark.slow  # two torchrun launchers per run, ~10-20 s each (make test-slow)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(args, tmp, *, mode="none", at=0, nnodes="2", restarts=0, last_call=3, timeout=300):
    """``pretune ARGS`` on two nodes of one machine: two torchrun launchers, one process each, meeting at a c10d
    rendezvous on a free loopback port (node 0 hosts its store), through tests/helpers/kill_run.py (MODE at step AT).
    Returns (the launchers' exit codes, node 0's output, node 1's output)."""
    port = free_port()
    # gloo on loopback as well; each start of the processes gets its own store (pytorch/pytorch#135712: with the
    # rendezvous store shared, a restarted process may read its lost peer's address and fail to connect)
    env = dict(_env(), GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    procs, logs = [], []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
               "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"nodes-{port}", "--rdzv-conf", f"is_host={rank == 0},last_call_timeout={last_call}",
               "--local-addr", "127.0.0.1", "--max-restarts", str(restarts), "--monitor-interval", "0.2",
               str(HELPER), mode, str(at), *args]
        logs.append(tmp / f"node{rank}-{port}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        if rank == 0:
            time.sleep(0.5)  # node 0's agent hosts the rendezvous store
    deadline = time.monotonic() + timeout
    try:
        rcs = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return rcs, logs[0].read_text(), logs[1].read_text()


def _ok(res):
    rcs, out0, out1 = res
    assert rcs == [0, 0], out0[-3000:] + "\n--- node 1 ---\n" + out1[-3000:]
    return res


def _diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pretrain_args):
    """The pretraining run in one process: the reference of DDP and FSDP alike (one process has no wrapper either
    way; FSDP's sharded checkpoints do not change the arithmetic)."""
    one = tmp_path_factory.mktemp("one") / "run"
    _run(pretrain_args(one))
    return one


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_nodes_pretrain_as_one_process_and_a_lost_worker_resumes_bitwise(tmp_path, pretrain_args, one_process,
                                                                             parallel):
    one, two, killed = one_process, tmp_path / "two", tmp_path / "killed"
    _ok(_nodes(pretrain_args(two, f"train.parallel={parallel}"), tmp_path))
    a, b = _curve(two), _curve(one)
    assert len(a) == 10 and a.keys() == b.keys()
    assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    _close(_weights(two), _weights(one), 1e-5)
    print(f"{parallel}: two nodes vs one process, largest weight difference {_diff(_weights(two), _weights(one)):.3g}")
    # node 1's worker killed after step 5 (checkpoints every 2 steps): torchrun restarts both nodes' processes and
    # the run resumes from its step-4 checkpoint, with no --resume
    _, out0, out1 = _ok(_nodes(pretrain_args(killed, f"train.parallel={parallel}"), tmp_path, mode="worker", at=5,
                               restarts=1))
    out = out0 + "\n--- node 1 ---\n" + out1
    assert "kill_run: SIGKILL of rank 1's worker after step 5 of 10; checkpoints then: step-00000002, " \
           "step-00000004; model/ absent" in out, out[-6000:]  # the run had not finished
    assert "torchrun restart 1: resuming the run" in out and "resumed from step 4" in out, out[-6000:]
    assert _curve(killed) == _curve(two)
    a, b = _weights(killed), _weights(two)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("parallel,peft", [("ddp", None), ("fsdp", "lora")])
def test_two_nodes_finetune_as_one_process(tmp_path, finetune_args, parallel, peft):
    name = "adapter_model.safetensors" if peft else "model.safetensors"
    one, two = tmp_path / "one", tmp_path / "two"
    _run(finetune_args(one, f"train.parallel={parallel}", peft=peft))
    _ok(_nodes(finetune_args(two, f"train.parallel={parallel}", peft=peft), tmp_path))
    assert len(_curve(two)) == 6
    assert list(_curve(two).values()) == pytest.approx(list(_curve(one).values()), abs=1e-5)
    _same_metrics(_results(one), _results(two))
    _close(_weights(two, name), _weights(one, name), 1e-5)
    print(f"finetune {parallel} {peft or 'full'}: two nodes vs one process, largest weight difference "
          f"{_diff(_weights(two, name), _weights(one, name)):.3g}")


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_an_elastic_launch_that_loses_a_node_goes_on_with_one(tmp_path, pretrain_args, one_process, parallel):
    """``--nnodes 1:2``: node 1's agent and worker SIGKILLed after step 5, torchrun restarts node 0 alone. FSDP
    re-cuts the step-4 checkpoint of 2 processes for 1 and ends within 1e-5 of one process's run; DDP refuses,
    naming the number of processes to resume with, and the run folder keeps its checkpoints."""
    one, run = one_process, tmp_path / "elastic"
    rcs, out0, out1 = _nodes(pretrain_args(run, f"train.parallel={parallel}"), tmp_path, mode="node", at=5,
                             nnodes="1:2", restarts=1, last_call=5)
    out = out0 + "\n--- node 1 ---\n" + out1
    assert rcs[1] == -9 and "2 process(es)" in out0, out[-6000:]  # both nodes trained until node 1 was lost
    assert "kill_run: SIGKILL of rank 1's node after step 5 of 10; checkpoints then: step-00000002, " \
           "step-00000004; model/ absent" in out, out[-6000:]
    assert "torchrun restart 1: resuming the run" in out0, out[-6000:]
    if parallel == "ddp":
        assert rcs[0] != 0 and "was written by 2 process(es) and this run has 1: resume it with 2" in out0
        assert not (run / "model").exists() and (run / "checkpoints" / "step-00000004").is_dir()
        return
    assert rcs[0] == 0, out[-6000:]
    assert "resuming a checkpoint of 2 process(es) with 1" in out0 and "resumed from step 4" in out0
    a, b = _curve(run), _curve(one)
    assert a.keys() == b.keys() and len(a) == 10
    assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    _close(_weights(run), _weights(one), 1e-5)
    print(f"elastic fsdp 2 -> 1 process: largest weight difference to one process "
          f"{_diff(_weights(run), _weights(one)):.3g}")
