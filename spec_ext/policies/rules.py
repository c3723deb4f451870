"""Chain rules: how many drafts each row proposes per round (see :class:`Policy` for the
protocol the serial engine calls)."""
from __future__ import annotations

import time

from torch import Tensor

from spec_ext.policies.base import Policy, register


@register
class Fixed(Policy):
    """Vanilla speculative decoding: always ``k`` drafts."""

    def __init__(self, k: int = 5):
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        self.max_draft = k


@register
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


@register
class Confidence(Policy):
    """HF assisted generation's default: up to ``max_draft`` drafts, stop once the draft's
    probability of the token it just proposed is below ``threshold``."""

    def __init__(self, threshold: float = 0.4, max_draft: int = 20):
        self.threshold = threshold
        self.max_draft = max_draft

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        return probs.gather(1, tokens[:, None]).squeeze(1) >= self.threshold


@register
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


@register
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
    measurable. No tuning, no files: a default for a pair nobody has measured.

    Greedy, lengths depend on timing and outputs do not. Sampling, which tokens come out
    depends on how the random stream is split into rounds, so there the round cost is not
    timed but taken as 1 + k * (draft parameters / target parameters) (decoding reads every
    weight once per step): a seed (or ``torch.manual_seed``) then reproduces the output.

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

    def bind(self, target, draft) -> None:
        size = sum(p.numel() for p in target.parameters())
        self._size_ratio = sum(p.numel() for p in draft.parameters()) / size if size and draft is not None else None

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._timed = greedy or getattr(self, "_size_ratio", None) is None
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
        """(a, b) of the fitted round cost a + b*k in seconds, or None before 3 timed rounds
        (sampling: the fixed cost of the class docstring, in target forwards)."""
        if not self._timed:
            return 1.0, max(self._size_ratio, 0.02)
        w, k, kk, t, kt = self._sums
        if self._rounds < 4 or w * kk - k * k <= 1e-9 * w * w:
            return None
        slope = (w * kt - k * t) / (w * kk - k * k)
        base = (t - slope * k) / w
        return base, max(slope, 0.02 * base)  # a draft step costs something, whatever the noise says

    def plan(self) -> list[int]:
        now = self._clock() if self._timed else None
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
