"""GRPO's reward functions (tasks/rewards.py): the built-ins (exact_match with ``pretune prompt``'s extraction and a
``####`` pattern, format, length), user functions imported from the current directory or PYTHONPATH and called as
TRL calls them (a TRL-style function and TRL's own ``think_format_reward`` work unchanged), per-function rewards and
the weighted total equal to TRL 1.16's (its ``_calculate_rewards`` run on the same functions, its nansum), and every
bad input named: the reward, the record's file:line, the field. No model: each test runs in well under a second, but
the one that imports TRL's GRPOTrainer (several seconds)."""

from __future__ import annotations

import math
import sys
import textwrap
import types

import pytest
import torch

from pretune.config import ConfigError
from pretune.data.readers import DataError
from pretune.tasks.base import Record
from pretune.tasks.rewards import RewardError, RewardFn, build_rewards, check_records, compute_rewards

HASH = r"####\s*(-?[\d,.]+)"  # the example: the number after ####


@pytest.fixture(autouse=True)
def _own_imports(monkeypatch):
    """sys.path and sys.modules as they were after each test: user modules written by one test are not seen by
    another, and build_rewards leaves sys.path as it found it (checked in test_user_module_from_the_current_dir)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("rw_"):
            del sys.modules[name]


def _recs(*answers, file="train.jsonl", **fields) -> list[Record]:
    """One record per answer, lines 1.., with a prompt, the answer and ``fields`` (value lists)."""
    return [Record(f"{file}:{i + 1}", {"prompt": f"q{i}", "answer": a, **{k: v[i] for k, v in fields.items()}})
            for i, a in enumerate(answers)]


def _score(rewards, completions, records, weights=None, ids=None, prompts=None):
    prompts = [r.data["prompt"] for r in records] if prompts is None else prompts
    ids = [[0] * len(c.split()) for c in completions] if ids is None else ids
    return compute_rewards(rewards, weights, prompts, completions, records, ids)


def _module(tmp_path, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))


# ------------------------------------------------------------------------------------------------------ built-ins
def test_exact_match_uses_pretune_prompts_extraction():
    [em] = build_rewards(["exact_match"])
    assert em.fields == ("answer",)
    recs = _recs("42", "42", "42", 7)
    per, total = _score([em], ["so the answer is 42.", "6 * 7 = 42", "it is 41", "seven"], recs)
    assert per[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # "seven": no number extracted -> 0, never None == None
    assert torch.equal(total, per[:, 0])


def test_exact_match_with_the_hash_pattern_and_separated_numbers():
    [em] = build_rewards(["exact_match"], answer_regex=HASH)
    recs = _recs("1234", 1234, "1,234", "-5.0", "1234", "12")
    completions = ["1,000 + 234 = 1,234\n#### 1,234.",  # comma-separated, a final period: 1234
                   "#### 1234", "#### 1234", "#### -5",
                   "the answer is 1234",  # no ####: the pattern finds nothing, 0 (the default would have said 1)
                   "#### 3\nor rather\n#### 12"]  # the last match counts
    per, _ = _score([em], completions, recs)
    assert per[:, 0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]


def test_exact_match_and_user_functions_on_conversational_prompts(tmp_path, monkeypatch):
    """A prompt of messages: each completion is passed as one assistant message, the prompts as the message lists."""
    _module(tmp_path, "rw_chat", """
        def seen(prompts, completions, **kwargs):
            assert prompts[0] == [{"role": "user", "content": "2+2?"}]
            assert completions[0] == [{"role": "assistant", "content": "#### 4"}]
            return [0.5] * len(completions)
    """)
    monkeypatch.chdir(tmp_path)
    rewards = build_rewards(["exact_match", "rw_chat:seen"], answer_regex=HASH)
    chat = [{"role": "user", "content": "2+2?"}]
    recs = [Record("chat.jsonl:1", {"prompt": chat, "answer": "4"})] * 2
    per, total = _score(rewards, ["#### 4", "#### 5"], recs, prompts=[chat, chat])
    assert per.tolist() == [[1.0, 0.5], [0.0, 0.5]] and total.tolist() == [1.5, 0.5]
    wrapped = [[{"role": "assistant", "content": c}] for c in ["#### 4", "#### 5"]]  # given as messages: kept
    assert torch.equal(compute_rewards(rewards, None, [chat, chat], wrapped, recs, [[1], [2]])[0], per)


def test_format_matches_the_whole_stripped_completion():
    [fmt] = build_rewards(["format"], format_regex=r".*####\s*-?\d+")
    per, _ = _score([fmt], ["step one\nstep two\n#### 12\n", "  #### 3", "#### 12 and then more text", "12"],
                    _recs(*"abcd"))
    assert per[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # trailing junk after the answer is not the format
    # ^/$ at line breaks (MULTILINE, TRL's think_format_reward flags): the last line is the answer
    [fmt] = build_rewards(["format"], format_regex=r"<think>.*</think>\n^Answer: \d+$")
    per, _ = _score([fmt], ["<think>a\nb</think>\nAnswer: 3", "<think>a</think> Answer: 3"], _recs("x", "y"))
    assert per[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("regex,why", [("", "needs task.format_regex"), ("(unclosed", "not a valid regular")])
def test_format_refuses_a_missing_or_invalid_pattern(regex, why):
    with pytest.raises(ConfigError) as e:
        build_rewards(["format"], format_regex=regex)
    assert "task.format_regex" in str(e.value) and why in str(e.value)


def test_an_invalid_answer_pattern_names_its_key():
    with pytest.raises(ConfigError, match=r"task.answer_regex='\(' is not a valid regular expression"):
        build_rewards(["exact_match"], answer_regex="(")


def test_length_penalty_past_the_limit():
    """0 up to 10 tokens, then -(L - 10) / 10 down to -1 at 20: TRL's soft overlong punishment with L_max = 20 and
    L_cache = 10 (DAPO eq. 13)."""
    [length] = build_rewards(["length"], max_completion_tokens=10)
    lengths = [0, 5, 10, 11, 15, 20, 30]
    ids = [[7] * n for n in lengths]
    per, _ = _score([length], ["x"] * len(lengths), _recs(*range(len(lengths))), ids=ids)
    expected = [0.0, 0.0, 0.0, -0.1, -0.5, -1.0, -1.0]
    assert per[:, 0].tolist() == pytest.approx(expected)
    trl_rewards = pytest.importorskip("trl.rewards")
    assert per[:, 0].tolist() == pytest.approx(trl_rewards.get_soft_overlong_punishment(20, 10)(ids))
    with pytest.raises(ConfigError, match=r"'length' needs task.length_limit > 0 \(got 0\)"):
        build_rewards(["length"])


# ---------------------------------------------------------------------------------------- weights, None and TRL
def _none_rewards():
    """Two rewards with None ("not applicable") in places: row 2 has no reward at all."""
    a = RewardFn("a", lambda prompts, completions, **kw: [1.0, None, None, 0.25])
    b = RewardFn("b", lambda prompts, completions, **kw: [2, 3, None, True])
    return [a, b]


def test_weights_and_none_give_trls_nansum():
    """TRL 1.16: per_func NaN where None; total = nansum(per_func * weights) per row, NaN where every reward is
    None. By hand with weights (1.0, 0.5): 1 + 0.5*2 = 2, 0.5*3 = 1.5, NaN, 0.25 + 0.5*1 = 0.75."""
    per, total = _score(_none_rewards(), ["w"] * 4, _recs(*"abcd"), weights=[1.0, 0.5])
    assert per.dtype == torch.float32 and per.shape == (4, 2)
    torch.testing.assert_close(per, torch.tensor([[1.0, 2.0], [math.nan, 3.0], [math.nan, math.nan], [0.25, 1.0]]),
                               equal_nan=True)
    torch.testing.assert_close(total, torch.tensor([2.0, 1.5, math.nan, 0.75]), equal_nan=True)
    _, unweighted = _score(_none_rewards(), ["w"] * 4, _recs(*"abcd"))  # weights None: all 1
    torch.testing.assert_close(unweighted, torch.tensor([3.0, 3.0, math.nan, 1.25]), equal_nan=True)
    with pytest.raises(ConfigError, match=r"task.reward_weights has 1 weights for 2 rewards \(a, b\)"):
        _score(_none_rewards(), ["w"] * 4, _recs(*"abcd"), weights=[1.0])


def test_per_function_rewards_equal_trls_calculate_rewards(tmp_path, monkeypatch):
    """TRL's own GRPOTrainer._calculate_rewards (on a stand-in for the trainer: it reads only the attributes set
    here) calls the same functions on the same rows and gives the same (N, F) matrix; the total is TRL's lines of
    _generate_and_score_completions."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    _module(tmp_path, "rw_trl", """
        def by_field(prompts, completions, completion_ids, answer, level, **kwargs):
            return [None if lv == "skip" else float(c.endswith(a)) + len(i) / 10
                    for c, i, a, lv in zip(completions, completion_ids, answer, level)]
    """)
    monkeypatch.chdir(tmp_path)
    rewards = build_rewards(["rw_trl:by_field", "exact_match", "length"], max_completion_tokens=2)
    recs = _recs("4", "9", level=["easy", "skip"])
    rows = [recs[0]] * 2 + [recs[1]] * 2  # G = 2 completions per prompt, records repeated as TRL repeats them
    completions, ids = ["is 4", "is 5", "is 9", "9 9 9 9 9"], [[1, 2], [3], [4, 5, 6], [1] * 5]
    prompts = [r.data["prompt"] for r in rows]
    weights = [1.0, 2.0, 0.5]
    check_records(rewards, recs)
    per, total = compute_rewards(rewards, weights, prompts, completions, rows, ids)

    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        args=types.SimpleNamespace(report_to=[]), state=types.SimpleNamespace(global_step=0),
        reward_funcs=[r.fn for r in rewards], reward_processing_classes=[None] * 3,
        reward_func_names=[r.name for r in rewards], _log_completion_extra=None, _log_metric=None, environments=None)
    trl_per = grpo.GRPOTrainer._calculate_rewards(trainer, [dict(r.data) for r in rows], prompts, completions, ids)
    torch.testing.assert_close(per, trl_per, equal_nan=True, rtol=0, atol=0)
    trl_total = (trl_per * torch.tensor(weights, dtype=torch.float32).unsqueeze(0)).nansum(dim=1)  # TRL 1.16
    trl_total[torch.isnan(trl_per).all(dim=1)] = torch.nan
    torch.testing.assert_close(total, trl_total, equal_nan=True, rtol=0, atol=0)
    # by hand: row 0: 1 + 0.2 (by_field) + 2*1 (exact) + 0 (2 tokens) = 3.2; row 3: None + 2*1 + 0.5*-1 = 1.5
    assert total[0].item() == pytest.approx(3.2) and total[3].item() == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------------- user functions
def test_user_module_from_the_current_dir(tmp_path, monkeypatch):
    _module(tmp_path, "rw_local", """
        import rw_helper  # a sibling module: the current directory is on sys.path while importing

        def correct(prompts, completions, answer, bonus=0.0, **kwargs):
            return [rw_helper.score(c, a) for c, a in zip(completions, answer)]
    """)
    _module(tmp_path, "rw_helper", "def score(c, a):\n    return 1.0 if c.strip() == str(a) else 0.0\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    [r] = build_rewards(["rw_local:correct"])
    assert sys.path == path_before  # the current directory was only added for the import
    assert r.name == "rw_local:correct" and r.fields == ("answer",)  # bonus has a default: not required
    per, _ = _score([r], ["3", "4"], _recs("3", "3"))
    assert per[:, 0].tolist() == [1.0, 0.0]


def test_user_function_from_a_package_on_pythonpath(tmp_path, monkeypatch):
    pkg = tmp_path / "lib" / "rw_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def short(prompts, completions, **kw):\n"
                                    "    return [float(len(c) < 5) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))  # what PYTHONPATH=lib gives a fresh interpreter
    monkeypatch.chdir(tmp_path)  # not the package's folder
    [r] = build_rewards(["rw_pkg.scoring:short"])
    per, _ = _score([r], ["ok", "far too long"], _recs("a", "b"))
    assert per[:, 0].tolist() == [1.0, 0.0]


def test_trl_style_functions_work_unchanged(tmp_path, monkeypatch):
    """``def f(completions, **kwargs)`` reading fields, completion_ids and the trainer's extras from kwargs, and
    TRL's own think_format_reward (conversational completions)."""
    _module(tmp_path, "rw_trlstyle", """
        def accuracy(completions, **kwargs):
            assert kwargs["trainer_state"] == "state" and set(kwargs) >= {"prompts", "completion_ids", "solution"}
            return [1.0 if c[0]["content"].endswith(s) else 0.0 for c, s in zip(completions, kwargs["solution"])]
    """)
    monkeypatch.chdir(tmp_path)
    trl_rewards = pytest.importorskip("trl.rewards")
    rewards = [*build_rewards(["rw_trlstyle:accuracy"]),
               RewardFn("think_format_reward", trl_rewards.think_format_reward)]
    chat = [{"role": "user", "content": "hi"}]
    recs = [Record(f"c.jsonl:{i}", {"prompt": chat, "solution": "7"}) for i in (1, 2)]
    per, _ = compute_rewards(rewards, None, [chat] * 2, ["<think>x</think> 7", "8"], recs, [[1], [2]],
                             extra={"trainer_state": "state"})
    assert per.tolist() == [[1.0, 1.0], [0.0, 0.0]]


# ------------------------------------------------------------------------------------------------- bad input
def test_unknown_reward_names_the_builtins_and_the_module_form():
    with pytest.raises(ConfigError, match=r"unknown reward 'exact_mach' \(did you mean 'exact_match'\?\): expected "
                                          r"a built-in \(exact_match, format, length\) or .* module:function"):
        build_rewards(["exact_mach"])
    with pytest.raises(ConfigError, match=r"reward 'my mod:f': expected a built-in .* or module:function"):
        build_rewards(["my mod:f"])
    with pytest.raises(ConfigError, match=r"reward 'format' is given 2 times"):
        build_rewards(["format", "format"], format_regex="x")


@pytest.mark.parametrize("source,why", [
    (None, r"no module 'rw_bad' in the current directory \(.*\) or on PYTHONPATH"),
    ("def f(prompts, completions:\n    pass\n", r"does not import: SyntaxError: .*rw_bad.py, line 1"),
    ("import rw_not_installed\n", r"does not import: No module named 'rw_not_installed'"),
    ("raise RuntimeError('needs an API key')\n", r"does not import: RuntimeError: needs an API key"),
    ("def g(prompts, completions, **kw):\n    return []\n", r"rw_bad.py\) has no attribute 'f'; its functions: g"),
    ("f = 3\n", r"'f' is a int, not a function"),
    ("def f(x):\n    return []\n",
     r"f\(x\) cannot be called as reward functions are .*unexpected keyword argument 'prompts'.*\*\*kwargs"),
    ("def f(prompts, completions, /):\n    return []\n", r"cannot be called as reward functions are"),
])
def test_a_bad_user_function_is_named_before_training(tmp_path, monkeypatch, source, why):
    if source is not None:
        _module(tmp_path, "rw_bad", source)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^reward 'rw_bad:f': .*" + why) as e:
        build_rewards(["rw_bad:f"])
    assert "Traceback" not in str(e.value)


def test_missing_fields_are_named_with_the_record_and_the_reward(tmp_path, monkeypatch):
    _module(tmp_path, "rw_fields", """
        def by_level(prompts, completions, level):
            return [1.0] * len(completions)
    """)
    monkeypatch.chdir(tmp_path)
    [em] = build_rewards(["exact_match"], answer_field="solution")
    recs = _recs("1", "2", solution=["1", None])
    with pytest.raises(DataError, match=r"^train.jsonl:2: the reward 'exact_match' needs the field 'solution', "
                                        r"which is null"):
        check_records([em], recs)
    with pytest.raises(DataError, match=r"^train.jsonl:1: the reward 'exact_match' needs the field 'solution', "
                                        r"which is missing \(the record has: answer, prompt\)"):
        check_records([em], _recs("1"))
    with pytest.raises(DataError, match=r"^t.jsonl:1: the reward 'exact_match' compares with the field 'answer', "
                                        r"which is ' '; expected the answer as a non-empty string or a number"):
        check_records(build_rewards(["exact_match"]), _recs(" ", file="t.jsonl"))
    [lv] = build_rewards(["rw_fields:by_level"])  # names its field, no **kwargs: both checked
    assert lv.fields == ("level",)
    with pytest.raises(DataError, match=r"^train.jsonl:1: the reward 'rw_fields:by_level' needs the field 'level'"):
        check_records([lv], _recs("1"))
    with pytest.raises(ConfigError, match=r"^reward 'rw_fields:by_level': .* prompts, completions, answer, level\): "
                                          r"got an unexpected keyword argument 'answer'"):
        check_records([lv], _recs("1", level=["easy"]))  # TRL passes every field: 'answer' too
    check_records([lv], [Record("x.jsonl:1", {"prompt": "p", "level": "easy"})])


def _boom(prompts, completions, answer, **kw):
    return [1.0 / (a != "0") for a in answer]  # ZeroDivisionError on the record whose answer is "0"


@pytest.mark.parametrize("fn,why", [
    (_boom, r"raised ZeroDivisionError: float division by zero at .*test_rewards.py:\d+, scoring the record "
            r"train.jsonl:2$"),
    (lambda prompts, completions, **kw: [1.0], r"returned 1 values for 4 completions \(the records train.jsonl:1, "
                                               r"train.jsonl:2\); expected one per completion"),
    (lambda prompts, completions, **kw: ["1.0"] * 4, r"returned '1.0' \(str\) for a completion of train.jsonl:1; "
                                                     r"expected a finite number, or None"),
    (lambda prompts, completions, **kw: [0.0, 0.0, math.nan, 0.0], r"returned nan \(float\) for a completion of "
                                                                   r"train.jsonl:2"),
    (lambda prompts, completions, **kw: [0.0, math.inf, 0.0, 0.0], r"returned inf .* of train.jsonl:1"),
    (lambda prompts, completions, **kw: 1.0, r"returned a float for the records .*; expected a list of 4 numbers"),
])
def test_a_failing_reward_raises_reward_error_naming_it_and_the_record(fn, why):
    recs = _recs("1", "0")
    rows = [recs[0], recs[0], recs[1], recs[1]]
    with pytest.raises(RewardError, match=r"^the reward 'mine' " + why):
        _score([RewardFn("mine", fn)], ["a", "b", "c", "d"], rows)


def test_rewards_may_return_arrays():
    per, _ = _score([RewardFn("t", lambda prompts, completions, **kw: torch.tensor([0.5, 1.0]))], ["a", "b"],
                    _recs("1", "2"))
    assert per[:, 0].tolist() == [0.5, 1.0]
