"""Run ``pretune ARGS...`` in this process and interrupt it for real at a chosen moment (resume tests).

    python tests/helpers/kill_run.py MODE STEP pretune-args...

MODE ``step``: SIGKILL right after training step STEP; ``write``: SIGKILL in the middle of writing the checkpoint of
step STEP (its weights are on disk, its trainer.pt half written); ``sigint``: a SIGINT during step STEP (the run
should finish the step, checkpoint and exit 130); ``none``: run to the end."""

import os
import signal
import sys

import torch

from pretune.cli import main
from pretune.train import loop

mode, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

if mode in ("step", "sigint"):
    train_step = loop.Trainer.train_step

    def patched(self):
        if mode == "sigint" and self.step + 1 == at:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during the step
        out = train_step(self)
        if mode == "step" and self.step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    loop.Trainer.train_step = patched
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
elif mode != "none":
    raise SystemExit(f"unknown mode {mode!r}")

sys.exit(main(argv))
