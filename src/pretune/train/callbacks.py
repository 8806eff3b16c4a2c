"""Trainer callbacks: what a job wants done around the shared loop without forking it (minGPT's
``add_callback``, torchtitan's components). Keep-best model selection, early stopping and the train loss's
trend live here.

    trainer = Trainer(..., callbacks=[history, KeepBest("dev_accuracy", params), EarlyStopping("dev_accuracy", 3)])

A callback's state (``state_dict``: tensors and plain values) is saved with every training checkpoint and
restored on resume, so a resumed run selects and stops exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ConfigError

__all__ = ["Callback", "EvalHistory", "TrainLosses", "KeepBest", "EarlyStopping", "improved"]


class Callback:
    """Hooks the Trainer calls, all optional. ``stop`` turns True to end training early."""

    stop: bool = False

    def on_step(self, trainer, step: int, metrics: dict) -> None:
        """After every optimizer step (``metrics``: the step's ``loss``, ``lr``, loss terms, ...)."""

    def on_evaluate(self, trainer, step: int, metrics: dict) -> None:
        """After every evaluation (``metrics``: loss terms and the evaluator's, e.g. ``dev_accuracy``)."""

    def on_train_end(self, trainer) -> None:
        """After the last step (and the last evaluation), before the job exports the model."""

    def state_dict(self, step: int) -> dict:
        """Plain values and tensors to checkpoint at ``step`` (tensors under keys of their own)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""


def improved(value: float, best: float | None, higher: bool) -> bool:
    return best is None or (value > best if higher else value < best)


def _metric(metrics: dict, metric: str) -> float:
    if metric not in metrics:
        have = sorted(k[4:] for k in metrics if k.startswith("dev_"))
        raise ConfigError(f"task.metric={metric.removeprefix('dev_')!r} is not computed for this task; choose one of "
                          f"{have}")
    return float(metrics[metric])


class EvalHistory(Callback):
    """Every evaluation's metrics with ``prefix`` (default ``dev_``), prefix removed: [(step, {name: value})]."""

    def __init__(self, prefix: str = "dev_"):
        self.prefix = prefix
        self.history: list[tuple[int, dict]] = []

    def on_evaluate(self, trainer, step, metrics):
        self.history.append((step, {k[len(self.prefix):]: v for k, v in metrics.items() if k.startswith(self.prefix)}))

    def state_dict(self, step):
        return {"history": [[s, h] for s, h in self.history]}

    def load_state_dict(self, state):
        self.history = [(int(s), dict(h)) for s, h in state.get("history", [])]


class TrainLosses(Callback):
    """Every optimizer step's train loss, and whether it fell: :meth:`trend` compares the mean of the first
    ``fraction`` of the steps with the mean of the last."""

    def __init__(self):
        self.losses: list[float] = []

    def on_step(self, trainer, step, metrics):
        self.losses.append(float(metrics["loss"]))

    def trend(self, fraction: float = 0.1) -> tuple[float, float, int] | None:
        """(mean loss of the first steps, mean of the last, steps in each mean); None under two steps."""
        if len(self.losses) < 2:
            return None
        k = min(max(1, round(fraction * len(self.losses))), len(self.losses) // 2)
        return sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k, k

    def state_dict(self, step):
        return {"losses": list(self.losses)}

    def load_state_dict(self, state):
        self.losses = [float(v) for v in state.get("losses", [])]


class KeepBest(Callback):
    """Model selection: remember a copy of the trained tensors (``params()``: name -> tensor, e.g. every
    parameter that requires grad) at the best value of ``metric``; at the end, put them back when the last
    step was not the best (``restore=False``: only remember which step was best)."""

    def __init__(self, metric: str, params: Callable[[], dict[str, torch.Tensor]], *, higher: bool = True,
                 restore: bool = True):
        self.metric, self.params, self.higher, self.restore = metric, params, higher, restore
        self.best: float | None = None
        self.best_step: int | None = None
        self.saved: dict[str, torch.Tensor] = {}
        self.restored = False

    def on_evaluate(self, trainer, step, metrics):
        value = _metric(metrics, self.metric)
        if improved(value, self.best, self.higher):
            self.best, self.best_step = value, step
            if self.restore:
                self.saved = {k: v.detach().clone() for k, v in self.params().items()}

    def on_train_end(self, trainer):
        if self.restore and self.saved and self.best_step != trainer.step:
            current = self.params()
            with torch.no_grad():
                for k, v in self.saved.items():
                    if hasattr(current[k], "device_mesh") and not hasattr(v, "device_mesh"):  # FSDP, from a checkpoint
                        from torch.distributed.tensor import distribute_tensor

                        v = distribute_tensor(v.to(current[k].dtype), current[k].device_mesh, current[k].placements)
                    current[k].copy_(v)
            self.restored = True

    def state_dict(self, step):
        # at the best step the checkpoint's own weights are the copy: no second copy of the model in it
        is_model = self.best_step == step
        return {"best": self.best, "best_step": self.best_step, "copy_is_model": is_model,
                **({} if is_model else {f"tensor:{k}": v for k, v in self.saved.items()})}

    def load_state_dict(self, state):
        self.best, self.best_step = state.get("best"), state.get("best_step")
        if state.get("copy_is_model") and self.restore:  # the model was restored first: copy it
            self.saved = {k: v.detach().clone() for k, v in self.params().items()}
        else:
            self.saved = {k[len("tensor:"):]: v for k, v in state.items() if k.startswith("tensor:")}


class EarlyStopping(Callback):
    """Stop after ``patience`` evaluations in a row without a better ``metric``."""

    def __init__(self, metric: str, patience: int, *, higher: bool = True):
        if patience < 1:
            raise ConfigError(f"patience must be >= 1, got {patience}")
        self.metric, self.patience, self.higher = metric, patience, higher
        self.best: float | None = None
        self.since = 0

    def on_evaluate(self, trainer, step, metrics):
        value = _metric(metrics, self.metric)
        if improved(value, self.best, self.higher):
            self.best, self.since = value, 0
        else:
            self.since += 1
        self.stop = self.since >= self.patience

    def state_dict(self, step):
        return {"best": self.best, "since": self.since}

    def load_state_dict(self, state):
        self.best, self.since = state.get("best"), int(state.get("since", 0))
