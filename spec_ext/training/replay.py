"""Replaying speculative decoding on teacher-forced acceptances with measured round costs:
draft-length rules compared without timing noise, their settings chosen, and bounds on what
any rule could gain.

The replay reads, per root j of a row (a round rooted at the row's j-th context end), the
run of drafts a round of up to MAX_LENGTH accepts (``runs`` [N,P], from
:func:`spec_ext.training.features_and_labels`) and, where a rule needs them, grids
[N,P,MAX_LENGTH] of each step's acceptance chance (step s of the round rooted at j, given
the steps before were accepted): measured (``chances_*``) or predicted. A draft model's
grids follow from per-position values (:func:`spec_ext.training.steps_ahead`); a feature
head's chains are their own, so its grids come from its unrolled steps."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

MAX_LENGTH = 12  # longest chain the labels (and the learned policies) consider
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97)  # SpecDecPP's, replayed on validation
OFFSETS = (-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0)  # AdaLength's


def simulated_tokens_per_ms(runs: Tensor, lengths: Tensor, round_ms: Sequence[float],
                            max_length: int) -> tuple[float, float]:
    """Replay chain speculative decoding on teacher-forced acceptances with measured round
    costs, to compare draft-length rules without timing noise.

    runs [N,P] int: runs[n, j], the drafts a round rooted at j of row n accepts when it drafts
    ``max_length`` (at most that); with k drafts it keeps min(runs, k). lengths [N,P] int: the
    drafts a rule proposes in a round rooted at j (1..max_length). round_ms[k]: the cost of a
    round with k drafts. A round rooted at j keeps its accepted drafts plus the target's token;
    rows stop when a round could reach past the data (j + max_length > P).
    Returns (tokens per ms, mean drafts per round).
    """
    return simulated_batch_tokens_per_ms(runs, lambda rows, roots: int(lengths[rows[0], roots[0]]),
                                         lambda k, n: round_ms[k], max_length, batch=1)


def simulated_batch_tokens_per_ms(runs: Tensor, choose, round_ms, max_length: int,
                                  batch: int) -> tuple[float, float]:
    """:func:`simulated_tokens_per_ms` for batches that draft as one: rows
    ``batch*i .. batch*(i+1)-1`` of runs [N,P] decode together, each round proposing
    ``choose(rows, roots)`` drafts (rows [n] int64: the batch's unfinished rows, roots [n]
    int64: where each row's round is rooted) at a cost of ``round_ms(k, n)`` ms for n
    unfinished rows; each row keeps its own run of accepted drafts.
    Returns (tokens per ms, mean drafts per round).
    """
    P = runs.shape[1]
    runs = runs.long()
    tokens = cost = rounds = drafted = 0
    for first in range(0, len(runs), batch):
        rows = torch.arange(first, min(first + batch, len(runs)))
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


def replay(runs: Tensor, candidates: dict, round_ms: list[float]) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's lengths [N,P] (runs [N,P]:
    see :func:`simulated_tokens_per_ms`)."""
    return {name: simulated_tokens_per_ms(runs, lengths, round_ms, MAX_LENGTH)
            for name, lengths in candidates.items()}


def batch_round_ms(alone_ms: list[float], batch_ms: list[float], batch: int):
    """(k, n) -> ms of a round with k drafts for n unfinished rows: the line between the
    batch-1 and the batch-``batch`` costs."""
    return lambda k, n: alone_ms[k] + (batch_ms[k] - alone_ms[k]) * (n - 1) / (batch - 1)


def replay_batches(runs: Tensor, candidates: dict, alone_ms: list[float], batch_ms: list[float],
                   batch: int) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's batch choice (rows, roots) -> k,
    in batches of ``batch`` rows (runs [N,P]; round costs: batch_round_ms)."""
    round_ms = batch_round_ms(alone_ms, batch_ms, batch)
    return {name: simulated_batch_tokens_per_ms(runs, choose, round_ms, MAX_LENGTH, batch)
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


def batch_choices(accept_probability: Tensor, length: Tensor) -> tuple[dict, dict, dict]:
    """The candidates of replay_batches: fixed k, SpecDecPP's batch rule (go on while 1 - the
    rows' mean predicted survival <= threshold; accept_probability [N,P,MAX_LENGTH]: the
    predicted acceptance of each step of the round rooted at each root) and AdaLength's
    (ceil of the rows' mean predicted length [N,P] + offset)."""
    predicted = accept_probability.cumprod(-1)

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


def bounds(runs: Tensor, chances: Tensor, round_ms, batch_ms) -> tuple[dict, dict]:
    """What length rules could reach at best, as replay candidates (lengths [N,P] at batch
    1, choose(rows, roots) for batches; batch_ms(k, n) the batch round cost), from runs [N,P]
    and chances [N,P,MAX_LENGTH], each step's acceptance chance of the round rooted at each root:
      * "oracle": knows the run the target will accept (drafts exactly that many at batch 1;
        the k with the most tokens per ms for the batch's runs);
      * "chances known": knows every step's acceptance chance in advance (greedy: the
        outcome itself; sampling: sum_x min(p, q)) but not the draws, and takes the k with the
        most expected tokens per ms: at T=1 no rule that cannot see the random draws should
        beat it, however good its predictor."""
    runs = runs.long()
    expected = 1 + chances.cumprod(-1).cumsum(-1)  # [N,P,k]: tokens a round yields with k drafts
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
    """SpecDecPP's drafts per root [N,P] from accept_probability [N,P,MAX_LENGTH] (the
    predicted acceptance of each step of the round rooted at each root): the first m with
    1 - prod of the first m > threshold, at most MAX_LENGTH."""
    stop = (1 - accept_probability.cumprod(-1)) > threshold
    first = stop.float().argmax(-1) + 1
    return torch.where(stop.any(-1), first, torch.full_like(first, MAX_LENGTH))
