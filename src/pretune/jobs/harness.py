"""lm-evaluation-harness on pretune models: the ``pretune`` model class and ``pretune eval``'s job (docs/eval.md).

    import lm_eval
    import pretune.jobs.harness  # registers the model class "pretune" with lm-eval
    lm_eval.simple_evaluate(model="pretune", model_args="pretrained=runs/sft,batch_size=16", tasks=["hellaswag"])

lm-eval 0.4 finds model classes only in its own registry (no entry points), so the class is registered when this
module is imported; ``pretune eval`` imports it and calls :func:`evaluate`.

How the requests are answered:

- ``loglikelihood``: lm-eval's own tokenization (``TemplateLM._encode_pair``: the context's trailing spaces moved to
  the continuation, the continuation's ids cut from the whole text's), so the ids scored are ``hf``'s for the same
  tokenizer. The requests are grouped by context: a multiple-choice question's context runs once and its choices
  are read from it (``generation.scoring.score_continuations``, strategy ``cache``: only continuations of two or more
  tokens run a second, short pass on the repeated cache) — where ``hf`` runs the context once per choice.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens (the first after the prefix
  token: BOS, else EOS), each scored as a loglikelihood request.
- ``generate_until``: ``pretune.generate`` on left-padded batches of contexts with the same generation settings,
  stopped at the ``until`` strings (and EOS), which are cut from the text as ``hf`` cuts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..config import ConfigError
from ..generation.decode import generate
from ..generation.scoring import score_continuations
from ..io.progress import progress as progress_bar
from ..loading import load_pretrained

__all__ = ["PretuneLM", "evaluate"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@register_model("pretune")
class PretuneLM(TemplateLM):
    """A pretune model (any folder ``pretune.load_pretrained`` reads: run, checkpoint, Hugging Face, adapter, GGUF)
    answering lm-eval's requests through pretune's batched scoring and generation.

    Args (also as ``model_args``, ``key=value,...``):
        pretrained: the model folder (or GGUF file); a loaded ``Pretrained`` is accepted too.
        base: an adapter folder's base (default: the one it recorded).
        batch_size: prompts (distinct contexts) per forward pass; lm-eval's ``auto`` means 16.
        max_length: the context window (default: the model's ``max_seq_len``); longer inputs keep their end.
        max_gen_toks: new tokens at most for ``generate_until`` when the task does not say (lm-eval's default 256).
        dtype: ``float32`` (default) or ``bfloat16``.
        add_bos_token: None (default): the tokenizer's own special tokens, as ``hf``; True/False: force BOS or none.
        prefix_token_id: what an empty context (and a rolling window's start) is scored after (default: the
            tokenizer's BOS, else its EOS, as ``hf``; pretune may find a BOS where transformers finds none, e.g. a
            GPT-2-style ``<|endoftext|>``, so pass it to compare the two).
        device: ``cpu`` (default) or a torch device.
    """

    def __init__(self, pretrained, *, base: str | None = None, batch_size: int | str = 16,
                 max_batch_size: int | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 dtype: str = "float32", add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 device: str | None = None, **unused):
        super().__init__()
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
        if isinstance(pretrained, (str, Path)):
            pretrained = load_pretrained(pretrained, base=base, device=device or "cpu", dtype=_DTYPES[dtype])
        self.model, self.tok = pretrained.model.eval(), pretrained.tokenizer
        self.name = str(pretrained.path)
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.max_length = int(max_length or self.model.config.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        self.custom_prefix = None if prefix_token_id is None else int(prefix_token_id)
        self.add_bos_token = None if add_bos_token is None else str(add_bos_token).lower() in ("true", "1")
        if self.tok.eos_id is None:
            raise ConfigError(f"{self.name}: the tokenizer has no EOS token, which lm-eval needs (end of text)")

    # ------------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: ``prefix_token_id``, else BOS, else EOS (as lm-eval's ``hf``)."""
        if self.custom_prefix is not None:
            return self.custom_prefix
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Ids of ``string``; ``add_special_tokens`` None: ``add_bos_token`` if set, else the tokenizer's default
        (special tokens added, unless the string already starts with the prefix token's text) — ``hf``'s rule."""
        if add_special_tokens is None:
            prefix = self.tok.decode([self.prefix_token_id])
            add_special_tokens = (self.add_bos_token if self.add_bos_token is not None
                                  else not (prefix and string.startswith(prefix)))
        return self.tok.tk.encode(string, add_special_tokens=add_special_tokens).ids

    # ------------------------------------------------------------------------------------------- likelihoods
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ((context, continuation) | None, context ids, continuation ids); each answered with
        (sum of the continuation's log-probs, whether greedy decoding would produce it)."""
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ConfigError(f"lm-eval request {i} has an empty continuation")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]  # the window keeps the end, as hf
            query, cont = whole[:len(whole) - len(cont)], whole[len(whole) - len(cont):]
            if not query:  # the continuation fills the window: its first token is context
                query, cont = cont[:1], cont[1:]
            groups.setdefault(tuple(query), []).append((i, cont))
        queries = list(groups)
        conts = [[c for _, c in groups[q]] for q in queries]
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        with progress_bar(total=len(queries), desc="pretune loglikelihood", disable=disable_tqdm) as bar:
            scores, top = score_continuations(self.model, [], [list(q) for q in queries],
                                              [[c or [self.eot_token_id] for c in row] for row in conts],
                                              batch_size=self.batch_size, progress=bar.update, greedy=True)
        for g, q in enumerate(queries):
            for j, (i, c) in enumerate(groups[q]):
                results[i] = (float(scores[g, j]), bool(top[g, j])) if c else (0.0, True)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text: disjoint windows of ``max_length`` tokens (lm-eval's), summed."""
        windows, owner = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[r] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -------------------------------------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to its ``until`` strings (cut off), EOS or ``max_gen_toks`` tokens."""
        out: list[str | None] = [None] * len(requests)
        eos = self.tok.decode([self.eot_token_id])
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items(), key=str)), []).append(i)
        with progress_bar(total=len(requests), desc="pretune generate_until", disable=disable_tqdm) as bar:
            for members in by_kwargs.values():
                kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_new = int(kwargs.pop("max_gen_toks"))
                keep = self.max_length - max_new
                if keep < 1:
                    raise ConfigError(f"max_gen_toks={max_new} leaves no room for a context in max_length="
                                      f"{self.max_length}")
                members = sorted(members, key=lambda i: -len(requests[i].args[0]))  # similar lengths together
                for b0 in range(0, len(members), self.batch_size):
                    rows = members[b0:b0 + self.batch_size]
                    texts = self._generate(
                        [self.tok_encode(requests[i].args[0])[-keep:] for i in rows], until=until,
                        max_new_tokens=max_new, do_sample=bool(kwargs.get("do_sample", False)),
                        temperature=float(kwargs.get("temperature", 1.0) or 1.0))
                    for i, text in zip(rows, texts):
                        out[i] = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
                    bar.update(len(rows))
        return out

    def _generate(self, prompts: Sequence[list[int]], *, until: list[str], max_new_tokens: int, do_sample: bool,
                  temperature: float) -> list[str]:
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        mask = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):  # (B, T) left-padded
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        dev = next(self.model.parameters()).device
        seqs = generate(self.model, ids.to(dev), mask.to(dev), max_new_tokens=max_new_tokens, do_sample=do_sample,
                        temperature=temperature, stop=until or None, tokenizer=self.tok,
                        eos_token_id=self.eot_token_id, pad_token_id=self.eot_token_id)
        return [self.tok.decode(row[T:].tolist(), skip_special_tokens=True) for row in seqs.cpu()]


def evaluate(model: str, *, tasks: Sequence[str], include_path: str | None = None, num_fewshot: int | None = None,
             limit: float | None = None, batch_size: int = 16, base: str | None = None, dtype: str = "float32",
             device: str = "cpu", seed: int = 0, log_samples: bool = False, **model_args) -> dict:
    """Run lm-eval's ``simple_evaluate`` with the ``pretune`` model class on ``model``; returns lm-eval's results.

    Args:
        model: any model folder pretune loads (or a GGUF file).
        tasks: lm-eval task or group names (those of lm-eval, or defined by YAML files under ``include_path``).
        include_path: a folder of task YAMLs added to lm-eval's.
        num_fewshot, limit: lm-eval's (shots per prompt; examples per task, a fraction when < 1).
        batch_size, base, dtype, device, model_args: :class:`PretuneLM`'s.
        seed: lm-eval's random, numpy, torch and few-shot seeds.
        log_samples: keep each example's requests and answers in ``results["samples"]``.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: not a folder")
    manager = None
    if include_path is not None:  # lm-eval's own index takes ~8 s to build: skipped when the folder has every task
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under {include_path}" if include_path else ""
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: not among lm-eval's tasks{where}")
    lm = PretuneLM(model, base=base, batch_size=batch_size, dtype=dtype, device=device, **model_args)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
