"""torchrun's restarts: when torchrun starts the processes again after a failure (a process or a whole node lost,
with ``--max-restarts``), the run they were training continues from its newest intact checkpoint, with no flag.

torchrun numbers the starts of a launch's processes in ``TORCHELASTIC_RESTART_COUNT`` (0: the first start). A
first start keeps the usual rules: an existing run is refused unless ``--resume`` (or ``--overwrite``). A restart
continues the run in ``train.out`` only if this launch started it there: once the run folder is ready, the
processes record the launch they belong to (each one's torchrun agent, host and process id, which stays the same
across restarts) in ``LAUNCH_FILE``; a restart whose agents include a recorded one is the same launch. So a launch
whose first start was refused (the folder held another run) does not take that run over when torchrun restarts it.

A restart of the same launch resumes when the run holds a checkpoint, and starts over (as ``--overwrite``: only
what the run wrote is removed) when it was lost before its first checkpoint. Resuming with fewer (or more)
processes than wrote the checkpoint (an elastic ``--nnodes MIN:MAX`` restart) follows ``Trainer.resume``: FSDP
checkpoints are re-cut, DDP ones are refused with the number of processes to use."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

from ..io.outputs import LAUNCH_FILE
from .dist import DistInfo, all_gather_objects

__all__ = ["LAUNCH_FILE", "SHARED_STORE", "restart_count", "launch_key", "shares_store", "restart_mode", "decide",
           "record_launch"]


def restart_count() -> int:
    """How many times torchrun has restarted this launch's processes (0: the first start, or not under torchrun)."""
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return int(text)
    except ValueError:
        from ..config import ConfigError

        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={text!r}: expected a whole number (torchrun sets it)") from None


def launch_key() -> str:
    """This process's torchrun agent (its parent, the same process across restarts) as ``host:pid``."""
    return f"{socket.gethostname()}:{os.getppid()}"


def _recorded(run_dir: Path) -> set[str]:
    try:
        data = json.loads((run_dir / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return set()
    agents = data.get("agents") if isinstance(data, dict) else None
    return {str(a) for a in agents} if isinstance(agents, list) else set()


def decide(run_dir: str | os.PathLike, agents: list[str], *, restart: int, resume: bool, overwrite: bool
           ) -> tuple[bool, bool, str]:
    """(resume, overwrite, note) for a start of the processes: on a first start (``restart`` 0) the flags as given;
    on a restart of the launch recorded in ``run_dir`` (one of ``agents`` recorded there): resume when the run holds
    a checkpoint, else start over; on a restart of another launch, the flags as given (a first start's refusal
    stands). ``note``: the line to print ("" when nothing changes)."""
    from .state import list_checkpoints

    run_dir = Path(run_dir)
    if restart == 0:
        return resume, overwrite, ""
    if not _recorded(run_dir) & set(agents):
        return resume, overwrite, (f"torchrun restart {restart}: {run_dir} holds no run this launch started, so the "
                                   "command's own --resume / --overwrite apply")
    if list_checkpoints(run_dir):
        return True, False, (f"torchrun restart {restart}: resuming the run in {run_dir} from its newest intact "
                             "checkpoint")
    return False, True, (f"torchrun restart {restart}: the run in {run_dir} had written no checkpoint yet; starting it "
                         "over")


SHARED_STORE = ("warning: torchrun may restart these processes (--max-restarts) and shares its rendezvous store "
                "with them: a restart can then read the lost processes' addresses and fail to connect "
                "(pytorch/pytorch#135712); launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
                "environment (docs/distributed.md)")


def shares_store() -> bool:
    """Whether torchrun may restart these processes and hands them its rendezvous store, which keeps the keys of
    the processes it replaced (each start's process group then risks reading the previous start's addresses)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0"))


def _launch(dist: DistInfo) -> tuple[int, list[str]]:
    """(the restart count, every process's agent): the highest count of any process, since torchrun counts per node
    (an agent whose own processes were stopped for another node's failure may not count that restart)."""
    pairs = all_gather_objects((restart_count(), launch_key()), dist)
    return max(n for n, _ in pairs), [key for _, key in pairs]


def restart_mode(run_dir: str | os.PathLike, dist: DistInfo, *, resume: bool, overwrite: bool,
                 log: Callable[[str], None] = print) -> tuple[bool, bool]:
    """(resume, overwrite) for this start of a job, the same in every process (see :func:`decide`). Under torchrun
    a collective: every process calls it."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return resume, overwrite
    restart, agents = _launch(dist)
    if dist.is_main and restart == 0 and shares_store():
        log(SHARED_STORE)
    mine = decide(run_dir, agents, restart=restart, resume=resume, overwrite=overwrite) if dist.is_main else None
    resume, overwrite, note = all_gather_objects(mine, dist)[0]
    if note and dist.is_main:
        log(note)
    return resume, overwrite


def record_launch(run_dir: str | os.PathLike, dist: DistInfo) -> None:
    """Under torchrun, once the run folder is ready: write which launch (its agents) runs it, kept across restarts
    (a restart adds its agents to those recorded). A collective under torchrun; nothing outside it."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    from ..io.outputs import mark, write_atomic

    restart, agents = _launch(dist)
    if dist.is_main:
        run_dir = Path(run_dir)
        keep = sorted(set(agents) | (_recorded(run_dir) if restart else set()))
        write_atomic(run_dir / LAUNCH_FILE, json.dumps({"written_by": "pretune", "agents": keep,
                                                        "rdzv_id": os.environ.get("TORCHELASTIC_RUN_ID")}) + "\n")
        mark(run_dir, [LAUNCH_FILE])
