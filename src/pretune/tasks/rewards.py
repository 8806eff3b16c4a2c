"""Reward functions for RL from verifiable rewards (``--task grpo``): built-ins, user functions, and scoring a batch
of completions as TRL's ``GRPOTrainer`` does.

A reward is named by ``--reward NAME`` (weights ``task.reward_weights``, in the order given):

    exact_match      1.0 when the completion's answer equals the record's answer field, else 0.0: the answer is
                     extracted as ``pretune prompt`` extracts it (``extract_answer``: the number after the last "the
                     answer is", else the last number; with ``task.answer_regex`` its last match, group 1 if it has
                     one, e.g. ``####\\s*(-?[\\d,.]+)``), and both sides are normalised (``normalize_answer``:
                     ``"1,000."`` equals ``1000``). A completion with no answer scores 0.0.
    format           1.0 when the whole completion, surrounding whitespace stripped, matches ``task.format_regex``
                     (``re.fullmatch`` with DOTALL | MULTILINE: ``.`` crosses lines, ``^``/``$`` match at line
                     breaks, TRL's ``think_format_reward`` flags), else 0.0. The whole text, not a search: a pattern
                     found anywhere would also reward a right-looking answer followed by any amount of junk, the
                     easiest thing for the policy to learn; a pattern that means "contains" says so (``.*X.*``).
    length           0 up to ``task.length_limit`` completion tokens ``L`` (as TRL counts them: the sampled ids
                     up to and including EOS), then ``-min(1, (L - limit) / limit)``: linear in the excess, so each
                     extra token costs the same, and bounded at -1 (reached at twice the limit), the scale of a 0/1
                     reward, so a correct long answer still nets more than a wrong short one at weight 1. It is
                     DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's ``get_soft_overlong_punishment``)
                     with ``L_max = 2 * limit`` and ``L_cache = limit``.
    module:function  a user function (``my_rewards:correct``, ``pkg.mod:fn``), imported with importlib from the
                     current directory (put first on ``sys.path`` while importing, as ``python -m`` does) and
                     ``PYTHONPATH``; never ``eval``.

Every reward is called as TRL calls reward functions, so a function written for TRL works unchanged:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **{field: [value per row] ...}) -> list

with one row per completion (a prompt's G completions are G rows; prompts and records repeated, as TRL repeats
them). Completions are strings, or, when the prompt is a list of messages, lists of one assistant message
``[{"role": "assistant", "content": text}]`` (the prompts are then the message lists); completions given to
:func:`compute_rewards` as message lists already (a string prompt rendered as a chat turn) are passed as given. The
records' other fields (all but the prompt field, ``completion`` and ``TRAINER_ARGS``) are passed as lists,
``None`` where a record lacks the field (a ``datasets`` column's missing value). A function must take ``prompts``,
``completions`` (by keyword) and every such field, or ``**kwargs``; ``completion_ids`` and the trainer's extras
(``trainer_state``, ...) are passed to a function that names them or takes ``**kwargs`` (TRL passes them to all; a
function without ``**kwargs`` then fails there but works here). A reward may return None for a row: "not applicable"
(TRL).

Scoring (:func:`compute_rewards`) gives, as TRL's ``_calculate_rewards`` and ``_generate_and_score_completions``:

    per_func[i, f]   reward f of row i, float32; None -> NaN
    total[i]         sum over f of weight_f * per_func[i, f], NaNs left out (``nansum``); NaN when every reward of
                     the row is None (TRL 1.16's "unscorable" row, left out of the group's mean and given advantage 0)

Before training, :func:`build_rewards` refuses an unknown name, a module that does not import, a missing or
uncallable attribute and a signature TRL's call cannot bind (ConfigError naming the reward), and
:func:`check_records` refuses a record without a field a reward needs (DataError naming ``file:line``, the field
and the reward). During training, a reward that raises, returns the wrong number of values or a non-number (NaN and
inf included) raises :class:`RewardError` naming the function and the record.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ConfigError, StepError
from ..data.readers import DataError
from ..generation.prompt import extract_answer, normalize_answer
from .base import Record

__all__ = ["BUILTINS", "RewardError", "RewardFn", "build_rewards", "check_records", "compute_rewards"]

BUILTINS: tuple[str, ...] = ("exact_match", "format", "length")
TRAINER_ARGS: tuple[str, ...] = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                                 "log_metric", "environments")  # what TRL passes besides the records' fields
_FLAGS = re.DOTALL | re.MULTILINE  # the format reward's: TRL's think_format_reward and open-r1's format reward use them


class RewardError(StepError):
    """A reward function failed during training (raised, wrong number of values, a non-number); the message names
    the function and the record (``file:line``). The trainer catches it, checkpoints and stops."""


@dataclass
class RewardFn:
    """One reward: its name (as given to ``--reward``), the function (called TRL's way), and the record fields it
    needs (checked by :func:`check_records` before training)."""

    name: str  # "exact_match", "format", "length" or "module:function"
    fn: Callable  # fn(prompts=..., completions=..., completion_ids=..., **fields) -> list[float | None]
    fields: tuple[str, ...] = ()  # record fields it needs, present and non-null in every record
    check: Callable[[Record], None] | None = field(default=None, repr=False)  # a further per-record check (raises
    # DataError): exact_match's gold answer must be a non-empty string or number


# ------------------------------------------------------------------------------------------------ built-ins
def _text(completion: Any) -> str:
    """A completion's text: the string, or the content of its assistant message(s)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def _compile(pattern: str, key: str, what: str, flags: int = 0) -> re.Pattern:
    try:
        return re.compile(pattern, flags)
    except re.error as e:
        raise ConfigError(f"{key}={pattern!r} is not a valid regular expression ({e}); expected {what}") from None


def _exact_match(answer_field: str, answer_regex: str) -> RewardFn:
    pattern = _compile(answer_regex, "task.answer_regex", "a pattern whose last match (group 1 if it has one) is "
                       r"the answer, e.g. '####\s*(-?[\d,.]+)'") if answer_regex else None

    def exact_match(prompts, completions, **kwargs):
        golds = kwargs[answer_field]
        preds = [extract_answer(_text(c), pattern) for c in completions]
        return [float(p is not None and p == normalize_answer(g)) for p, g in zip(preds, golds)]

    def check(rec: Record) -> None:
        gold = rec.data[answer_field]
        if isinstance(gold, bool) or not isinstance(gold, (str, int, float)) or normalize_answer(gold) is None:
            raise DataError(f"{rec.where}: the reward 'exact_match' compares with the field {answer_field!r}, which "
                            f"is {gold!r:.60}; expected the answer as a non-empty string or a number")

    return RewardFn("exact_match", exact_match, (answer_field,), check)


def _format(format_regex: str) -> RewardFn:
    if not format_regex:
        raise ConfigError("the reward 'format' needs task.format_regex: a pattern the whole completion must match, "
                          r"e.g. '.*####\s*-?[\d,.]+'")
    pattern = _compile(format_regex, "task.format_regex", "a pattern the whole completion must match", _FLAGS)

    def format(prompts, completions, **kwargs):  # named as the reward: TRL logs a function by its __name__
        return [float(pattern.fullmatch(_text(c).strip()) is not None) for c in completions]

    return RewardFn("format", format)


def _length(limit: int) -> RewardFn:
    if limit <= 0:
        raise ConfigError(f"the reward 'length' needs task.length_limit > 0 (got {limit}): the completion length "
                          "in tokens past which the penalty starts")

    def length(prompts, completions, completion_ids, **kwargs):
        return [-min(1.0, (len(ids) - limit) / limit) if len(ids) > limit else 0.0 for ids in completion_ids]

    return RewardFn("length", length)


# ----------------------------------------------------------------------------------------------- user functions
def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: called without checks
        return None


def _takes(sig: inspect.Signature | None, name: str) -> bool:
    """Whether a function with ``sig`` accepts keyword ``name`` (by name or through ``**kwargs``)."""
    if sig is None:
        return True
    p = sig.parameters.get(name)
    if p is not None:
        return p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    return any(q.kind is q.VAR_KEYWORD for q in sig.parameters.values())


def _required_fields(sig: inspect.Signature | None) -> tuple[str, ...]:
    """The record fields a signature names without a default (the trainer's own arguments left out)."""
    if sig is None:
        return ()
    return tuple(p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                 and p.default is p.empty and p.name not in TRAINER_ARGS)


def _check_call(reward: RewardFn, data_fields: Sequence[str]) -> None:
    """ConfigError unless ``reward.fn`` binds TRL's call with ``data_fields`` passed as keyword lists."""
    sig = _signature(reward.fn)
    if sig is None:
        return
    trainer = {n: [] for n in TRAINER_ARGS[2:] if n in sig.parameters and _takes(sig, n)}
    try:
        sig.bind(prompts=[], completions=[], **trainer, **{f: [] for f in data_fields})
    except TypeError as e:
        given = ", ".join(["prompts", "completions", *trainer, *data_fields])
        raise ConfigError(f"reward {reward.name!r}: {reward.name.rpartition(':')[2]}{sig} cannot be called as reward "
                          f"functions are (TRL's way, by keyword: {given}): {e}. Write it as "
                          "def fn(prompts, completions, **kwargs) -> list[float], reading the fields it needs from "
                          "kwargs or naming them") from None


def _import_user(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    dotted = module_name.split(".") + attr.split(".")
    if not all(p.isidentifier() for p in dotted):
        raise ConfigError(f"reward {spec!r}: expected a built-in ({', '.join(BUILTINS)}) or module:function, e.g. "
                          "my_rewards:correct or pkg.mod:fn")
    cwd = os.getcwd()
    sys.path.insert(0, cwd)  # python -m's sys.path[0]; PYTHONPATH is on sys.path already
    importlib.invalidate_caches()  # a module written since the last import is found
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"reward {spec!r}: no module {module_name!r} in the current directory ({cwd}) or on "
                              "PYTHONPATH") from None
        raise ConfigError(f"reward {spec!r}: the module {module_name!r} does not import: {e}") from None
    except Exception as e:  # any error of the user's module at import: SyntaxError, NameError, ...
        raise ConfigError(f"reward {spec!r}: the module {module_name!r} does not import: "
                          f"{type(e).__name__}: {e}") from None
    finally:
        if cwd in sys.path:
            sys.path.remove(cwd)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
            raise ConfigError(f"reward {spec!r}: the module {module_name!r} ({getattr(module, '__file__', '?')}) has "
                              f"no attribute {attr!r}; its functions: {', '.join(names) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    sig = _signature(obj)
    reward = RewardFn(spec, obj, _required_fields(sig))
    _check_call(reward, reward.fields)
    return reward


# ------------------------------------------------------------------------------------------------------ the API
def build_rewards(names: Sequence[str], *, answer_field: str = "answer", answer_regex: str = "",
                  format_regex: str = "", max_completion_tokens: int = 0) -> list[RewardFn]:
    """The rewards named by ``--reward``, in order, checked (see the module docstring for each built-in).

    Args:
        names: built-in names (``exact_match``, ``format``, ``length``) or ``module:function`` of user code.
        answer_field: the record field with the gold answer (``exact_match``).
        answer_regex: ``exact_match``'s extraction pattern (its last match, group 1 if any); empty: ``pretune
            prompt``'s default (the number after "the answer is", else the last number).
        format_regex: the pattern the whole completion must match (``format``).
        max_completion_tokens: completion tokens past which ``length`` penalises.

    Raises ConfigError naming the reward: no names, a name given twice, an unknown built-in, a module that does not
    import, a missing or uncallable attribute, a signature TRL's call cannot bind, a missing or invalid pattern.
    """
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ConfigError("grpo needs at least one reward: --reward exact_match, format, length or module:function")
    out = []
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"reward {name!r} is given {names.count(name)} times; give each reward once "
                              "(weigh it with task.reward_weights)")
        if ":" in name:
            out.append(_import_user(name))
        elif name == "exact_match":
            out.append(_exact_match(answer_field, answer_regex))
        elif name == "format":
            out.append(_format(format_regex))
        elif name == "length":
            out.append(_length(max_completion_tokens))
        else:
            import difflib

            close = difflib.get_close_matches(name, BUILTINS, n=1, cutoff=0.5)
            raise ConfigError(f"unknown reward {name!r}{f' (did you mean {close[0]!r}?)' if close else ''}: expected "
                              f"a built-in ({', '.join(BUILTINS)}) or a function of your code as module:function, "
                              "e.g. my_rewards:correct")
    return out


def _data_fields(records: Sequence[Record], prompt_field: str) -> list[str]:
    """The fields passed to reward functions: every record field but the prompt, ``completion`` and TRL's own
    argument names, in first-seen order."""
    skip = {prompt_field, "completion", *TRAINER_ARGS}
    return list(dict.fromkeys(k for r in records for k in r.data if k not in skip))


def check_records(rewards: Sequence[RewardFn], records: Sequence[Record], *, prompt_field: str = "prompt") -> None:
    """Before training: every field a reward needs is present and non-null in every record (DataError naming
    ``file:line``, the field and the reward), and every reward can be called with the records' fields (ConfigError
    naming the reward: a function without ``**kwargs`` must name each field the data has, as TRL passes them all).

    Args:
        rewards: from :func:`build_rewards`.
        records: the training (and evaluation) records.
        prompt_field: the prompt's field, passed as ``prompts`` rather than as a field.
    """
    for reward in rewards:
        for rec in records:
            for f in reward.fields:
                if rec.data.get(f) is None:
                    have = ", ".join(sorted(map(str, rec.data))) or "none"
                    state = "is null" if f in rec.data else f"is missing (the record has: {have})"
                    raise DataError(f"{rec.where}: the reward {reward.name!r} needs the field {f!r}, which {state}")
            if reward.check is not None:
                reward.check(rec)
        _check_call(reward, _data_fields(records, prompt_field))


def _where(records: Sequence[Record]) -> str:
    wheres = list(dict.fromkeys(r.where for r in records))
    more = f" and {len(wheres) - 5} more" if len(wheres) > 5 else ""
    return ("the record " if len(wheres) == 1 else "the records ") + ", ".join(wheres[:5]) + more


def _raised(reward: RewardFn, e: Exception) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" at {frame.filename}:{frame.lineno}" if frame else ""
    return f"the reward {reward.name!r} raised {type(e).__name__}: {e}{at}"


def _culprit(reward: RewardFn, e: Exception, call: tuple, records: Sequence[Record]) -> str:
    """Where a reward raised: the first record whose completions alone raise the same error, else the batch's."""
    prompts, shown, ids, data, extra = call
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r.where, []).append(i)
    if len(groups) > 1:
        for where, rows in groups.items():
            try:
                _call(reward, [prompts[i] for i in rows], [shown[i] for i in rows], [ids[i] for i in rows],
                      {k: [v[i] for i in rows] for k, v in data.items()}, extra)
            except Exception as again:
                if type(again) is type(e) and str(again) == str(e):
                    return f"the record {where}"
    return _where(records)


def _call(reward: RewardFn, prompts: list, completions: list, completion_ids: list, data: dict[str, list],
          extra: Mapping[str, Any]) -> list:
    sig = _signature(reward.fn)
    offered = {"completion_ids": completion_ids, **data, **extra}
    kwargs = {k: v for k, v in offered.items() if k in data or _takes(sig, k)}
    out = reward.fn(prompts=prompts, completions=completions, **kwargs)
    if inspect.iscoroutine(out):  # an async reward (TRL gathers them; here one after another)
        out = asyncio.run(out)
    return out


def _values(reward: RewardFn, out: Any, records: Sequence[Record]) -> list[float]:
    """A reward function's output as floats (None -> NaN), or RewardError naming the row's record."""
    if isinstance(out, torch.Tensor) or type(out).__module__ == "numpy":  # an array of rewards
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"the reward {reward.name!r} returned a {type(out).__name__} for {_where(records)}; "
                          f"expected a list of {len(records)} numbers, one per completion")
    if len(out) != len(records):
        raise RewardError(f"the reward {reward.name!r} returned {len(out)} values for {len(records)} completions "
                          f"({_where(records)}); expected one per completion")
    values = []
    for v, rec in zip(out, records):
        ok = v is None or (isinstance(v, numbers.Real) and math.isfinite(v))
        if not ok:
            raise RewardError(f"the reward {reward.name!r} returned {v!r:.60} ({type(v).__name__}) for a completion "
                              f"of {rec.where}; expected a finite number, or None for 'not applicable'")
        values.append(math.nan if v is None else float(v))
    return values


def compute_rewards(rewards: Sequence[RewardFn], weights: Sequence[float] | None, prompts: Sequence[Any],
                    completions: Sequence[str], records: Sequence[Record], completion_ids: Sequence[Sequence[int]],
                    *, prompt_field: str = "prompt", extra: Mapping[str, Any] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Score N completions with each reward, as TRL's GRPOTrainer does.

    Args:
        rewards: from :func:`build_rewards`, F of them.
        weights: F weights (``task.reward_weights``); None: all 1.
        prompts: N prompts, one per completion (a prompt repeated for its G completions): strings, or message lists
            (then each completion is passed as ``[{"role": "assistant", "content": text}]``).
        completions: N completion texts (decoded without special tokens), wrapped as one assistant message each
            when the prompts are message lists; or N message lists, passed as given.
        records: N records, the one of each completion's prompt (repeated as the prompts are).
        completion_ids: N lists of sampled token ids, up to and including EOS, no padding (TRL's
            ``completion_ids_list``; ``length`` counts them).
        prompt_field: the prompts' record field, not passed again as a field.
        extra: further keyword arguments for functions that take them (TRL's ``trainer_state``, ...).

    Returns ``(per_func, total)``: ``per_func`` (N, F) float32, NaN where a function returned None; ``total`` (N,)
    the nansum over functions of ``weight * reward``, NaN for a row whose every reward is None (TRL 1.16).
    Raises RewardError naming the function and the record when a function raises or returns a bad value.
    """
    n = len(completions)
    if not (len(prompts) == len(records) == len(completion_ids) == n):
        raise ValueError(f"compute_rewards: {len(prompts)} prompts, {n} completions, {len(records)} records and "
                         f"{len(completion_ids)} completion_ids; expected one of each per completion")
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    if len(weights) != len(rewards):
        raise ConfigError(f"task.reward_weights has {len(weights)} weights for {len(rewards)} rewards "
                          f"({', '.join(r.name for r in rewards)}); give one per reward, in the order of --reward")
    prompts, records, ids = list(prompts), list(records), [list(i) for i in completion_ids]
    chat = n > 0 and isinstance(prompts[0], list)  # TRL's is_conversational: the prompt is a list of messages
    shown = [[{"role": "assistant", "content": c}] if chat and isinstance(c, str) else c for c in completions]
    data = {k: [r.data.get(k) for r in records] for k in _data_fields(records, prompt_field)}
    per_func = torch.empty(n, len(rewards), dtype=torch.float32)  # (N, F)
    for f, reward in enumerate(rewards):
        try:
            out = _call(reward, prompts, shown, ids, data, extra or {})
        except Exception as e:  # the user's code: whatever it raises stops the run, named
            at = _culprit(reward, e, (prompts, shown, ids, data, extra or {}), records)
            raise RewardError(f"{_raised(reward, e)}, scoring {at}") from e
        per_func[:, f] = torch.tensor(_values(reward, out, records), dtype=torch.float32)
    w = torch.tensor(weights, dtype=torch.float32)  # (F,)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)  # (N,) TRL: rewards_per_func * reward_weights, nansum
    total[torch.isnan(per_func).all(dim=1)] = torch.nan  # TRL 1.16: every reward None -> the row is unscorable
    return per_func, total
