"""How a finetuning run trains — every weight, only the task head, or an adapter on a frozen base: the one place
that asks about PEFT. Each method says its default learning rate and the room left for the task's inputs, sets the
model up before training and saves what the run produces."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

from ...config import ConfigError
from ...loading import TASK_FILE
from ...peft.config import PeftConfig
from ...tasks.run import save_task, task_json
from .config import FULL_LR, HEAD_LR, FinetuneConfig


class FullMethod:
    """Every weight trains (or, with tune.freeze_body, only the task head); the result is a whole checkpoint."""

    def __init__(self, freeze_body: bool = False):
        self.freeze_body = freeze_body
        self.name = "head only (body frozen)" if freeze_body else "full finetuning"
        self.default_lr = HEAD_LR if freeze_body else FULL_LR  # a linear probe trains only a fresh head
        self.base_dtype, self.base_note = "fp32", ""  # every weight stays fp32
        self.layout_note = ""  # a whole checkpoint: no adapter layout to tell
        self.new_token_ids: list[int] = []  # task.add_tokens' ids (prepare sets them): trained with the rest

    def default_head_lr(self, lr: float) -> float:
        """The task head's rate when tune.head_lr is not set: the run's (full finetuning, a probe)."""
        return lr

    def room(self, cfg: FinetuneConfig, model_cfg) -> int:
        """Positions the task's inputs may take (all of them)."""
        return model_cfg.max_seq_len

    def setup(self, model, tok, cfg: FinetuneConfig, log) -> None:
        if self.freeze_body and self.new_token_ids:
            raise ConfigError("task.add_tokens with tune.freeze_body=true: the new tokens' rows would stay at their "
                              "start (the mean of the others); finetune fully, or use --peft to train only them")
        if self.freeze_body:
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("head."))

    def reference(self, model):
        """A preference task's reference model: a frozen copy of the weights the run starts from (kept out of the
        module tree, so no checkpoint holds it), moved to the policy's device on first use, run in eval mode."""
        frozen = copy.deepcopy(model).eval().requires_grad_(False)

        @contextlib.contextmanager
        def use(policy):
            device = next(policy.parameters()).device
            if next(frozen.parameters()).device != device:
                frozen.to(device)
            yield frozen

        return use

    def save(self, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        from ...io.checkpoint import save

        if self.freeze_body:
            for p in model.parameters():
                p.requires_grad_(True)
        save(model, model_dir, tokenizer=tok)
        save_task(model_dir, cfg.task)
        return {}

    def save_library_folder(self, task, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        """A task whose model is another library's folder (embedding: sentence-transformers; rerank: a CrossEncoder
        folder): the checkpoint, then made that folder (``task.write_model_files``)."""
        from ...io.outputs import mark

        extra = self.save(model, tok, model_dir, cfg, log)
        mark(model_dir, task.write_model_files(model, tok, model_dir, log))
        return extra


class AdapterMethod:
    """A parameter-efficient adapter (``peft.method``) on a frozen base; the result is a small adapter folder
    (peft's layout for LoRA) that records its base."""

    def __init__(self, peft_cfg: PeftConfig):
        from ...peft import METHODS

        self.cfg = peft_cfg
        self.modules = [METHODS[m] for m in peft_cfg.methods]
        self.name = f"peft {peft_cfg.method}"
        self.default_lr = self.modules[0].DEFAULT_LR  # a combination: the first method's
        self.base_dtype = "fp32"  # how the frozen base's linear weights are stored (peft.base_dtype, resolved)
        self.base_note = ""  # the start line saying so, when they are cast
        self.base_bytes_saved = 0
        self.layout_note = ""  # the end of the run's line on the adapter's layout (peft's or pretune's, and why)
        self.new_token_ids: list[int] = []  # task.add_tokens' ids (prepare sets them): their rows train, no other

    def default_head_lr(self, lr: float) -> float:
        """The task head's rate when tune.head_lr is not set: HEAD_LR, or the run's when that is higher."""
        return max(lr, HEAD_LR)

    def room(self, cfg: FinetuneConfig, model_cfg) -> int:
        """Positions left for the task's inputs: a soft prompt takes some of an absolute position table."""
        taken = sum(getattr(m, "positions_taken", lambda c: 0)(self.cfg) for m in self.modules)
        return model_cfg.max_seq_len - (taken if model_cfg.position in ("learned", "sinusoidal") else 0)

    def setup(self, model, tok, cfg: FinetuneConfig, log) -> None:
        from ... import peft

        self.cfg = cfg.peft  # base_dtype resolved (auto -> fp32 or bf16)
        summary = peft.inject(model, self.cfg, name="default", tokenizer=tok, seed=cfg.train.seed)
        if self.new_token_ids:  # task.add_tokens: their rows train beside the adapter, the table stays frozen
            from ...peft.new_tokens import train_new_tokens

            train_new_tokens(model, "default", self.new_token_ids)
            summary = {**summary, **peft.trainable_summary(model)}
        log(f"{self.name}: {peft.format_summary(summary)}")
        self.base_dtype = self.cfg.base_dtype
        if "base_cast" in summary:
            self.base_bytes_saved = summary["base_bytes_saved"]
            self.base_note = (f"frozen base: {self.base_dtype} ({summary['base_cast']:,} linear weights, "
                              f"{self.base_bytes_saved / 1e6:.1f} MB saved; embeddings, norms and biases fp32)")

    def reference(self, model):
        """A preference task's reference model: the same model with every adapter switched off, in eval mode (no
        second copy). A method that trains base parameters (biases, embeddings) leaves none to switch off."""
        from ... import peft

        owned = peft.peft_state(model).owned("default")
        if owned:
            raise ConfigError(f"peft.method={self.cfg.method} trains base parameters ({owned[0]}"
                              f"{f' and {len(owned) - 1} more' if len(owned) > 1 else ''}), so switching the adapter "
                              "off does not give the reference model back; use lora, adapter, ia3, prefix or prompt, "
                              "or a reference-free loss (task.loss=simpo or orpo)")

        @contextlib.contextmanager
        def use(policy):
            state, training = peft.peft_state(policy), policy.training
            active = list(state.active)
            peft.set_active(policy, None)
            policy.eval()
            try:
                yield policy
            finally:
                peft.set_active(policy, active)
                policy.train(training)

        return use

    def save(self, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        from ... import peft

        peft.save_adapter(model, model_dir, base=str(Path(cfg.model["init"]).resolve()), tokenizer=tok,
                          extra_files={TASK_FILE: task_json(cfg.task)})
        sizes = {"adapter_bytes": peft.adapter_size(model_dir),  # the full model as saved: fp32 (a bf16 base widened)
                 "full_model_bytes": sum(t.numel() * t.element_size() for t in peft.base_state(model).values())
                 + self.base_bytes_saved}
        a, f = sizes["adapter_bytes"], sizes["full_model_bytes"]
        log(f"adapter -> {model_dir}: {a / 1e6:.2f} MB, against {f / 1e6:.1f} MB for the full model "
            f"({100 * a / f:.2f}%)")
        meta = peft.read_meta(model_dir)
        if meta["layout"] == "peft":
            self.layout_note = (f"adapter layout: peft's ({model_dir}/adapter_config.json; "
                                "peft.PeftModel.from_pretrained loads it)")
        else:
            self.layout_note = (f"adapter layout: pretune's, not peft's: {meta['layout_why']}; pretune loads it "
                                "(pretune.load, evaluate, predict, peft merge)")
        return {"peft": {"method": self.cfg.method, **peft.trainable_summary(model), **sizes,
                         "base_dtype": self.base_dtype, "layout": meta["layout"],
                         **({"layout_why": meta["layout_why"]} if "layout_why" in meta else {})}}


    def save_library_folder(self, task, model, tok, model_dir: Path, cfg: FinetuneConfig, log) -> dict:
        """A task whose model is another library's folder (embedding: sentence-transformers; rerank: a CrossEncoder
        folder), which holds whole weights: ``model/`` gets the base with the adapter merged in (fp32), made that
        folder, so ``SentenceTransformer(RUN/model)`` and every pretune command read it with no base at hand; the
        adapter itself goes beside it, to ``<run>/adapter`` (it records its base; pretune loads it, and peft's
        layout loads in peft). An adapter that does not merge (prefix, prompt, bottleneck adapters add computation)
        stays in ``model/``, and ``log`` says why."""
        from ... import peft
        from ...io.checkpoint import save
        from ...io.outputs import mark

        try:
            plain = peft.merged_model(model, "default")
        except peft.PeftError as e:
            log(f"model/ holds the adapter (pretune loads it), not a {task.folder_kind} folder: {e}")
            return self.save(model, tok, model_dir, cfg, log)
        adapter_dir = model_dir.parent / "adapter"
        extra = self.save(model, tok, adapter_dir, cfg, log)
        mark(model_dir.parent, ["adapter"])
        save(plain, model_dir, tokenizer=tok)
        save_task(model_dir, cfg.task)
        written = task.write_model_files(plain, tok, model_dir, log)
        mark(model_dir, written)
        log(f"model -> {model_dir}: the base with the adapter merged in (fp32); the adapter -> {adapter_dir}")
        return {**extra, "peft": {**extra["peft"], "adapter_dir": "adapter", "model": "merged"}}


def method_for(cfg: FinetuneConfig) -> FullMethod | AdapterMethod:
    """How a run trains: an adapter (peft.method), only the head (tune.freeze_body), or everything."""
    return AdapterMethod(cfg.peft) if cfg.peft.method else FullMethod(cfg.tune.freeze_body)
