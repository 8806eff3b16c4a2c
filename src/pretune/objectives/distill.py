"""Knowledge distillation, as DistilBERT does it (Sanh et al. 2019; the soft-target loss of Hinton et al. 2015, the
prediction-layer term of TinyBERT, Jiao et al. 2020): a student learns from a frozen teacher's predictions on the
data of masked-LM (mlm) or causal-LM (clm) pretraining::

    loss = alpha_kl   · T² · KL(softmax(z_t / T) ‖ softmax(z_s / T))   mean over the predicted positions
         + alpha_hard · CE(z_s, true token)                             the student's own MLM / CLM loss
         + alpha_cos  · (1 − cos(h_s, h_t))                             last hidden states, mean over real tokens

z_s, z_t are the student's and the teacher's logits; the predicted positions are the masked ones (MLM) or every one
with a next token (CLM), which of the two follows the teacher's head. T² keeps the soft term's gradient on the scale
of the hard term's whatever T (Hinton et al. 2015 §2). The teacher (any model folder, ``objective.teacher``, loaded by
the job) is frozen: it gets no gradient, stays in eval mode while the student trains, and is left out of the training
checkpoints (a resumed run loads it from its folder again). ``init_from_teacher: every_other`` starts the student from
the teacher's embeddings, head and layers 0, 2, 4, ... (DistilBERT's initialisation).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..model.layout import check_family
from .base import IGNORE, Objective, summed_ce
from .encoder import MaskedLM, MaskingSettings
from .lm import CausalLM


@dataclass
class DistillSettings(MaskingSettings):
    """Distillation: the teacher, the temperature and the weight of each loss term (masking keys: MLM teachers)."""

    teacher: str = ""  # the teacher's folder: a pretune checkpoint or Hugging Face model (`pretune distill --teacher`)
    temperature: float = 2.0  # T: teacher and student logits are divided by T before the softmax (DistilBERT: 2)
    alpha_kl: float = 5.0  # weight of T² · KL(teacher ‖ student) over the predicted positions (DistilBERT: 5)
    alpha_hard: float = 2.0  # weight of the student's own MLM / CLM loss on the true tokens (DistilBERT: 2)
    alpha_cos: float = 0.0  # weight of 1 − cos(last hidden states) over real tokens (DistilBERT: 1); needs the
    # student as wide as the teacher
    init_from_teacher: Literal["none", "every_other"] = "none"  # every_other: student layer i starts as teacher layer
    # 2i, embeddings, final norm and head copied (DistilBERT); needs the teacher's shapes but for depth

    def validate(self):
        super().validate()
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature={self.temperature} must be > 0")
        for name in ("alpha_kl", "alpha_hard", "alpha_cos"):
            if getattr(self, name) < 0:
                raise ConfigError(f"objective.{name}={getattr(self, name)} must be >= 0")
        if self.alpha_kl == self.alpha_hard == self.alpha_cos == 0:
            raise ConfigError("objective.alpha_kl, alpha_hard and alpha_cos are all 0: nothing to train on")


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · Σ_positions KL(softmax(teacher / T) ‖ softmax(student / T)): logits (N, vocab) -> () summed over N."""
    t = temperature
    log_p_student = F.log_softmax(student.float() / t, dim=-1)
    log_p_teacher = F.log_softmax(teacher.float() / t, dim=-1)
    return F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="sum") * (t * t)


def init_every_other(student, teacher) -> list[tuple[str, str]]:
    """Copy the teacher into the student as DistilBERT does: student layer i <- teacher layer 2i, every other tensor
    (embeddings, positions, norms, head) by name. Both are TransformerLMs of the same shapes but for depth. Returns
    the (student, teacher) name pairs copied; a shape or name the teacher lacks is a ConfigError naming it."""
    n_s, n_t = student.config.n_layers, teacher.config.n_layers
    if 2 * (n_s - 1) >= n_t:
        raise ConfigError(f"init_from_teacher=every_other copies teacher layers 0, 2, 4, ...: a student of {n_s} "
                          f"layers needs a teacher of at least {2 * n_s - 1}, the teacher has {n_t} (set "
                          f"model.n_layers <= {(n_t + 1) // 2})")
    theirs = teacher.state_dict()
    pairs = []
    with torch.no_grad():
        for name, tensor in student.state_dict(keep_vars=True).items():
            source = re.sub(r"^(transformer\.(?:encoder|decoder)\.layers\.)(\d+)\.",
                            lambda m: f"{m.group(1)}{2 * int(m.group(2))}.", name)
            if source not in theirs:
                raise ConfigError(f"init_from_teacher=every_other: the teacher has no tensor {source!r} for the "
                                  f"student's {name!r} (the student must be the teacher's architecture, fewer layers)")
            if theirs[source].shape != tensor.shape:
                raise ConfigError(f"init_from_teacher=every_other: the student's {name} has shape "
                                  f"{tuple(tensor.shape)}, the teacher's {source} {tuple(theirs[source].shape)} (the "
                                  f"student must be as wide as the teacher: dim, ffn_dim, heads, vocabulary)")
            tensor.copy_(theirs[source])
            pairs.append((name, source))
    return pairs


def _drop_teacher(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the frozen teacher is an input of the run, not part of its state."""
    for key in [k for k in state_dict if k.startswith(prefix + "teacher.")]:
        del state_dict[key]


class Distill(Objective):
    """A student trained on a frozen teacher's soft targets (+ the hard MLM / CLM loss, + a hidden-state cosine)."""

    name = "distill"
    Settings = DistillSettings
    archs = ("encoder", "decoder")
    why = "distillation trains on a masked-LM (encoder) or causal-LM (decoder) teacher's predictions;"
    head = None  # the teacher's: mlm or lm (checked below)

    def __init__(self, cfg, model_cfg, tokenizer, *, model=None, teacher=None):
        super().__init__(cfg, model_cfg, tokenizer)
        if teacher is None:
            raise ConfigError("objective 'distill' needs a teacher: set objective.teacher=FOLDER (a pretune "
                              "checkpoint or Hugging Face model; `pretune distill --teacher FOLDER`)")
        tcfg = teacher.config
        base = {"mlm": MaskedLM, "lm": CausalLM}.get(tcfg.head)
        if base is None:
            raise ConfigError(f"the teacher {cfg.teacher} has head={tcfg.head!r}: distillation takes its soft targets "
                              "from a masked-LM (mlm) or language-model (lm) head")
        check_family(tcfg, base.archs, who=f"the teacher of objective 'distill' ({base.name})", why=base.why)
        if model_cfg.head != tcfg.head:
            raise ConfigError(f"the student has head={model_cfg.head!r} and the teacher head={tcfg.head!r}: set "
                              f"model.head={tcfg.head}")
        if model_cfg.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"model.vocab_size ({model_cfg.vocab_size}) differs from the teacher's "
                              f"({tcfg.vocab_size}): the KL term compares distributions over one vocabulary; set "
                              f"model.vocab_size={tcfg.vocab_size} and use the teacher's tokenizer")
        if cfg.alpha_cos and model_cfg.dim != tcfg.dim:
            raise ConfigError(f"objective.alpha_cos={cfg.alpha_cos} compares last hidden states: the student "
                              f"(model.dim={model_cfg.dim}) must be as wide as the teacher ({tcfg.dim}); set "
                              "objective.alpha_cos=0")
        if base is CausalLM:
            for f in dataclasses.fields(MaskingSettings):
                if f.name != "name" and getattr(cfg, f.name) != f.default:
                    raise ConfigError(f"objective.{f.name}={getattr(cfg, f.name)!r} applies to masked-LM "
                                      "distillation; this teacher is a causal LM (head='lm')")
        self.base = base(cfg, model_cfg, tokenizer)
        self.corrupts = self.base.corrupts  # CLM: no corruption, so no per-epoch randomness
        self.term = "mlm" if base is MaskedLM else "lm"  # the hard loss keeps its name: eval reports mlm/lm loss, ppl
        self.term_weights = {self.term: cfg.alpha_hard, "kd": cfg.alpha_kl, "cos": cfg.alpha_cos}
        self.teacher = teacher.requires_grad_(False).eval()
        self.register_state_dict_post_hook(_drop_teacher)
        if cfg.init_from_teacher == "every_other":
            if model is None:
                raise ValueError("init_from_teacher needs the student model (build_objective passes it)")
            init_every_other(model, teacher)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # frozen: no dropout in its targets while the student trains
        return self

    # -- data: the base objective's ---------------------------------------------------------------
    def n_special_tokens(self):
        return self.base.n_special_tokens()

    def doc_separator(self):
        return self.base.doc_separator()

    def example(self, block, rng, random_block):
        return self.base.example(block, rng, random_block)

    def collate(self, examples):
        return self.base.collate(examples)

    def records(self):
        return self.base.records()

    # -- loss ----------------------------------------------------------------------------------------
    def counts(self, batch):
        n = self.base.counts(batch)[self.term]
        out = {self.term: n, "kd": n}
        if self.cfg.alpha_cos:
            out["cos"] = int(batch["attention_mask"].sum())
        return out

    def predict(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden states (B, T, dim), logits (N, vocab) at the N predicted positions, their true tokens (N,))."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.term == "mlm":
            h = model.transformer.encode(ids, mask, batch.get("token_type_ids"))  # (B, T, dim)
            selected = batch["labels"] != IGNORE  # (B, T)
            return h, model.head(h[selected]), batch["labels"][selected]
        h = model.transformer.decode(ids, mask)  # (B, T, dim)
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)  # state t predicts token t + 1
        keep = targets != IGNORE  # (B, T - 1)
        return h, model.head(h[:, :-1][keep]), targets[keep]

    def loss(self, model, batch, totals):
        c = self.cfg
        h_s, z_s, targets = self.predict(model, batch)
        with torch.no_grad():
            h_t, z_t, _ = self.predict(self.teacher, batch)
        hard, correct = summed_ce(z_s, targets)
        kd = distill_kl(z_s, z_t, c.temperature)
        loss = c.alpha_hard * hard / totals[self.term] + c.alpha_kl * kd / totals["kd"]
        stats = {f"{self.term}_loss": float(hard.detach()), f"{self.term}_correct": float(correct),
                 "kd_loss": float(kd.detach())}
        if c.alpha_cos:
            real = batch["attention_mask"].bool()  # (B, T)
            cos = (1.0 - F.cosine_similarity(h_s[real].float(), h_t[real].float(), dim=-1)).sum()
            loss = loss + c.alpha_cos * cos / totals["cos"]
            stats["cos_loss"] = float(cos.detach())
        return loss, stats
