"""Parallel speculative decoding's settings: the draft never waits for the target
(:class:`PEARL`), and branches where it is unsure (:class:`SpecBranch`). The engine that
runs them is :mod:`spec_ext.engine.parallel`."""
from __future__ import annotations

import enum

from torch import Tensor

from spec_ext.policies.base import Policy, register


class BranchHint(enum.IntEnum):
    """What SpecBranch's branch-point predictor says about a row's next drafts."""
    REJECT_ALL = 0  # likely all rejected: fork every branch at the root's first draft
    DEFER = 1       # uncertain: fork by the draft's confidence
    ACCEPT_ALL = 2  # likely all accepted: draft a plain chain


@register
class PEARL(Policy):
    """Parallel speculative decoding (PEARL): the draft drafts continuously while the target
    verifies; each target forward verifies up to ``gamma`` queued drafts plus those that
    arrived while it ran (see :mod:`spec_ext.engine.parallel`).

    Args:
        gamma: most drafts fed to one target forward; None picks it from the measured
            target-forward / draft-step time ratio.
        mode: ``"threads"`` (the draft in a thread of this process) or ``"distributed"``
            (the draft model lives on ``draft_rank``, which runs
            :func:`spec_ext.serve_draft`; pass ``draft=None`` to generate).
        timeout: seconds without a message from the other side before giving up.
        max_gamma: the most drafts per forward that the automatic gamma may pick.
    """

    branches = 1
    parallel = True
    learned = False  # whether the engine must pass the target's hidden states to hints()

    def __init__(self, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12):
        if gamma is not None and gamma < 1:
            raise ValueError(f"gamma: must be >= 1 or None (automatic), got {gamma}")
        if mode not in ("threads", "distributed"):
            raise ValueError(f"mode: expected 'threads' or 'distributed', got {mode!r}")
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.gamma, self.mode, self.draft_rank, self.timeout = gamma, mode, draft_rank, timeout
        self.max_draft = max_gamma if gamma is None else gamma
        self.chosen_gamma: int | None = None

    @property
    def lookahead(self) -> int:
        """How far (tokens past the committed ones) a lane may draft ahead."""
        return 2 * self.max_draft + 2

    def hints(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[BranchHint]:
        """Per row, where to branch next (PEARL: never)."""
        return [BranchHint.DEFER] * len(roots)


@register
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

    def __init__(self, branches: int = 4, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12, predictor=None):
        super().__init__(gamma, mode, draft_rank, timeout, max_gamma)
        if branches < 1:
            raise ValueError(f"branches: must be >= 1, got {branches}")
        self.branches = branches
        self._predictor = predictor
        self.learned = predictor is not None

    def bind(self, target, draft) -> None:
        if self._predictor is not None:
            self._predictor.bind(target)

    def hints(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[BranchHint]:
        if self._predictor is None:
            return super().hints(hidden, roots, greedy)
        return self._predictor.classify(hidden, roots, greedy)
