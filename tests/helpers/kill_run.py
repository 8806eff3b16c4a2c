"""Run ``pretune ARGS...`` in this process and interrupt it for real at a chosen moment (resume tests).

    python tests/helpers/kill_run.py MODE STEP pretune-args...

MODE ``step``: SIGKILL right after training step STEP; ``write``: SIGKILL in the middle of writing the checkpoint of
step STEP (its weights are on disk, its trainer.pt half written); ``sigint``: a SIGINT during step STEP (the run
should finish the step, checkpoint and exit 130); ``inf``: an overflow in one gradient element before the loss scaler
looks at the gradients of step STEP, only in the processes listed in $INF_RANKS (e.g. "0" or "0,1"); ``none``: run to
the end. Under torchrun (issue 38): ``worker``: SIGKILL after step STEP in the process of rank $KILL_RANK (default
1) only, on torchrun's first start (a restart runs on), printing which checkpoints existed then; ``node``: the same,
its torchrun agent killed first (the whole node is lost)."""

import os
import signal
import sys

import torch

from pretune.cli import main
from pretune.train import loop

mode, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

if mode in ("step", "sigint"):
    if mode == "sigint":  # a suite started in the background (`make test &`) inherits SIGINT ignored, which the
        signal.signal(signal.SIGINT, signal.default_int_handler)  # trainer respects: the Ctrl-C of a terminal here
    train_step = loop.Trainer.train_step

    def patched(self):
        if mode == "sigint" and self.step + 1 == at:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during the step
        out = train_step(self)
        if mode == "step" and self.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    loop.Trainer.train_step = patched
elif mode in ("worker", "node"):
    train_step = loop.Trainer.train_step
    victim = int(os.environ.get("KILL_RANK", "1"))

    def killing(self):
        out = train_step(self)
        if (self.step == at and self.dist.rank == victim
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            ckpts = sorted(p.name for p in (self.run_dir / "checkpoints").glob("step-*"))
            print(f"kill_run: SIGKILL of rank {victim}'s {mode} after step {at} of {self.cfg.steps}; checkpoints "
                  f"then: {', '.join(ckpts)}; model/ {'exists' if (self.run_dir / 'model').exists() else 'absent'}",
                  flush=True)
            if mode == "node":
                os.kill(os.getppid(), signal.SIGKILL)  # the agent first: nothing restarts on this node
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    loop.Trainer.train_step = killing
elif mode == "write":
    save = torch.save

    def patched_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == at and "optimizer" in obj:
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04 half a trainer state")
                fh.flush()
                os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return save(obj, f, *args, **kwargs)

    torch.save = patched_save
elif mode == "inf":
    scaler_classes = [torch.amp.GradScaler]
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler_classes.append(ShardedGradScaler)
    ranks = {int(r) for r in os.environ.get("INF_RANKS", "0").split(",")}
    train_step = loop.Trainer.train_step

    def counted(self):
        self._inf_now = self.step + 1 == at and int(os.environ.get("RANK", "0")) in ranks
        return train_step(self)

    loop.Trainer.train_step = counted
    for cls in scaler_classes:
        def patched_unscale(self, optimizer, _orig=cls.unscale_):
            trainer = next((t for t in _trainers if getattr(t, "scaler", None) is self), None)
            if trainer is not None and trainer._inf_now:
                p = next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # this process's shard
                grad.view(-1)[0] = float("inf")
            return _orig(self, optimizer)

        cls.unscale_ = patched_unscale
    _trainers = []
    init = loop.Trainer.__init__

    def remembered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _trainers.append(self)

    loop.Trainer.__init__ = remembered
elif mode != "none":
    raise SystemExit(f"unknown mode {mode!r}")

sys.exit(main(argv))
