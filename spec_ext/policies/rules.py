"""Chain rules: how many drafts each row proposes per round (none; vanilla speculative
decoding; HF assisted generation's schedules; SVIP)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from spec_ext.policies.base import Call, Controller, Policy, Report, RoundPlan, RoundState, check, register


@register
@dataclass(frozen=True)
class Plain(Policy):
    """No drafts: one target forward per token through spec_ext's forward, cache, sampler, HF
    settings, grammars and streamer (a draft given beside it is not used). spec_ext's decoding
    without speculation, and the reference that speculative greedy output is bit-identical to
    (``docs/invariance.md``)."""
    needs_model: ClassVar[bool] = False
    drafts: ClassVar[bool] = False

    @property
    def max_draft(self) -> int:
        return 0


@register
@dataclass(frozen=True)
class Fixed(Policy):
    """Vanilla speculative decoding: always ``k`` drafts (None: the drafter's own chain, a
    block drafter's slots or the MTP layers' count, else 5)."""
    k: int | None = None

    DEFAULT: ClassVar[int] = 5

    def __post_init__(self):
        check(self.k is None or isinstance(self.k, int) and self.k >= 1, "k",
              f"must be an int >= 1 or None, got {self.k!r}")

    @property
    def max_draft(self) -> int:
        return self.DEFAULT if self.k is None else self.k

    def fitted(self, max_depth: int | None, chain: int | None, drafter: str = "the drafter") -> Policy:
        if self.k is None:
            return Fixed(min(chain or self.DEFAULT, max_depth or self.DEFAULT))
        if max_depth is not None and self.k > max_depth:
            raise ValueError(f"policy: {self!r} drafts {self.k} in a line; {drafter} drafts at most {max_depth}")
        return self


@register
@dataclass(frozen=True)
class Heuristic(Policy):
    """HF assisted generation's "heuristic" schedule, per row: start at ``initial`` drafts,
    +2 after a round where all were accepted, else -1 (at least 1, at most ``max_draft``)."""
    initial: int = 20
    max_draft: int = 64

    def __post_init__(self):
        check(1 <= self.initial <= self.max_draft, "initial, max_draft",
              f"need 1 <= initial <= max_draft, got {self.initial}, {self.max_draft}")

    def start(self, call: Call) -> Controller:
        return _Heuristic(self, call)


class _Heuristic(Controller):
    per_row = ("k",)

    def __init__(self, policy: Heuristic, call: Call):
        super().__init__(policy, call)
        self.k = [policy.initial] * call.batch_size

    def plan(self, state: RoundState) -> RoundPlan:
        return RoundPlan(list(self.k))

    def observe(self, report: Report) -> None:
        top = self.policy.max_draft
        self.k = [min(top, k + 2) if a >= n else max(1, k - 1)
                  for k, n, a in zip(self.k, report.drafted, report.accepted)]


@register
@dataclass(frozen=True)
class Confidence(Policy):
    """HF assisted generation's default: up to ``max_draft`` drafts, stop once the draft's
    probability of the token it just proposed is below ``threshold``."""
    threshold: float = 0.4
    max_draft: int = 20

    def goes_on(self, step: int, probs: Tensor, tokens: Tensor, hidden=None) -> Tensor:
        return probs.gather(1, tokens[:, None]).squeeze(1) >= self.threshold


@register
@dataclass(frozen=True)
class SVIP(Policy):
    """SVIP: stop once sqrt(c * H(q)) > h for the draft distribution q the last token came
    from (that token is kept as the last draft)."""
    c: float = 0.15
    h: float = 0.3
    max_draft: int = 16

    def goes_on(self, step: int, probs: Tensor, tokens: Tensor, hidden=None) -> Tensor:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return (self.c * entropy).sqrt() <= self.h
