"""Process-group plumbing for ``torchrun``: the same command, more processes (DDP; gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every process: the gather a job hands to code below ``train``
        (``tasks.run.evaluate_task(dist=...)``)."""
        return all_gather_objects(obj, self)


def init_distributed() -> DistInfo:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1), else a single-process DistInfo.
    Uses nccl and one GPU per process when CUDA is available, gloo on CPU otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world <= 1:
        return DistInfo(device=device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local, device=device)


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a float64 tensor over processes (identity when single-process)."""
    if info.enabled:
        values = values.to(info.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values.cpu()
    return values


def all_gather_objects(obj, info: DistInfo) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every process."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
