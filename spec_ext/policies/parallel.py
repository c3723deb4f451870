"""Parallel speculative decoding's settings: the draft never waits for the target
(:class:`PEARL`), and branches where it is unsure (:class:`SpecBranch`). The engine that
runs them is :mod:`spec_ext.engine.parallel`."""
from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar

from spec_ext.policies.base import Policy, check, register


class BranchHint(enum.IntEnum):
    """What SpecBranch's branch-point predictor says about a row's next drafts."""
    REJECT_ALL = 0  # likely all rejected: fork every branch at the root's first draft
    DEFER = 1       # uncertain: fork by the draft's confidence
    ACCEPT_ALL = 2  # likely all accepted: draft a plain chain


@register
@dataclass(frozen=True)
class PEARL(Policy):
    """Parallel speculative decoding (PEARL): the draft drafts continuously while the target
    verifies; each target forward verifies up to ``gamma`` queued drafts plus those that
    arrived while it ran (see :mod:`spec_ext.engine.parallel`; the gamma a call ran with is
    its ``stats.gamma``).

    Args:
        gamma: most drafts fed to one target forward; None picks it from the measured
            target-forward / draft-step time ratio.
        mode: ``"threads"`` (the draft in a thread of this process) or ``"distributed"``
            (the draft model lives on ``draft_rank``, which runs
            :func:`spec_ext.serve_draft`; pass ``draft=None`` to generate).
        timeout: seconds without a message from the other side before giving up.
        max_gamma: the most drafts per forward that the automatic gamma may pick.
    """
    parallel: ClassVar[bool] = True
    branches: ClassVar[int] = 1
    _: KW_ONLY
    gamma: int | None = None
    mode: str = "threads"
    draft_rank: int = 1
    timeout: float = 60.0
    max_gamma: int = 12

    def __post_init__(self):
        check(self.gamma is None or self.gamma >= 1, "gamma", f"must be >= 1 or None (automatic), got {self.gamma}")
        check(self.mode in ("threads", "distributed"), "mode",
              f"expected 'threads' or 'distributed', got {self.mode!r}")
        check(self.timeout > 0, "timeout", f"must be > 0 seconds, got {self.timeout}")

    @property
    def max_draft(self) -> int:
        return self.max_gamma if self.gamma is None else self.gamma

    @property
    def drafts_elsewhere(self) -> bool:
        return self.mode == "distributed"

    @property
    def lookahead(self) -> int:
        """How far (tokens past the committed ones) a lane may draft ahead."""
        return 2 * self.max_draft + 2

    @property
    def learned(self) -> bool:
        """Whether the engine must pass the target's hidden states to the hinter."""
        return False

    def hinter(self, target):
        """Per call: (hidden [B,H], roots [B], greedy) -> per row where to branch next (PEARL: never)."""
        return lambda hidden, roots, greedy: [BranchHint.DEFER] * len(roots)


@register
@dataclass(frozen=True)
class SpecBranch(PEARL):
    """PEARL plus branches at uncertain points: when the draft's probability of the token
    it drew is q, it forks k = max(1, floor(branches * (1 - q))) siblings there (top-k when
    greedy, drawn without replacement from the draft distribution when sampling), each
    drafted on as its own lane while lanes are free (at most ``branches`` per row). The
    target verifies the whole tree in one forward with tree attention and multi-draft
    recursive rejection sampling, so the branch decisions keep the output exact.
    ``predictor``: a :class:`spec_ext.policies.BranchPredictor` that reads the target's
    hidden state after each verification and tells the draft side where to branch
    (SpecBranch's learned branch points); None branches by the draft's confidence only.
    Other arguments as :class:`PEARL`.
    """
    branches: int = 4
    predictor: object = None

    def __post_init__(self):
        super().__post_init__()
        check(self.branches >= 1, "branches", f"must be >= 1, got {self.branches}")

    @property
    def learned(self) -> bool:
        return self.predictor is not None

    def hinter(self, target):
        if self.predictor is None:
            return super().hinter(target)
        return self.predictor.bound(target)
