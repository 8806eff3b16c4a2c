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

    def gather_with_grad(self, *parts: torch.Tensor) -> list[list[torch.Tensor]]:
        """For each of ``parts`` (2-D, the same width; their row counts may differ from process to process), that
        part of every process in rank order: ``out[j][r]`` is part j of rank r. Gradients flow back: what a loss on
        any process puts on rank r's rows is summed onto rank r's own tensors (what ``torch.distributed.nn``'s
        all_gather, now deprecated, does for equal shapes), so DDP's averaging then gives the gradient of one process
        that held every row. Every process must call it alike. One process: ``[[p] for p in parts]``."""
        if not self.enabled:
            return [[p] for p in parts]
        local = torch.cat(parts)  # (n, width): the parts one after the other
        sizes = torch.tensor([p.shape[0] for p in parts], dtype=torch.long, device=local.device)
        every = [torch.empty_like(sizes) for _ in range(self.world)]
        dist.all_gather(every, sizes)
        counts = torch.stack(every).tolist()  # counts[r][j]: rows of part j on rank r
        padded = _GatherRows.apply(local, max(sum(c) for c in counts), self.rank)  # (world, most rows, width)
        out: list[list[torch.Tensor]] = [[] for _ in parts]
        for r, row in enumerate(counts):
            start = 0
            for j, n in enumerate(row):
                out[j].append(padded[r, start:start + n])
                start += n
        return out


class _GatherRows(torch.autograd.Function):
    """(n, width) rows of this process -> (world, rows, width): every process's rows, padded with zeros to ``rows``.
    Backward: the gradient of the whole gathered tensor summed over the processes (each one's loss reached every
    process's rows), this process's slice of it returned. An all-reduce of the padded gradient, where a reduce-scatter
    would move 1/world of it: embeddings are small, and it is one collective every backend has."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, rank: int) -> torch.Tensor:
        ctx.n, ctx.rank = x.shape[0], rank
        mine = x.new_zeros((rows, *x.shape[1:]))
        mine[: x.shape[0]] = x
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine.contiguous())
        return torch.stack(every)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank, : ctx.n], None, None


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


def average_gradients(params: list[torch.Tensor], info: DistInfo) -> None:
    """Each parameter's gradient replaced by its mean over the processes (what DDP does as the backward runs), in
    one all-reduce; a parameter without a gradient counts as zeros. Identity when single-process."""
    if not info.enabled or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world
    start = 0
    for g in grads:
        g.copy_(flat[start:start + g.numel()].view_as(g))
        start += g.numel()


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
