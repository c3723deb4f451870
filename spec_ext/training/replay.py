"""Replaying speculative decoding on teacher-forced acceptances with measured round costs:
draft-length rules compared without timing noise, their settings chosen, and bounds on what
any rule could gain."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from spec_ext.training.data import accepted_runs

MAX_LENGTH = 12  # longest chain the labels (and the learned policies) consider
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97)  # SpecDecPP's, replayed on validation
OFFSETS = (-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0)  # AdaLength's


def simulated_tokens_per_ms(accept: Tensor, lengths: Tensor, round_ms: Sequence[float],
                            max_length: int) -> tuple[float, float]:
    """Replay chain speculative decoding on teacher-forced acceptances with measured round
    costs, to compare draft-length rules without timing noise.

    accept [N,P] bool: accept[n, j] says whether the draft proposed right after root j of
    row n is accepted, given every earlier draft of the round was. lengths [N,P] int: the
    drafts a rule proposes in a round rooted at j (1..max_length). round_ms[k]: the cost of
    a round with k drafts. A round rooted at j keeps the run of accepted drafts (at most
    ``lengths[n, j]``) plus the target's token; rows stop when a round could reach past the
    data (j + max_length > P).
    Returns (tokens per ms, mean drafts per round).
    """
    return simulated_batch_tokens_per_ms(accept, lambda rows, roots: int(lengths[rows[0], roots[0]]),
                                         lambda k, n: round_ms[k], max_length, batch=1)


def simulated_batch_tokens_per_ms(accept: Tensor, choose, round_ms, max_length: int,
                                  batch: int) -> tuple[float, float]:
    """:func:`simulated_tokens_per_ms` for batches that draft as one: rows
    ``batch*i .. batch*(i+1)-1`` of accept [N,P] decode together, each round proposing
    ``choose(rows, roots)`` drafts (rows [n] int64: the batch's unfinished rows, roots [n]
    int64: where each row's round is rooted) at a cost of ``round_ms(k, n)`` ms for n
    unfinished rows; each row keeps its own run of accepted drafts.
    Returns (tokens per ms, mean drafts per round).
    """
    P = accept.shape[1]
    runs = accepted_runs(accept.float(), max_length).long()
    tokens = cost = rounds = drafted = 0
    for first in range(0, len(accept), batch):
        rows = torch.arange(first, min(first + batch, len(accept)))
        roots = torch.zeros_like(rows)
        while True:
            going = roots + max_length <= P
            rows, roots = rows[going], roots[going]
            if len(rows) == 0:
                break
            k = choose(rows, roots)
            kept = runs[rows, roots].clamp(max=k)
            tokens += int(kept.sum()) + len(rows)
            cost += round_ms(k, len(rows))
            rounds += 1
            drafted += k
            roots = roots + kept + 1
    return tokens / cost, drafted / max(1, rounds)


def replay(accept: Tensor, candidates: dict, round_ms: list[float]) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's lengths [N,P]."""
    return {name: simulated_tokens_per_ms(accept, lengths, round_ms, MAX_LENGTH)
            for name, lengths in candidates.items()}


def batch_round_ms(alone_ms: list[float], batch_ms: list[float], batch: int):
    """(k, n) -> ms of a round with k drafts for n unfinished rows: the line between the
    batch-1 and the batch-``batch`` costs."""
    return lambda k, n: alone_ms[k] + (batch_ms[k] - alone_ms[k]) * (n - 1) / (batch - 1)


def replay_batches(accept: Tensor, candidates: dict, alone_ms: list[float], batch_ms: list[float],
                   batch: int) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's batch choice (rows, roots) -> k,
    in batches of ``batch`` rows (round costs: batch_round_ms)."""
    round_ms = batch_round_ms(alone_ms, batch_ms, batch)
    return {name: simulated_batch_tokens_per_ms(accept, choose, round_ms, MAX_LENGTH, batch)
            for name, choose in candidates.items()}


def best_of(rates: dict) -> tuple[dict, dict, dict]:
    """From replayed {name: (tokens per ms, mean drafts)} with names "family setting=value":
    the best name of each family (fixed, specdecpp, adalength), its value, and the table
    {name: tokens_per_ms, vs_best_fixed, mean_drafts}."""
    best = {family: max((n for n in rates if n.startswith(family)), key=lambda n: rates[n][0])
            for family in ("fixed", "specdecpp", "adalength")}
    reference = rates[best["fixed"]][0]
    table = {n: dict(tokens_per_ms=round(r, 4), vs_best_fixed=round(r / reference, 3), mean_drafts=round(k, 2))
             for n, (r, k) in rates.items()}
    return best, {family: float(name.split("=")[1]) for family, name in best.items()}, table


def survival(chances: Tensor, past_end: float) -> Tensor:
    """[N,P,MAX_LENGTH]: at [n, j, m], the product of chances[n, j..j+m] (chances [N,P] of
    acceptance per position; ``past_end`` stands in for positions past P)."""
    P = chances.shape[1]
    padded = torch.nn.functional.pad(chances, (0, MAX_LENGTH), value=past_end)
    return padded.unfold(1, MAX_LENGTH, 1)[:, :P].cumprod(-1)


def batch_choices(accept_probability: Tensor, length: Tensor) -> tuple[dict, dict, dict]:
    """The candidates of replay_batches: fixed k, SpecDecPP's batch rule (go on while 1 - the
    rows' mean predicted survival <= threshold) and AdaLength's (ceil of the rows' mean
    predicted length + offset)."""
    predicted = survival(accept_probability, past_end=1.0)

    def specdecpp(threshold):
        def choose(rows, roots):
            stop = (1 - predicted[rows, roots].mean(0)) > threshold
            return int(stop.float().argmax()) + 1 if bool(stop.any()) else MAX_LENGTH
        return choose

    def adalength(offset):
        return lambda rows, roots: int((length[rows, roots].mean() + offset).ceil().clamp(1, MAX_LENGTH))

    fixed = {f"fixed k={k}": (lambda rows, roots, k=k: k) for k in range(1, MAX_LENGTH + 1)}
    return (fixed, {f"specdecpp threshold={h}": specdecpp(h) for h in THRESHOLDS},
            {f"adalength offset={o}": adalength(o) for o in OFFSETS})


def bounds(accept: Tensor, chances: Tensor, round_ms, batch_ms) -> tuple[dict, dict]:
    """What length rules could reach at best, as replay candidates (lengths [N,P] at batch
    1, choose(rows, roots) for batches; batch_ms(k, n) the batch round cost):
      * "oracle": knows the run the target will accept (drafts exactly that many at batch 1;
        the k with the most tokens per ms for the batch's runs);
      * "chances known": knows every position's acceptance chance in advance (greedy: the
        outcome itself; sampling: sum_x min(p, q)) but not the draws, and takes the k with the
        most expected tokens per ms: at T=1 no rule that cannot see the random draws should
        beat it, however good its predictor."""
    runs = accepted_runs(accept.float(), MAX_LENGTH).long()
    expected = 1 + survival(chances, past_end=0.0).cumsum(-1)  # [N,P,k]: tokens a round yields with k drafts
    per_k = torch.tensor(round_ms[1:MAX_LENGTH + 1])
    alone = {"oracle": runs.clamp_min(1), "chances known": (expected / per_k).argmax(-1) + 1}
    ks = range(1, MAX_LENGTH + 1)

    def oracle(rows, roots):
        run = runs[rows, roots]
        return max(ks, key=lambda k: (int(run.clamp(max=k).sum()) + len(rows)) / batch_ms(k, len(rows)))

    def chances_known(rows, roots):
        tokens = expected[rows, roots].sum(0)
        return max(ks, key=lambda k: float(tokens[k - 1]) / batch_ms(k, len(rows)))
    return alone, {"oracle": oracle, "chances known": chances_known}


def specdecpp_lengths(accept_probability: Tensor, threshold: float) -> Tensor:
    """SpecDecPP's drafts per root [N,P]: the first m with 1 - prod of the next m predicted
    acceptances > threshold, at most MAX_LENGTH."""
    stop = (1 - survival(accept_probability, past_end=1.0)) > threshold
    first = stop.float().argmax(-1) + 1
    return torch.where(stop.any(-1), first, torch.full_like(first, MAX_LENGTH))
