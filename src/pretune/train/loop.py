"""The training loop shared by pretraining and finetuning.

One optimizer step = one global batch of ``train.batch_size`` examples, split over processes (DDP) and
``grad_accum`` micro-batches. Every loss term is divided by its number of targets in the *whole*
global batch (counted before the forward passes and summed over processes), so accumulation and
DDP give the same update as the big batch. Data order and corruption are pure functions of
(seed, epoch, example id), so a resumed run replays exactly what an uninterrupted one sees.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import StepError
from ..io.checkpoint import CheckpointError
from .dist import DistInfo, all_gather_objects, all_reduce_sum, average_gradients, barrier
from .precision import resolve_precision
from .state import clean_interrupted, list_checkpoints, load_training_state, save_training_state

EVAL_EPOCH = 2**31 - 1  # the "epoch" evaluation examples are corrupted with: fixed, never a training epoch


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the run stops; the last good checkpoint is kept."""


class Interrupted(RuntimeError):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run after a finished step (and its checkpoint, when the run keeps
    checkpoints). ``exit_code``: 130 for SIGINT, 143 for SIGTERM, as a shell reports them."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        import signal

        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if checkpoint is not None:
            how = (f"checkpoint {checkpoint.name} written; continue with the same command and --resume (pretune "
                   "pretrain / finetune)")
        else:
            how = "no checkpoint (train.keep_last=0 writes none), so the run cannot be continued"
        super().__init__(f"interrupted ({name}) after step {step}: {how}")


@dataclass
class ExampleSet:
    """Examples addressed by integer id: ``get(id) -> block-like`` plus the ids of each split."""

    get: Callable[[int], object]
    train_ids: np.ndarray
    eval_ids: np.ndarray
    lengths: np.ndarray | None = None  # per id (for length bucketing); indexable by id


@dataclass
class TrainResult:
    step: int
    train_loss: float
    eval: dict = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0
    run_dir: Path | None = None
    checkpoint: Path | None = None


class _LossModule(nn.Module):
    """Model + objective as one module, so DDP sees every parameter and every forward."""

    def __init__(self, model: nn.Module, objective: nn.Module):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch, totals):
        return self.objective.loss(self.model, batch, totals)


def _stacks(module: nn.Module) -> list:
    """Every transformer Stack inside ``module`` (encoder, decoder, an objective's generator)."""
    from ..model.transformer import Stack

    return [m for m in module.modules() if isinstance(m, Stack)]


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()} if device.type != "cpu" else batch


class Trainer:
    """Runs ``cfg.steps`` optimizer steps of ``objective`` on ``model`` over ``data``.

    Args:
        model: the TransformerLM being trained (the saved result).
        objective: an Objective (data collation + loss terms; may own extra modules).
        data: an :class:`ExampleSet`.
        cfg: a ``TrainConfig`` (runconfig.py).
        run_dir: where checkpoints/, metrics.jsonl, tb/ and loss.png go.
        tokenizer: saved beside every checkpoint.
        dist: process info from :func:`init_distributed`.
        bucket: group examples of similar length into batches.
        run_config: saved as run.yaml in each checkpoint.
        evaluator: extra evaluation (finetuning: task metrics on the dev set), merged into evaluate().
        callbacks: :class:`~pretune.train.callbacks.Callback` objects (keep-best, early stopping, ...), called
            after every evaluation and at the end; their state is checkpointed with the run.
        param_lr: a peak learning rate of its own for some parameters (``id(param) -> lr``), e.g. a task head.
        trackers: the job's MLflow / W&B runs (``train.trackers.open_trackers``), which every logged row also goes
            to and which the job ends; None: ``fit`` opens those ``cfg.report_to`` names itself and ends them.
    """

    def __init__(self, *, model, objective, data: ExampleSet, cfg, run_dir, tokenizer=None,
                 dist: DistInfo | None = None, bucket: bool = False, run_config=None, show_progress: bool = True,
                 evaluator: Callable[[], dict] | None = None, callbacks: Sequence | None = None,
                 param_lr: dict[int, float] | None = None, trackers=None):
        from ..runconfig import check_batch
        from .optim import build_optimizer, build_scheduler

        self.model, self.objective, self.data, self.cfg = model, objective, data, cfg
        self.run_dir = Path(run_dir)
        self.tokenizer, self.run_config, self.bucket = tokenizer, run_config, bucket
        self.dist = dist or DistInfo()
        self.show_progress = show_progress
        self.evaluator = evaluator
        self.trackers = trackers
        self.callbacks = list(callbacks or [])
        self.stopped_early = False
        d = self.dist
        check_batch(cfg, world=d.world)
        if len(data.train_ids) < cfg.batch_size:
            from ..config import ConfigError

            raise ConfigError(f"train.batch_size ({cfg.batch_size}) is larger than the training set "
                             f"({len(data.train_ids)} examples): lower it or add data")
        self.precision = resolve_precision(cfg.precision, d.device)  # jobs resolve (and print) it before
        self.module = _LossModule(model, objective).to(d.device)
        stacks = _stacks(self.module)  # the model's and any the objective owns (ELECTRA's generator)
        if cfg.activation_checkpointing == "blocks":
            for stack in stacks:
                stack.checkpoint_blocks = True
        self.ddp = None
        self.sharded = cfg.parallel == "fsdp"  # sharded checkpoints (one process too, so any world size resumes)
        self.fsdp = self.sharded and d.enabled
        self._twin = None
        if self.fsdp:
            from .parallel import meta_twin, shard

            if cfg.cpu_offload and d.device.type != "cuda":
                from ..config import ConfigError

                raise ConfigError("train.cpu_offload=true moves FSDP shards from the GPU to CPU memory; this run is "
                                  "on the CPU already: drop it")
            names = {id(p): n for n, p in self.module.named_parameters()}
            param_lr = {names[k]: v for k, v in (param_lr or {}).items() if k in names}
            self._twin = meta_twin(self.module)  # filled with the gathered weights by consolidated()
            blocks = list({id(b): b for stack in stacks for b in stack.layers}.values())
            shard(self.module, blocks, precision=self.precision, offload=cfg.cpu_offload)
            params = dict(self.module.named_parameters())
            param_lr = {id(params[n]): v for n, v in param_lr.items()}
        elif d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # DDP must be told when some trainable parameter gets no gradient (a BERT pooler under a task head that
            # pools [CLS] itself, ...): it then searches the graph every step, so ask only when it is needed
            unused = self._unused_parameters()
            self.ddp = DDP(self.module, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                           find_unused_parameters=bool(unused))
        self.scaler = None
        if self.precision == "fp16":  # dynamic loss scale: overflowing steps are skipped and the scale lowered
            if self.fsdp:  # its overflow check is agreed over the processes, which hold different gradient shards
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(d.device.type)
            else:
                self.scaler = torch.amp.GradScaler(d.device.type)
        # on a CPU, torch's AdamW defaults to a loop over the parameters, several passes each with temporaries the
        # size of the largest (MiniLM: 92 ms a step and ~90 MB more peak memory, against 15 ms for the fused kernel,
        # one pass; AMD EPYC, 1 thread); the fused kernel is the same update (what transformers' Trainer uses too;
        # build_optimizer bumps the parameters' versions after it, which the kernel does not)
        fused = (d.device.type == "cpu" and not cfg.amsgrad and not self.sharded and self.precision != "fp16") or None
        self.optimizer = build_optimizer([model, objective], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, amsgrad=cfg.amsgrad,
                                         param_lr=param_lr, fused=fused)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, warmup_steps=cfg.warmup_steps,
                                         total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
        if cfg.compile:
            for stack in (model.transformer.encoder, model.transformer.decoder):
                if stack is not None:
                    for block in stack.layers:
                        block.compile()  # in place: state_dict keys unchanged
        self.step = 0
        self.position = {"epoch": 0, "batch": 0}
        self._plan_epoch = None
        self._plan: list[np.ndarray] = []
        # an on-policy task training several steps on one rollout (grpo's task.num_iterations): this process's
        # rolled-out micro-batches and their epoch, until the next rollout (in every checkpoint taken between)
        self._rollout: dict | None = None

    def _unused_parameters(self) -> list[str]:
        """Names of trainable parameters that no loss term reaches, found by one forward/backward pass over two
        training examples (the random number generators are put back afterwards, so the run is unchanged)."""
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if self.dist.device.type == "cuda" else None
        try:
            batch = self.make_batch(self.data.train_ids[:2], epoch=0)
            if hasattr(self.objective, "rollout"):  # grpo: completions to train on (this process's alone, no step)
                with self._autocast():
                    batch = self.objective.rollout(self.model, [batch], step=-1, seed=self.cfg.seed,
                                                   rank=self.dist.rank, world=1)[0][0]
            totals = {k: max(float(v), 1.0) for k, v in self.objective.counts(batch).items()}
            self.module.train()
            with self._autocast():  # as a step runs it (a base stored in bf16 runs only under bf16 autocast)
                loss, _ = self.module(_to(batch, self.dist.device), totals)
            loss.backward()
            unused = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        finally:
            self.module.zero_grad(set_to_none=True)
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        return unused

    # -- data --------------------------------------------------------------------------------------
    def _rng(self, example_id: int, epoch: int) -> np.random.Generator:
        dynamic = getattr(self.objective, "corrupts", True) and getattr(self.objective.cfg, "dynamic", True)
        return np.random.default_rng([self.cfg.seed, epoch if dynamic else 0, int(example_id)])

    def _random_block(self, rng: np.random.Generator):
        ids = self.data.train_ids
        return self.data.get(int(ids[rng.integers(len(ids))]))

    def make_batch(self, ids: Sequence[int], epoch: int) -> dict[str, torch.Tensor]:
        """Collate the examples ``ids`` as seen in ``epoch`` (corruption depends only on seed, epoch, id)."""
        examples = [self.objective.example(self.data.get(int(i)), self._rng(int(i), epoch), self._random_block)
                    for i in ids]
        return self.objective.collate(examples)

    def _global_batch(self) -> tuple[np.ndarray, int]:
        from ..data.packing import batch_plan

        epoch, b = self.position["epoch"], self.position["batch"]
        while True:
            if self._plan_epoch != epoch:
                lengths = self.data.lengths if self.bucket else None  # indexed by example id
                plan = batch_plan(self.data.train_ids, batch_size=self.cfg.batch_size, epoch=epoch,
                                  seed=self.cfg.seed, lengths=lengths, bucket=self.bucket)
                self._plan, self._plan_epoch = plan, epoch
            if b < len(self._plan):
                break
            epoch, b = epoch + 1, 0
        self.position = {"epoch": epoch, "batch": b + 1}
        return self._plan[b], epoch

    # -- one optimizer step ------------------------------------------------------------------------
    def _autocast(self):
        if self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(self.dist.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _reuses_rollout(self) -> bool:
        """Whether this step trains on the batches of an earlier step's rollout (not on new ones)."""
        return hasattr(self.objective, "rollout") and self.step % getattr(self.objective, "iterations", 1) != 0

    def train_step(self) -> dict:
        cfg, d = self.cfg, self.dist
        rolled: dict = {}
        if self._reuses_rollout():  # on-policy, several steps a rollout: its batches again (no new prompts read)
            if self._rollout is None:
                raise RuntimeError(f"step {self.step + 1} trains on an earlier step's rollout, which is not kept")
            batches, epoch = self._rollout["batches"], self._rollout["epoch"]
        else:
            ids, epoch = self._global_batch()
            per_rank = len(ids) // d.world
            local = ids[d.rank * per_rank:(d.rank + 1) * per_rank]  # this process's shard of the global batch
            micro = np.array_split(local, cfg.grad_accum)
            batches = [self.make_batch(m, epoch) for m in micro]
            if hasattr(self.objective, "rollout"):  # on-policy tasks (grpo): the model writes the step's examples
                with self._autocast():
                    batches, rolled = self.objective.rollout(self.model, batches, step=self.step, seed=cfg.seed,
                                                             rank=d.rank, world=d.world)
                if getattr(self.objective, "iterations", 1) > 1:
                    self._rollout = {"batches": batches, "epoch": epoch}
        counts = [self.objective.counts(b) for b in batches]
        terms = sorted({k for c in counts for k in c})
        local_totals = torch.tensor([[sum(c.get(k, 0) for c in counts) for k in terms]
                                     + [sum(self.objective.tokens_in(b) for b in batches)]], dtype=torch.float64)
        global_totals = all_reduce_sum(local_totals, d)[0]
        totals = {k: max(float(global_totals[i]), 1.0) for i, k in enumerate(terms)}
        n_tokens = int(global_totals[-1])
        self.model.train()
        self.objective.train()
        net = self.ddp or self.module
        loss_sum = 0.0
        stats_sum: dict[str, float] = {}
        # an objective whose loss runs the model's backward itself, in several passes (the embedding task's GradCache
        # form): DDP would average the gradients after the first pass and drop the rest, so it syncs none and the
        # step averages them over the processes below, once every pass has run
        own_sync = self.ddp is not None and getattr(self.objective, "backward_in_passes", False)
        for j, batch in enumerate(batches):
            sync = self.ddp is None or (j == len(batches) - 1 and not own_sync)
            ctx = contextlib.nullcontext() if sync else self.ddp.no_sync()
            with ctx:
                with self._autocast():
                    loss, stats = net(_to(batch, d.device), totals)
                scaled = loss * d.world  # DDP and FSDP average gradients over processes; we want their sum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            loss_sum += float(loss.detach())
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + v
        if own_sync:
            average_gradients([p for p in self.module.parameters() if p.requires_grad], d)
        reduced = all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64), d)
        step_loss = float(reduced[0])
        if not math.isfinite(step_loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"non-finite loss ({step_loss}) at step {self.step + 1}")
        grad_norm = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], cfg.clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when a gradient is inf/NaN
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        if not skipped:  # a skipped step leaves the schedule where it was, as it leaves the weights
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out = {"loss": step_loss, "lr": lr, "tokens": n_tokens, "epoch": epoch}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.get_scale()
            out["skipped"] = int(skipped)
        out.update(rolled)  # the rollout's metrics (the same on every process)
        for k in terms:
            if f"{k}_correct" in stats_sum:
                out[f"{k}_acc"] = None  # filled below after reduction
        keys = sorted(stats_sum)
        vals = all_reduce_sum(torch.tensor([stats_sum[k] for k in keys], dtype=torch.float64), d)
        red = dict(zip(keys, vals.tolist()))
        for k in terms:
            if f"{k}_loss" in red:
                out[f"{k}_loss"] = red[f"{k}_loss"] / totals[k]
            if f"{k}_correct" in red:
                out[f"{k}_acc"] = red[f"{k}_correct"] / totals[k]
        for key, v in red.items():  # "{term}:{name}": a sum over the term's units, logged as their mean under name
            term, sep, name = key.partition(":")
            if sep and term in totals:
                out[name] = v / totals[term]
        return out

    # -- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss of every term over the held-out ids (sharded over processes), perplexity, accuracies,
        and the ``evaluator``'s metrics."""
        out = self._evaluate_objective()
        if self.evaluator is not None:
            rng_state = torch.get_rng_state()
            out.update(self.evaluator())
            torch.set_rng_state(rng_state)
        return out

    def _evaluate_objective(self) -> dict:
        cfg, d = self.cfg, self.dist
        ids = self.data.eval_ids
        if len(ids) == 0:
            return {}
        bs = max(1, cfg.batch_size // cfg.grad_accum // d.world)
        chunks = [ids[i:i + bs] for i in range(0, len(ids), bs)]
        if cfg.eval_batches:
            chunks = chunks[: cfg.eval_batches * d.world]
        mine = chunks[d.rank::d.world]
        if self.fsdp:  # every forward gathers weights from all processes: each runs as many (extras discarded)
            mine = mine + [None] * (-(-len(chunks) // d.world) - len(mine))
        self.model.eval()
        self.objective.eval()
        sums: dict[str, float] = {}
        rng_state = torch.get_rng_state()  # evaluation must not move the training RNG (exact resume)
        torch.manual_seed(cfg.seed)
        for chunk in mine:
            batch = self.make_batch(chunks[0] if chunk is None else chunk, epoch=EVAL_EPOCH)  # the same corruption
            counts = self.objective.counts(batch)                                              # at every evaluation
            with self._autocast():
                _, stats = self.module(_to(batch, d.device), {k: 1.0 for k in counts})
            if chunk is None:
                continue
            for k, v in list(stats.items()) + [(f"{k}_n", float(n)) for k, n in counts.items()]:
                sums[k] = sums.get(k, 0.0) + v
        torch.set_rng_state(rng_state)
        keys = sorted(all_gather_objects(sorted(sums), d)[0]) if d.enabled else sorted(sums)
        vals = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64), d)
        red = dict(zip(keys, vals.tolist()))
        out: dict[str, float] = {}
        total = 0.0
        weights = getattr(self.objective, "term_weights", {})  # e.g. ELECTRA's lambda on its RTD term
        for k in sorted(x[:-2] for x in red if x.endswith("_n")):
            n = max(red[f"{k}_n"], 1.0)
            if f"{k}_loss" in red:
                out[f"{k}_loss"] = red[f"{k}_loss"] / n
                total += weights.get(k, 1.0) * out[f"{k}_loss"]
                if k in ("lm", "mlm"):
                    out[f"{k}_ppl"] = math.exp(min(out[f"{k}_loss"], 50.0))
            if f"{k}_correct" in red:
                out[f"{k}_acc"] = red[f"{k}_correct"] / n
        out["loss"] = total
        return out

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        rng = all_gather_objects(torch.get_rng_state(), self.dist)
        # a rollout the next steps still train on goes into the checkpoint, each process's own
        rollout = all_gather_objects(self._rollout, self.dist) if self._reuses_rollout() else None
        path = None
        callbacks = [cb.state_dict(self.step) for cb in self.callbacks]
        if self.fsdp:  # a callback's copy of sharded weights (keep-best) is saved whole (every process gathers it)
            callbacks = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in c.items()}
                         for c in callbacks]
        if self.dist.is_main or self.sharded:  # sharded: every process writes its slice
            path = save_training_state(self.run_dir, step=self.step, model=self.model, objective=self.objective,
                                       optimizer=self.optimizer, scheduler=self.scheduler, tokenizer=self.tokenizer,
                                       position=dict(self.position), rng_states=rng, run_config=self.run_config,
                                       keep_last=self.cfg.keep_last,
                                       callbacks=callbacks, stopped_early=self.stopped_early, scaler=self.scaler,
                                       sharded=self.module if self.sharded else None, dist=self.dist,
                                       rollout=rollout)
        barrier(self.dist)
        return path or (self.run_dir / "checkpoints" / f"step-{self.step:08d}")

    def resume(self, log: Callable[[str], None] = print) -> int:
        """Restore the newest intact checkpoint of the run folder; returns the step it resumes from (0: none).
        A checkpoint that does not load (truncated, corrupt, from another run) is skipped for the one before it,
        saying which and why; temp folders of interrupted checkpoint writes are removed."""
        from ..config import ConfigError

        if self.dist.is_main:
            for name in clean_interrupted(self.run_dir):
                log(f"removed {name}: an interrupted checkpoint write")
        barrier(self.dist)
        # rank 0 lists the checkpoints; every process tries the same one and they agree whether it loaded, so a
        # checkpoint one process cannot read is skipped by all (none hangs waiting for another)
        ckpts = all_gather_objects(list_checkpoints(self.run_dir) if self.dist.is_main else None, self.dist)[0]
        skipped, state = [], None
        for ckpt in reversed(ckpts):
            try:
                state, why = load_training_state(ckpt, model=self.model, objective=self.objective,
                                                 optimizer=self.optimizer, scheduler=self.scheduler,
                                                 scaler=self.scaler, sharded=self.module if self.sharded else None), ""
            except CheckpointError as e:
                state, why = None, str(e)
            whys = [w for w in all_gather_objects(why, self.dist) if w]
            if not whys:
                break
            skipped.append(f"{ckpt.name}: {whys[0]}")
            state = None
        if state is None:
            if skipped:
                raise CheckpointError(f"no checkpoint of {self.run_dir} loads: " + "; ".join(skipped))
            return 0
        if self.dist.is_main:
            for why in skipped:
                log(f"skipped checkpoint {why}")
        rngs = state["rng"]
        if len(rngs) != self.dist.world and not self.sharded:
            raise ConfigError(f"{ckpt} was written by {len(rngs)} process(es) and this run has {self.dist.world}: "
                              f"resume it with {len(rngs)} (torchrun --nproc_per_node {len(rngs)}); runs with "
                              "train.parallel=fsdp resume with any number")
        if len(rngs) != self.dist.world and self.dist.is_main:  # the data order is global; dropout's draws differ
            log(f"resuming a checkpoint of {len(rngs)} process(es) with {self.dist.world}: the same examples follow, "
                "in the same global batches")
        torch.set_rng_state(rngs[self.dist.rank % len(rngs)])
        for cb, cb_state in zip(self.callbacks, state.get("callbacks") or []):
            cb.load_state_dict(cb_state)
        self.step = int(state["step"])
        rollouts = state.get("rollout")
        self._rollout = rollouts[self.dist.rank] if rollouts else None
        if self._reuses_rollout() and self._rollout is None:
            raise ConfigError(f"{ckpt} stopped between the steps that train on one rollout and does not hold it "
                              "(written with another task.num_iterations?): resume with the run's own settings")
        self.position = {k: int(v) for k, v in state["position"].items()}
        self.stopped_early = bool(state.get("stopped_early", False))  # a run that stopped early is finished
        return self.step

    def consolidated(self, *, objective: bool = False):
        """The trained model with ordinary (unsharded) tensors, on every process: ``self.model`` itself unless the
        run is sharded (FSDP), else a plain copy filled with the gathered weights (a collective: every process calls
        it). For export and for evaluation that each process runs on its own. ``objective``: (model, objective),
        the objective's own parts (ELECTRA's generator) gathered too."""
        if not self.fsdp:
            return (self.model, self.objective) if objective else self.model
        from .parallel import consolidated, full_state

        plain = consolidated(self._twin, full_state(self.module, to_all=True), self.module).to(self.dist.device)
        return (plain.model, plain.objective) if objective else plain.model

    def _write_run_config(self, start: int) -> None:
        """run.yaml: the config the run uses, written once the run has started (a refused or failed resume leaves
        the old one as it was). A resume with another config (a longer run, other intervals) keeps the earlier
        file as ``run.until-step-N.yaml``, so the record of the first part stays."""
        import os

        from ..io.outputs import mark

        path = self.run_dir / "run.yaml"
        tmp = self.run_dir / ".run.yaml.tmp"
        self.run_config.save(tmp)
        if start and path.is_file() and path.read_bytes() != tmp.read_bytes():
            kept = self.run_dir / f"run.until-step-{start:08d}.yaml"
            os.replace(path, kept)
            mark(self.run_dir, [kept.name])
        os.replace(tmp, path)

    def _after_evaluation(self, metrics: dict) -> bool:
        """Run every callback's ``on_evaluate``; True when one asks to stop."""
        for cb in self.callbacks:
            cb.on_evaluate(self, self.step, metrics)
        return any(cb.stop for cb in self.callbacks)

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, *, resume: bool = False, log: Callable[[str], None] = print) -> TrainResult:
        from ..config import ConfigError
        from ..io.progress import progress
        from .logging import MetricsLogger
        from .trackers import open_trackers

        cfg, d = self.cfg, self.dist
        start = self.resume(log) if resume else 0
        if resume and not start:
            raise ConfigError(f"nothing to resume in {self.run_dir}: it holds no checkpoint (train.keep_last=0 "
                              "writes none, and a run stopped before its first save_every has none); start it again "
                              "with --overwrite")
        if resume and d.is_main:
            log(f"resumed from step {start} ({self.run_dir / 'checkpoints'})")
        if d.is_main and self.run_config is not None:
            self._write_run_config(start)
        trackers = self.trackers if self.trackers is not None else open_trackers(
            cfg, self.run_dir, config=self.run_config.to_dict() if self.run_config is not None else None,
            resume=resume, enabled=d.is_main)
        logger = MetricsLogger(self.run_dir, tensorboard="tensorboard" in cfg.trackers, trackers=trackers,
                               enabled=d.is_main, append=resume, resume_step=start)
        bar = progress(total=cfg.steps, initial=start, disable=not (d.is_main and self.show_progress),
                   desc="train", unit="step", dynamic_ncols=True)
        t0 = time.perf_counter()
        tokens = 0
        last: dict = {}
        eval_out: dict = {}
        ckpt = None
        signals = _SignalFlag()
        finished = bool(start) and (start >= cfg.steps or self.stopped_early)  # resumed at its end: nothing to do
        try:
            while self.step < cfg.steps and not self.stopped_early:
                ts = time.perf_counter()
                try:
                    last = self.train_step()
                except StepError as e:  # input the step cannot use (a reward function failing on a record)
                    # one process alone cannot write a checkpoint the others take part in: under torchrun none is
                    saved = self.save_checkpoint() if cfg.keep_last and self.step and not d.enabled else None
                    where = (f"the {self.step} steps done are kept in {saved}: fix it and run again with --resume"
                             if saved else "no checkpoint written now")
                    raise StepError(f"{e} (at step {self.step + 1}; {where})") from None
                except TrainingDiverged as e:
                    kept = list_checkpoints(self.run_dir)
                    where = f"the last good checkpoint is {kept[-1]}" if kept else "no checkpoint was written yet"
                    raise TrainingDiverged(f"{e}; stopping: {where}. Try a lower train.lr, train.clip=1.0 or "
                                           "train.precision=fp32.") from None
                dt = time.perf_counter() - ts
                tokens += last["tokens"]
                last["tokens_per_s"] = last["tokens"] / max(dt, 1e-9)
                for cb in self.callbacks:
                    cb.on_step(self, self.step, last)
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}", lr=f"{last['lr']:.2e}")
                if self.step % max(cfg.log_every, 1) == 0 or self.step == cfg.steps:
                    logger.log(self.step, "train", **{k: v for k, v in last.items() if v is not None})
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    eval_out = self.evaluate()
                    logger.log(self.step, "eval", **eval_out)
                    if d.is_main and eval_out and self.show_progress:
                        bar.write(_fmt_eval(self.step, eval_out))
                    if self._after_evaluation(eval_out):
                        self.stopped_early = True
                        log(f"early stop at step {self.step}: no dev improvement") if d.is_main else None
                        break
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps and cfg.keep_last:
                    ckpt = self.save_checkpoint()
                signum = signals.agreed(d)
                if signum and self.step < cfg.steps:  # finish the step, keep it, stop
                    saved = ckpt if ckpt is not None and ckpt.name == f"step-{self.step:08d}" else None
                    if cfg.keep_last and saved is None:
                        saved = self.save_checkpoint()
                    raise Interrupted(signum, self.step, saved)
            if not finished:
                if not self.stopped_early:
                    eval_out = self.evaluate()
                    if eval_out:
                        logger.log(self.step, "eval", **eval_out)
                        if d.is_main and self.show_progress:
                            bar.write(_fmt_eval(self.step, eval_out))
                    self._after_evaluation(eval_out)
                if cfg.keep_last:
                    ckpt = self.save_checkpoint()
            for cb in self.callbacks:
                cb.on_train_end(self)
        finally:
            signals.restore()
            bar.close()
            logger.close()
            if trackers is not self.trackers:  # opened above: ended here (a job ends its own after its artifacts)
                trackers.close(failed=sys.exc_info()[0] is not None)
        return TrainResult(step=self.step, train_loss=last.get("loss", float("nan")), eval=eval_out,
                           seconds=time.perf_counter() - t0, tokens=tokens, run_dir=self.run_dir, checkpoint=ckpt)


class _SignalFlag:
    """SIGINT / SIGTERM during training set a flag instead of killing the process; the loop stops after the step
    it is in (a second Ctrl-C stops at once). Under DDP the processes agree on the flag every step."""

    def __init__(self):
        import signal
        import threading

        self.signum = 0
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is signal.SIG_IGN:  # ignored by whoever started us (`cmd &`): keep it so
                    continue
                self.old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        import signal

        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = signum

    def agreed(self, d: DistInfo) -> int:
        """The signal received (0: none); under DDP, one any process received, the same on every process."""
        import signal

        if not d.enabled:
            return self.signum
        got = torch.tensor([[self.signum == signal.SIGINT, self.signum == signal.SIGTERM]], dtype=torch.float64)
        total = all_reduce_sum(got, d)[0]
        return signal.SIGINT if total[0] else signal.SIGTERM if total[1] else 0

    def restore(self) -> None:
        import signal

        for sig, handler in self.old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python


def _fmt_eval(step: int, ev: dict) -> str:
    parts = [f"{k} {v:.4g}" for k, v in ev.items()]
    return f"eval @ step {step}: " + ", ".join(parts)
