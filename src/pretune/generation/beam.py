"""Beam search: keep the ``num_beams`` most likely partial sequences of each prompt, step by step.

The rules are transformers' (``generate(num_beams=...)``), so the same model gives the same tokens:

* Each step scores every (beam, next token) pair by its summed log-probability and takes the best
  ``max(2, 1 + len(eos)) * num_beams`` candidates (or samples that many, for beam sampling), so that
  ``num_beams`` of them can go on even if all the best ones end.
* A candidate that ends (EOS, a stop string, or max_new_tokens reached) and ranks among the first
  ``num_beams`` becomes a finished hypothesis, scored sum(log p) / new_tokens ** length_penalty; a prompt
  keeps its ``num_beams`` best hypotheses. The best ``num_beams`` candidates that did not end run on.
* A prompt is done when ``early_stopping=True`` and it has ``num_beams`` hypotheses, or when its best
  running beam cannot beat its worst hypothesis: judged at the current length, or with
  ``early_stopping="never"`` and ``length_penalty > 0`` at the longest possible length.
* Excluded candidates get -1e9 added to their score rather than being removed (transformers' trick for
  fixed shapes); beams other than the first start at -1e9 so the first step expands one copy of the prompt.
"""

from __future__ import annotations

import torch

_OUT = -1.0e9  # added to a score to take a candidate out of the running


def beam_search(runner, logits: torch.Tensor, scorer, *, num_beams: int, max_new_tokens: int, eos: list[int],
                pad: int, length_penalty: float, early_stopping: bool | str, num_return_sequences: int,
                do_sample: bool, generator: torch.Generator | None, stop) -> torch.Tensor:
    """Run beam search from a prompt already run by ``runner`` (its rows: num_beams adjacent copies of each
    prompt; ``logits`` (B * num_beams, vocab) the next-token logits after it).

    Returns (B * num_return_sequences, prompt + n) token ids: each prompt's best hypotheses, best first, filled
    after their end with ``pad`` (with the EOS id when pad is 0, as transformers does).
    """
    K = num_beams
    N, V = logits.shape
    B = N // K
    dev = logits.device
    P = runner.prompt_len
    max_len = P + max_new_tokens
    fill = pad if pad or not eos else eos[0]
    n_cand = max(2, 1 + len(eos)) * K
    eos_t = torch.tensor(eos, device=dev) if eos else None
    top_rank = torch.arange(n_cand, device=dev) < K  # (n_cand,) candidates allowed to become hypotheses
    row0 = torch.arange(B, device=dev)[:, None] * K  # (B, 1) first row of each prompt

    seqs = torch.full((B, K, max_len), fill, dtype=torch.long, device=dev)  # running beams
    seqs[:, :, :P] = runner.ids[:, :P].view(B, K, P)
    scores = torch.zeros(B, K, device=dev)
    scores[:, 1:] = _OUT
    done_seqs = seqs.clone()  # finished hypotheses, best first
    done_scores = torch.full((B, K), _OUT, device=dev)
    done = torch.zeros(B, K, dtype=torch.bool, device=dev)  # slot holds a real hypothesis
    done_len = torch.zeros(B, K, dtype=torch.long, device=dev)  # its new-token count
    can_improve = torch.ones(B, dtype=torch.bool, device=dev)

    for cur in range(P, max_len):
        n_new = cur + 1 - P  # new tokens of a candidate
        logp = scorer(torch.log_softmax(logits, dim=-1), cur - P)  # (B*K, V)
        total = (logp.view(B, K, V) + scores[..., None]).view(B, K * V)
        if do_sample:
            pick = torch.multinomial(total.softmax(-1), n_cand, generator=generator)  # (B, n_cand)
            cand = total.gather(1, pick)
        else:
            cand, pick = total.topk(n_cand, dim=1)
        beam, tok = pick // V, pick % V  # (B, n_cand) source beam and token of each candidate
        cand_seqs = seqs.gather(1, beam[..., None].expand(B, n_cand, max_len))
        cand_seqs[:, :, cur] = tok
        if cur + 1 == max_len:
            ends = torch.ones(B, n_cand, dtype=torch.bool, device=dev)
        elif eos_t is not None:
            ends = torch.isin(tok, eos_t)
        else:
            ends = torch.zeros(B, n_cand, dtype=torch.bool, device=dev)
        if stop is not None:
            for b, j in (~ends).nonzero().tolist():
                if stop(cand_seqs[b, j], cur + 1):
                    ends[b, j] = True

        # the best K candidates that did not end run on
        alive = cand + _OUT * ends.float()
        keep = alive.topk(K, dim=1).indices  # (B, K), best first
        seqs = cand_seqs.gather(1, keep[..., None].expand(B, K, max_len))
        scores = alive.gather(1, keep)
        src = beam.gather(1, keep)

        # ending candidates among the first K become hypotheses, scored with the length penalty
        finished = ends & top_rank
        blocked = ~can_improve | (done.all(1) & (early_stopping is True))  # (B,) accepts no more
        fin = cand / n_new ** length_penalty + _OUT * blocked[:, None].float() + _OUT * (~finished).float()
        best = torch.cat([done_scores, fin], 1).topk(K, dim=1).indices  # (B, K)
        done_scores = torch.cat([done_scores, fin], 1).gather(1, best)
        done_seqs = torch.cat([done_seqs, cand_seqs], 1).gather(1, best[..., None].expand(B, K, max_len))
        done = torch.cat([done, finished], 1).gather(1, best)
        done_len = torch.cat([done_len, torch.full_like(fin, n_new, dtype=torch.long)], 1).gather(1, best)

        # can the best running beam still beat the worst hypothesis?
        longest = max_new_tokens if early_stopping == "never" and length_penalty > 0 else n_new
        best_possible = scores[:, :1] / longest ** length_penalty  # (B, 1)
        worst = torch.where(done, done_scores.min(1, keepdim=True).values, _OUT)  # (B, K)
        can_improve &= (best_possible > worst).any(1)
        if not bool(can_improve.any()) or bool(ends.all()) or (early_stopping is True and bool(done.all())):
            break
        runner.reorder((src + row0).view(-1), same_source=True)
        runner.append(seqs[:, :, cur].reshape(-1))
        logits = runner.logits()

    R = num_return_sequences
    out = done_seqs[:, :R].reshape(B * R, max_len)
    return out[:, : P + int(done_len[:, :R].max())]
