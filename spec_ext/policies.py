"""Draft-length policies: how many tokens (or which tree) the draft proposes each round.

A chain policy answers three questions for a batch of rows:
  * ``plan()``: the most drafts each row may propose this round;
  * ``keep_drafting(step, probs, tokens, hidden)``: after draft ``step`` (1-based) was
    sampled, which rows go on (probs [B,V] is the draft's temperature-1 distribution the
    token came from; hidden [B,H] the draft's last hidden state that produced it, passed
    only to policies whose ``needs`` has ``"draft_hidden"``, else None);
  * ``observe(num_draft, num_accepted)``: what the target accepted.
``bind(target, draft)`` is called once per generate call, ``start(batch_size, greedy)``
before the first round, ``keep_rows`` when finished rows drop out. Policies whose
``needs`` has ``"target_hidden"`` also get ``see_target(hidden [B,H], next_tokens [B])``
after every verification (and after the prefill): the target's last hidden state at the
last accepted token and the token it produced, the root of the next round. Policies whose
``needs`` has ``"bonus_agreement"`` get ``see_bonus_agreement(agreed [B] bool)`` before
``plan()``: per row, whether the last round accepted every draft and the draft agrees with
the target's token after them (greedy: proposes it; sampling: a draw that accepts with
probability sum_x min(p, q) at that position), i.e. whether acceptance ran on unbroken
through the root.

A tree policy (``Tree``) instead gives a static tree shape; a parallel policy
(``spec_ext.parallel.PEARL``) brings its own loop (``make_loop``). Every policy works with
no arguments (published defaults; the learned ones of ``spec_ext.learned`` load the
bundled pair's predictors) and can be named by its lower-case class name in ``policy=``.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor


class Policy:
    kind = "chain"
    max_draft: int = 5
    needs: tuple[str, ...] = ()

    def bind(self, target, draft) -> None:
        pass

    def start(self, batch_size: int, greedy: bool = True) -> None:
        self.batch_size = batch_size
        self.greedy = greedy

    def plan(self) -> list[int]:
        return [self.max_draft] * self.batch_size

    def keep_drafting(self, step: int, probs: Tensor, tokens: Tensor, hidden: Tensor | None = None) -> Tensor:
        return torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        pass

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.batch_size = len(rows)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and k not in ("batch_size", "greedy"))
        return f"{type(self).__name__}({fields})"


class Fixed(Policy):
    """Vanilla speculative decoding: always ``k`` drafts."""

    def __init__(self, k: int = 5):
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        self.max_draft = k


class Heuristic(Policy):
    """HF assisted generation's "heuristic" schedule, per row: start at ``initial``
    drafts, +2 after a round where all were accepted, else -1 (at least 1)."""

    def __init__(self, initial: int = 20, max_draft: int = 64):
        self.initial = initial
        self.max_draft = max_draft

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._k = [self.initial] * batch_size

    def plan(self) -> list[int]:
        return list(self._k)

    def observe(self, num_draft, num_accepted) -> None:
        self._k = [min(self.max_draft, k + 2) if a >= n else max(1, k - 1)
                   for k, n, a in zip(self._k, num_draft, num_accepted)]

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._k = [self._k[r] for r in rows]


class Confidence(Policy):
    """HF assisted generation's default: up to ``max_draft`` drafts, stop once the draft's
    probability of the token it just proposed is below ``threshold``."""

    def __init__(self, threshold: float = 0.4, max_draft: int = 20):
        self.threshold = threshold
        self.max_draft = max_draft

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        return probs.gather(1, tokens[:, None]).squeeze(1) >= self.threshold


class SVIP(Policy):
    """SVIP: stop once sqrt(c * H(q)) > h for the draft distribution q the last token came
    from (that token is kept as the last draft)."""

    def __init__(self, c: float = 0.15, h: float = 0.3, max_draft: int = 16):
        self.c = c
        self.h = h
        self.max_draft = max_draft

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return (self.c * entropy).sqrt() <= self.h


class Auto(Policy):
    """Chooses k before every round to maximise expected tokens per second, from what it
    measures as it goes: how long runs of accepted drafts are and what a round costs.

    Runs are counted per depth (the chance that draft j is accepted once drafts 1..j-1
    were, from the rounds that reached j; ``prior_acceptance`` before any did), so bursty
    acceptance (long runs on easy text, none on hard) is valued as it is, not as a
    geometric law with the same mean. A round with k drafts yields 1 + sum_{j<=k} S(j)
    tokens, S(j) the chance that the first j are all accepted, and costs a + b*k seconds
    (least squares on its own timed rounds, each capped at 3x the fit so far: a stall of
    the machine is not a cost of k). The estimates forget at rates ``forget_runs`` and
    ``forget_cost`` per round, so k follows easier or harder text and rows finishing (a
    cheaper verification); every fourth round tries k+1 and every fourth k-1 to keep both
    measurable. No tuning, no files: a default for a pair nobody has measured. Lengths
    depend on timing, outputs do not.

    Args:
        max_draft: largest k; initial: k (give or take the exploration) until three
            rounds are timed.
        clock: seconds since some origin (time.perf_counter; tests pass a fake one).
    """

    def __init__(self, max_draft: int = 12, initial: int = 4, prior_acceptance: float = 0.5,
                 forget_runs: float = 0.99, forget_cost: float = 0.9, clock=time.perf_counter):
        if max_draft < 1 or not 1 <= initial <= max_draft:
            raise ValueError(f"max_draft, initial: need 1 <= initial <= max_draft, got {initial}, {max_draft}")
        if not 0 < prior_acceptance < 1 or not (0 < forget_runs <= 1 and 0 < forget_cost <= 1):
            raise ValueError(f"prior_acceptance, forget_runs, forget_cost: need 0 < prior_acceptance < 1 and "
                             f"forget rates in (0, 1], got {prior_acceptance}, {forget_runs}, {forget_cost}")
        self.max_draft = max_draft
        self.initial = initial
        self.prior_acceptance = prior_acceptance
        self.forget_runs = forget_runs
        self.forget_cost = forget_cost
        self._clock = clock

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._k, self._rounds, self._last = self.initial, 0, None
        self._reached = [1.0] * (self.max_draft + 1)  # [j]: rounds that drafted j with 1..j-1 accepted
        self._passed = [self.prior_acceptance] * (self.max_draft + 1)  # [j]: ... and j accepted too
        self._sums = [0.0] * 5  # weights, k, k^2, seconds, k*seconds

    def survival(self) -> list[float]:
        """[S(1), ..., S(max_draft)]: the estimated chance that drafts 1..j are all accepted."""
        chances, alive = [], 1.0
        for j in range(1, self.max_draft + 1):
            alive *= self._passed[j] / self._reached[j]
            chances.append(alive)
        return chances

    def round_cost(self) -> tuple[float, float] | None:
        """(a, b) of the fitted round cost a + b*k in seconds, or None before 3 timed rounds."""
        w, k, kk, t, kt = self._sums
        if self._rounds < 4 or w * kk - k * k <= 1e-9 * w * w:
            return None
        slope = (w * kt - k * t) / (w * kk - k * k)
        base = (t - slope * k) / w
        return base, max(slope, 0.02 * base)  # a draft step costs something, whatever the noise says

    def plan(self) -> list[int]:
        now = self._clock()
        if self._last is not None:  # the round that just ended ran with self._k drafts
            seconds, fitted = now - self._last, self.round_cost()
            if fitted is not None:
                seconds = min(seconds, 3 * (fitted[0] + fitted[1] * self._k))
            self._sums = [self.forget_cost * s for s in self._sums]
            for i, value in enumerate((1.0, self._k, self._k ** 2, seconds, self._k * seconds)):
                self._sums[i] += value
        self._last = now
        self._rounds += 1
        best, cost = self.initial, self.round_cost()
        if cost is not None:
            base, slope = cost
            tokens = [1.0]
            for chance in self.survival():
                tokens.append(tokens[-1] + chance)
            best = max(range(1, self.max_draft + 1), key=lambda k: tokens[k] / (base + slope * k))
        self._k = min(self.max_draft, max(1, best + {1: 1, 3: -1}.get(self._rounds % 4, 0)))
        return [self._k] * self.batch_size

    def observe(self, num_draft, num_accepted) -> None:
        self._reached = [self.forget_runs * x for x in self._reached]
        self._passed = [self.forget_runs * x for x in self._passed]
        for n, a in zip(num_draft, num_accepted):
            for j in range(1, min(a + 1, n) + 1):  # drafts 1..a passed, draft a+1 (if drafted) failed
                self._reached[j] += 1
                self._passed[j] += j <= a


class Tree(Policy):
    """A static draft tree expanded by top-k of the draft: ``branching[d]`` children for
    every node at depth d. Verified in one target pass with tree attention and (when
    sampling) recursive rejection sampling with deterministic drafts."""

    kind = "tree"

    def __init__(self, branching: Sequence[int] = (3, 2, 1, 1)):
        if not branching or any(b < 1 for b in branching):
            raise ValueError(f"branching: need one or more positive counts, got {branching!r}")
        self.branching = tuple(branching)
        parents, levels, frontier = [-1], [], [0]
        for width in self.branching:
            level = []
            for node in frontier:
                for _ in range(width):
                    parents.append(node)
                    level.append(len(parents) - 1)
            levels.append(level)
            frontier = level
        self.parents = parents
        self.levels = levels  # node ids at depth 1, 2, ...
        self.max_draft = len(parents) - 1


POLICIES = {cls.__name__.lower(): cls for cls in (Fixed, Heuristic, Confidence, SVIP, Auto, Tree)}


def register(cls) -> type:
    """Make a policy class available by its lower-case name in ``policy=``."""
    POLICIES[cls.__name__.lower()] = cls
    return cls


def resolve(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(f"policy: expected a Policy or one of {sorted(POLICIES)}, got {policy!r}")

