"""``pretune experiment rlvr``: reinforcement learning from verifiable rewards (GRPO) against zero-shot and SFT.

SmolLM2-135M-Instruct with LoRA on a generated task whose answers a program checks: two-digit additions written as a
chat question ("What is 27 + 82? Reply with the number only."), the answer the sum (the data of docs/grpo.md: 200 /
50 / 100 records drawn with the generator seeds 1 / 2 / 3, so every trial sees the same data whatever its seed).
Four conditions, each scored by held-out greedy exact match on the same 100 test additions, with the same
evaluation (the grpo task's: greedy decoding, the completion's last number against the sum):

* **zero-shot**: the model as it is (one greedy decode: deterministic, no seeds);
* **SFT**: LoRA supervised finetuning on the training prompts with the sum as the assistant's reply (sweep ``sft``);
* **GRPO**: LoRA GRPO from the model, reward ``exact_match`` (sweep ``grpo``, ``init=base``);
* **SFT+GRPO**: the same GRPO run started from the SFT trial of the same seed (``init=sft``: the SFT adapter is
  folded into the base, a new LoRA trained on top), as the SFT-then-RL pipeline does.

The ``grpo`` sweep holds both GRPO conditions (a grid over ``model.init``: links made by :func:`corpus.link_pretrained`
to the model and to each seed's SFT model), so ``--jobs 2`` runs them side by side. The SFT runs are scored
with the grpo task's evaluation by :meth:`Rlvr.measure` (their own evaluation compares whole strings), which also
scores the zero-shot model once (``inputs/zero-shot.json``).

Shao et al. 2024, DeepSeekMath (GRPO); DeepSeek-AI 2025, DeepSeek-R1 (RL from the base model, R1-Zero, against a
cold-start SFT before RL).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from .base import (
    CONFIRMED,
    NOT_CONFIRMED,
    Claim,
    Experiment,
    Finding,
    Results,
    Sweep,
    beats,
    fmt,
    fmt_stats,
    realmodel,
    stats,
    tiny_decoder,
)
from .corpus import downstream_name, link_pretrained, trial_models

TEST = "test.accuracy"  # a GRPO run's greedy exact match on the test additions (its kept model)
HELDOUT = "heldout.accuracy"  # an SFT run's, measured here with the grpo task's evaluation (measure())
LENGTH = "train.completions/mean_length"  # a GRPO run's sampled replies at its last step (tokens)
ZERO_SHOT_FILE = "zero-shot.json"
SPLITS = {"train": 1, "dev": 2, "test": 3}  # split -> generator seed (docs/grpo.md's data)
STARTS = {"base": "GRPO", "sft": "SFT+GRPO"}  # the grpo sweep's model.init link name -> the condition
CONDITIONS = ("zero-shot", "SFT", "GRPO", "SFT+GRPO")
COLORS = {"zero-shot": "0.55", "SFT": "C2", "GRPO": "C0", "SFT+GRPO": "C1"}
SMOOTH = 5  # steps in the moving average drawn over the per-step sampled reward (4 prompts a step are noisy)
# size -> the model; records per split (the first ones of each split's stream); SFT: batch size and epochs; GRPO:
# steps, prompts a step, completions a prompt, tokens a completion, dev evaluation interval; precision; seeds
RECIPES = {
    # a tiny random decoder: a test of the machinery (its numbers mean nothing); 2 steps of each run
    "fast": dict(model="tiny", records={"train": 16, "dev": 8, "test": 8}, sft_batch=4, sft_epochs=0, sft_steps=2,
                 steps=2, prompts=2, group=4, max_new_tokens=6, eval_every=1, precision="fp32", seeds=[0, 1]),
    # SFT: 2 epochs of 25 steps of 8 (measured: dev exact match 0.64 after them, the replies a few tokens); GRPO: 40
    # steps (docs/grpo.md's single run with the task's 60 was best on dev at step 40), the task's defaults otherwise
    # (4 prompts x 8 completions of <= 64 tokens at LoRA's lr 1e-3), dev every 10 steps (keep-best). Precision auto
    # (bf16 where the CPU computes it natively, as docs/grpo.md's run), unlike the other experiments' fp32: measured
    # on one core of an AMD EPYC, a GRPO step from the model took ~20 s in bf16 and ~32 s in fp32, one from the SFT
    # model (~4-token replies) ~4.3 s and ~9.8 s: ~35 minutes against ~1 hour for the whole experiment
    "default": dict(model="smollm2", records={"train": 200, "dev": 50, "test": 100}, sft_batch=8, sft_epochs=2,
                    sft_steps=0, steps=40, prompts=4, group=8, max_new_tokens=64, eval_every=10, precision="auto",
                    seeds=[0, 1, 2]),
    # the task's 60 steps, 3 SFT epochs, five seeds (a tighter spread)
    "large": dict(model="smollm2", records={"train": 200, "dev": 50, "test": 100}, sft_batch=8, sft_epochs=3,
                  sft_steps=0, steps=60, prompts=4, group=8, max_new_tokens=64, eval_every=10, precision="auto",
                  seeds=[0, 1, 2, 3, 4]),
}


def additions(n: int, seed: int) -> list[dict]:
    """``n`` two-digit additions as grpo records (docs/grpo.md's generator): the question as a user message, the sum
    as ``answer``. The same seed gives the same records; a smaller ``n`` their first ones."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = r.randint(10, 99), r.randint(10, 99)
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                    "answer": str(a + b)})
    return out


def sft_record(rec: dict) -> dict:
    """The SFT form of a grpo record: the same prompt, the sum alone as the assistant's reply (TRL's conversational
    prompt-completion form; the reply is what exact_match extracts)."""
    return {"prompt": rec["prompt"], "completion": [{"role": "assistant", "content": rec["answer"]}]}


def grpo_task(r: dict) -> dict:
    """The grpo task settings of every GRPO run and of every evaluation here (the same decoding and extraction)."""
    return {"name": "grpo", "rewards": ["exact_match"], "group_size": r["group"], "max_new_tokens": r["max_new_tokens"]}


class Rlvr(Experiment):
    name = "rlvr"
    title = "RL from verifiable rewards: zero-shot vs SFT vs GRPO vs SFT+GRPO"
    claim = ("Reinforcement learning from a verifiable reward (GRPO) raises a small instruct model's exact-match "
             "accuracy on a task a program can check above its zero-shot accuracy, and RL after SFT improves on SFT "
             "alone and on RL alone.")
    source = ("lecture 001 (GPT-3 and beyond: RLHF, instruction tuning; seeds/001_ddef3cc779cc6a8f.txt) and SPEC §11; "
              "Shao et al. 2024, DeepSeekMath (GRPO; RL after the instruct model, Table 5); DeepSeek-AI 2025, "
              "DeepSeek-R1 (RL from the base, R1-Zero, against a cold-start SFT before RL)")
    claims = (
        Claim("grpo-beats-zero-shot", "GRPO raises held-out greedy exact match above the model's zero-shot score.",
              "confirmed when GRPO's mean test exact match exceeds the zero-shot score by more than 2 x the "
              "standard deviation of GRPO over seeds (the zero-shot score is one deterministic greedy decode: no "
              "spread of its own)"),
        Claim("sft-grpo-beats-sft", "GRPO after SFT raises held-out exact match above SFT alone.",
              "confirmed when SFT+GRPO's mean test exact match exceeds SFT's by more than 2 x the pooled standard "
              "deviation over seeds (SFT+GRPO of seed S starts from the SFT model of seed S)"),
        Claim("sft-grpo-beats-grpo", "Starting GRPO from an SFT model beats GRPO from the instruct model itself.",
              "confirmed when SFT+GRPO's mean test exact match exceeds GRPO's by more than 2 x the pooled standard "
              "deviation over seeds (the same GRPO recipe and steps)"),
    )
    sizes = {
        "fast": "a tiny random-init decoder (a test of the machinery, its numbers mean nothing), 16 / 8 / 8 "
                "additions, 2 steps of SFT and of GRPO (2 prompts x 4 completions of <= 6 tokens), 2 seeds (2 + 4 "
                "trials; ~30 s on 2 free cores)",
        "default": "SmolLM2-135M-Instruct with LoRA on 200 / 50 / 100 additions: SFT 2 epochs of 8 (50 steps, ~1 "
                   "min a trial), GRPO 40 steps of 4 prompts x 8 completions of <= 64 tokens from the model (~13 min a "
                   "trial at ~20 s a step on one core) and from each SFT model (~4-token replies: ~4 min), dev every "
                   "10 steps, seeds 0-2 (3 + 6 trials, two at a time with --jobs 2; about 35 minutes on 2 CPU cores "
                   "in bf16 where the CPU has it (precision auto), about an hour in fp32)",
        "large": "GRPO for the task's 60 steps, SFT 3 epochs, seeds 0-4 (5 + 10 trials; about 1 hour on 2 CPU cores "
                 "in bf16)",
    }
    metric = TEST
    figure_name = "rlvr"

    # ------------------------------------------------------------------------------------------
    # inputs: the additions, their SFT form, the fast size's tiny model, the links GRPO starts from
    # ------------------------------------------------------------------------------------------
    def prepare(self, size: str, folder: Path, log=print) -> dict:
        from ..io.outputs import write_atomic

        r = RECIPES[size]
        folder.mkdir(parents=True, exist_ok=True)
        inputs: dict = {}
        for split, seed in SPLITS.items():
            recs = additions(r["records"][split], seed)
            for kind, rows in (("grpo", recs), ("sft", [sft_record(x) for x in recs])):
                path = folder / f"{kind}-{split}.jsonl"
                if not path.is_file():
                    write_atomic(path, "".join(json.dumps(x) + "\n" for x in rows), fsync=False)
                inputs[f"{kind}_{split}"] = str(path.resolve())
        inputs["model"] = realmodel("smollm2") if r["model"] == "smollm2" else _tiny_model(folder, inputs)
        targets = {("base", s): Path(inputs["model"]) for s in r["seeds"]}
        targets.update(trial_models(self._sft(size, inputs).spec, folder.parent / "sft", lambda p: "sft"))
        inputs["links"] = link_pretrained(folder, targets)
        inputs["zero_shot"] = str((folder / ZERO_SHOT_FILE).resolve())
        return inputs

    def _sft(self, size: str, inputs: dict) -> Sweep:
        r = RECIPES[size]
        return Sweep("sft", {
            "command": "finetune",
            "base": {"model.init": inputs["model"], "peft.method": "lora",
                     # the reply is the sum and the end of turn: a few tokens (max_target_len: what dev generates)
                     "task": {"name": "sft", "max_target_len": 8, "metric": "exact_match_text"},
                     "data": {"train": inputs["sft_train"], "dev": inputs["sft_dev"]},
                     "tune": {"epochs": r["sft_epochs"], "evals_per_epoch": 1},
                     "train": {"steps": r["sft_steps"], "batch_size": r["sft_batch"], "precision": r["precision"],
                               "keep_last": 0, "plot": False, "tensorboard": False}},
            "seeds": r["seeds"],
            "metrics": [HELDOUT, "dev.exact_match_text", "train_seconds"],
        })

    def sweeps(self, size: str, inputs: dict) -> list[Sweep]:
        r = RECIPES[size]
        grpo = Sweep("grpo", {
            "command": "finetune",
            "base": {"peft.method": "lora", "task": grpo_task(r),
                     "data": {split: inputs[f"grpo_{split}"] for split in SPLITS},
                     "tune.epochs": 0,
                     # a checkpoint at every dev evaluation: an interrupted trial resumes (minutes of sampling)
                     "train": {"steps": r["steps"], "batch_size": r["prompts"], "eval_every": r["eval_every"],
                               "log_every": 1, "keep_last": 1, "precision": r["precision"], "plot": False,
                               "tensorboard": False}},
            "grid": {"model.init": [f"{inputs['links']}/seed${{train.seed}}/{start}" for start in STARTS]},
            "seeds": r["seeds"],
            "metrics": [TEST, "dev.accuracy", "train_seconds", LENGTH],
        })
        return [self._sft(size, inputs), grpo]

    def measure(self, size: str, sweep: Sweep, result, inputs: dict, log=print) -> bool:
        """After the SFT sweep: the zero-shot score (once) and each SFT model's, with the grpo task's evaluation of
        the test additions, as the GRPO runs score theirs (the same batches of 2 x prompts a step)."""
        if sweep.name != "sft":
            return False
        from ..io.outputs import mark, write_atomic

        r = RECIPES[size]
        wrote = False
        zero = Path(inputs["zero_shot"])
        if _read(zero) is None:
            scores, seconds = _evaluate(inputs["model"], inputs["grpo_test"], r)
            write_atomic(zero, json.dumps({"model": inputs["model"], "test": scores, "seconds": seconds}, indent=1)
                         + "\n", fsync=False)
            log(f"rlvr: zero-shot test exact match {fmt(scores.get('accuracy'))} ({seconds:.0f} s)")
        for row in result.rows:
            folder = result.out / "trials" / row["trial"]
            results = _read(folder / "results.json")
            if row["status"] != "done" or results is None or "heldout" in results:
                continue
            scores, seconds = _evaluate(str(folder / "model"), inputs["grpo_test"], r)
            results["heldout"] = {**scores, "seconds": seconds, "how": "the grpo task's test evaluation"}
            write_atomic(folder / "results.json", json.dumps(results, indent=1) + "\n")
            mark(folder, ["results.json"])
            log(f"rlvr: {row['trial']}: SFT test exact match {fmt(scores.get('accuracy'))}")
            wrote = True
        return wrote

    # ------------------------------------------------------------------------------------------
    # the verdicts
    # ------------------------------------------------------------------------------------------
    def scores(self, results: Results) -> dict[str, list[float]]:
        """condition -> its test exact match per seed (zero-shot: its one value)."""
        zero = (_read(Path(results.inputs.get("zero_shot", ""))) or {}).get("test", {}).get("accuracy")
        out = {"zero-shot": [zero] if zero is not None else [], "SFT": results.values(HELDOUT, {}, sweep="sft")}
        for start, condition in STARTS.items():
            s = _grpo_setting(results, start)
            out[condition] = list(s["metrics"][TEST]["values"]) if s is not None else []
        return out

    def findings(self, results: Results) -> list[Finding]:
        sc = self.scores(results)
        found = []
        for claim, better, worse in zip(self.claims, ("GRPO", "SFT+GRPO", "SFT+GRPO"), ("zero-shot", "SFT", "GRPO")):
            ok, margin, spread, words = beats(sc[better], sc[worse])
            found.append(Finding(claim, CONFIRMED if ok else NOT_CONFIRMED,
                                 f"test exact match {better} {fmt_stats(sc[better])} ({len(sc[better])} seeds) vs "
                                 f"{worse} {fmt_stats(sc[worse])}; {words}", margin, spread))
        return found

    # ------------------------------------------------------------------------------------------
    # the table and the figure
    # ------------------------------------------------------------------------------------------
    def table(self, results: Results) -> str:
        r = RECIPES[results.size]
        sc = self.scores(results)
        zero = _read(Path(results.inputs.get("zero_shot", ""))) or {}
        sft = results.settings("sft")
        sft_m = sft[0]["metrics"] if sft else {}
        rows = {"zero-shot": ("the model", "nothing", "—", "—", "—",
                              f"{zero['seconds']:.0f} (evaluation)" if "seconds" in zero else "—")}
        sft_steps = f"{r['sft_epochs']} epochs of {r['sft_batch']}" if r["sft_epochs"] else f"{r['sft_steps']} steps"
        rows["SFT"] = ("the model", f"LoRA SFT, {sft_steps}", _cell(sft_m, "dev.exact_match_text"), "—", "—",
                       _cell(sft_m, "train_seconds", 3))
        for start, condition in STARTS.items():
            s = _grpo_setting(results, start)
            m = s["metrics"] if s is not None else {}
            first, last = _reward_window(results, start)
            rows[condition] = ("the model" if start == "base" else "the SFT model of the same seed",
                               f"LoRA GRPO, {r['steps']} steps", _cell(m, "dev.accuracy"),
                               f"{fmt_stats(first, 2)} → {fmt_stats(last, 2)}", _cell(m, LENGTH, 2),
                               _cell(m, "train_seconds", 3))
        lines = ["Held-out greedy exact match on the test additions (mean ± std over the seeds), the kept model's dev "
                 "exact match, the sampled reward over the first and the last 10 GRPO steps, the sampled replies' "
                 "mean length at the last step, and the training time:", "",
                 "| condition | starts from | training | seeds | test exact match | dev exact match | sampled reward "
                 "(first 10 → last 10 steps) | reply tokens (last step) | train seconds |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for c in CONDITIONS:
            start, how, dev, reward, length, seconds = rows[c]
            n = "1 (greedy: deterministic)" if c == "zero-shot" else str(len(sc[c]))
            lines.append(f"| {c} | {start} | {how} | {n} | {fmt_stats(sc[c], 3)} | {dev} | {reward} | {length} | "
                         f"{seconds} |")
        lines += ["", f"{r['records']['test']} test additions; every condition scored by the grpo task's evaluation "
                  f"(greedy, <= {r['max_new_tokens']} tokens, the completion's last number against the sum). "
                  "SFT+GRPO's train seconds are its GRPO run's (add SFT's for the whole pipeline)."]
        return "\n".join(lines)

    def figure(self, results: Results, path: Path) -> Path | None:
        import numpy as np
        from matplotlib.figure import Figure

        from ..io.outputs import write_atomic

        fig = Figure(figsize=(10, 4), layout="constrained")
        left, right = fig.subplots(1, 2, width_ratios=[3, 2])
        for start, condition in STARTS.items():
            curves = _reward_curves(results, start)
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves.values())))
            values = np.array([[c[s] for s in steps] for c in curves.values()])  # (seeds, steps)
            mean, sd = values.mean(0), values.std(0, ddof=1) if len(values) > 1 else np.zeros(len(steps))
            left.fill_between(steps, mean - sd, mean + sd, color=COLORS[condition], alpha=0.15, linewidth=0)
            left.plot(steps, mean, color=COLORS[condition], alpha=0.4, linewidth=0.8)
            k = min(SMOOTH, len(steps))
            smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
            left.plot(steps[k - 1:], smooth, color=COLORS[condition], linewidth=2,
                      label=f"{condition} ({len(curves)} seeds; {k}-step moving average)")
        left.set(xlabel="GRPO step", ylabel="mean sampled reward (exact match)", ylim=(-0.02, 1.02),
                 title="Reward over steps (mean ± std over seeds)")
        left.grid(alpha=0.3)
        left.legend(fontsize=8, loc="upper left")
        sc = self.scores(results)
        for i, c in enumerate(CONDITIONS):
            mean, sd = stats(sc[c])
            if mean is None:
                continue
            right.bar(i, mean, yerr=sd or 0.0, capsize=4, color=COLORS[c], alpha=0.7)
            right.scatter([i] * len(sc[c]), sc[c], color="black", s=12, zorder=3)
        right.set_xticks(range(len(CONDITIONS)), CONDITIONS)
        right.set(ylabel="test exact match (greedy)", ylim=(-0.02, 1.02), title="Held-out exact match (dots: seeds)")
        right.grid(alpha=0.3, axis="y")
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
        return path


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _evaluate(model: str, data: str, r: dict) -> tuple[dict, float]:
    """(the grpo task's test metrics, seconds) of a model folder, batched as a GRPO run batches its test set."""
    from ..jobs.inference import evaluate
    from ..train.precision import resolve_precision

    t0 = time.time()
    scores = evaluate(model, data, task_overrides=grpo_task(r), batch_size=2 * r["prompts"],
                      precision=resolve_precision(r["precision"]), show_progress=False)
    return scores, round(time.time() - t0, 1)


def _grpo_setting(results: Results, start: str) -> dict | None:
    """The grpo sweep's setting that started from ``start`` (``base`` or ``sft``)."""
    return next((s for s in results.settings("grpo") if downstream_name(s["params"]) == start), None)


def _cell(metrics: dict, name: str, digits: int = 3) -> str:
    return fmt_stats(metrics[name]["values"], digits) if name in metrics else "—"


def _reward_curves(results: Results, start: str) -> dict[int, dict[int, float]]:
    """seed -> step -> the mean sampled reward of that step, from each finished GRPO trial's metrics.jsonl."""
    res = results.sweeps.get("grpo")
    out: dict[int, dict[int, float]] = {}
    for row in results.rows:
        if row["sweep"] != "grpo" or row["status"] != "done" or downstream_name(row["params"]) != start:
            continue
        curve = {}
        try:
            lines = (res.out / "trials" / row["trial"] / "metrics.jsonl").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            rec = json.loads(line) if line.strip() else {}
            if rec.get("split") == "train" and rec.get("reward") is not None:
                curve[int(rec["step"])] = float(rec["reward"])
        if curve:
            out[row["seed"]] = curve
    return out


def _reward_window(results: Results, start: str, n: int = 10) -> tuple[list[float], list[float]]:
    """Per seed: the mean sampled reward over the first and over the last ``n`` steps."""
    first, last = [], []
    for curve in _reward_curves(results, start).values():
        values = [curve[s] for s in sorted(curve)]
        first.append(sum(values[:n]) / len(values[:n]))
        last.append(sum(values[-n:]) / len(values[-n:]))
    return first, last


def _tiny_model(folder: Path, inputs: dict) -> str:
    """The fast size's model: a tiny random-init decoder with a BPE vocabulary of the additions as pretune's default
    chat template renders them (made once, reused by a rerun)."""
    def texts():
        out = [f"User: {json.loads(line)['prompt'][0]['content']}\nAssistant: {json.loads(line)['answer']}"
               for line in open(inputs["grpo_train"], encoding="utf-8") if line.strip()]
        return out + [str(i) for i in range(200)]

    return tiny_decoder(folder, texts, vocab_size=300, max_seq_len=128)


EXPERIMENT = Rlvr()
