"""Adaptive verification (vLLM's confidence-scheduled verification, DSpark's D-Cut): each
round the target verifies, of every row's drafts, the prefix of its chain (the subtree of
its tree) worth its cost: what the batch's expected accepted tokens gain, less what the
same seconds give at the call's long-run rate.

Expected tokens come from the drafts' confidences (:attr:`Proposal.confidence`, the
drafter's probability of each draft given its prefix): a draft's chance of acceptance is
the rate the target has shown for drafts of the same confidence (per confidence bin, learned
as rounds run; apart for a draft right after the root and one after an accepted draft, as
acceptance is bursty), shrunk toward its depth class's pooled rate, which starts at an
optimistic prior (a fresh policy verifies as a fixed length does, and ranks by confidence as
the bins fill), and a draft's survival (the chance that it and every draft before it on its
path are accepted) is the product of those chances along its path. Round time is what this
device measured (:class:`StepCosts`: the low median of recent measurements per (rows,
width), shrunk toward the line through its neighbours), since the verification is one
forward of the padded batch. One budget over the batch: every row gets its best ``W`` drafts
(chains: its first ``W``; trees: the ``W`` with the highest survival, which hold their
parents, as a child never survives its parent), the same ``W`` for all since they pay for
the widest row anyway, and ``W`` maximises (sum over rows of 1 + their kept survivals) -
R x verify(rows, W + 1), R the call's long-run tokens per second so far (Dinkelbach's rule:
it maximises the call's tokens per second; before R is known, the round's own ratio).

Sequential drafters (a draft model, a head) spend a forward per draft step, so the same
estimates also bound the drafting: ``plan()`` gives the most steps worth drafting from the
acceptance at each depth (:meth:`Adaptive.depth_acceptance`; ``initial`` while the costs are
unknown), and ``keep_drafting`` stops the batch once no longer chain is expected to add more
than R x its further steps' seconds (a step's seconds: the low median of the recent steps) and their
verification.

The guide, with the cost model, each drafter, what ``Auto`` does for block drafters and a
runnable example: ``docs/adaptive.md``.
"""
from __future__ import annotations

import bisect
import dataclasses
import operator
import time
import weakref

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.models.cache import split_size
from spec_ext.policies.base import Policy, register
from spec_ext.policies.step_costs import SAMPLED_ROWS, SAMPLED_WIDEST, StepCosts, verification_costs
from spec_ext.policies.tree import DynamicTree, Tree

EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)  # upper edges of the confidence bins
CENTRES = tuple((lo + hi) / 2 for lo, hi in zip((0.0,) + EDGES, EDGES + (1.0,)))
# depth classes calibrated apart: a draft right after the root, and one after an accepted draft (acceptance is
# bursty: after an accepted draft the next is accepted more often than its confidence alone says)
DEPTHS = ("first", "later")


@register
class Adaptive(Policy):
    """Adaptive verification (see the module docstring) of chains up to ``max_draft`` drafts,
    or of the trees that ``tree`` (a :class:`Tree` or :class:`DynamicTree`) grows.

    The choice. Each round's trim (and, for sequential drafters, each decision to draft one
    more step) maximises the round's expected tokens minus ``R`` x its expected seconds, ``R``
    the long-run tokens per second the rounds have reached so far (an exponentially weighted
    ratio of the committed tokens to the rounds' seconds): a draft is worth verifying where
    what it adds beats what the same seconds give on average (Dinkelbach's rule, which
    maximises the whole call's tokens per second; maximising each round's own ratio instead
    asks a strong round's last draft to beat that round's high ratio, and verifies too few).
    Before ``R`` is known (a call's first round) each round's own ratio is maximised.

    The prior. A draft's chance of acceptance is its confidence bin's observed rate shrunk
    toward its depth class's pooled rate (``prior_weight`` observations of it), and that
    pooled rate starts at ``prior_acceptance`` (``prior_weight`` observations): a fresh
    policy treats every draft alike, as a fixed length does, and ranks drafts by
    confidence as the bins fill. The drafters' confidences are not acceptance rates (on the
    bundled pair drafts of confidence under 0.1 are accepted 30-50% of the time at T=0),
    so they order the bins and never set a bin's prior. Until the verification's cost has
    been measured, chains of a sequential drafter are ``initial`` drafts long.

    Exactness: greedy, any trim is exact. Sampling: a draft's inclusion must not depend on
    the draft itself (the rejection sampler assumes each verified draft was drawn from its
    q), so sampled chains are never trimmed after drafting: only ``keep_drafting`` stops
    them, which decides on draft n + 1 from drafts 1..n. Deterministic drafts (trees, any
    drafter's one-hot drafts) are trimmed at every temperature. When sampling, the rounds are
    not timed (the output then depends on the seed alone, not on how the machine's load split
    the random stream into rounds): the verification is priced by ``costs`` if it holds
    measurements (e.g. :func:`spec_ext.policies.step_costs.calibrate`; not updated), else by
    the target's verification timed once per process by width (:func:`verification_costs`,
    before the first sampled call's first round), and a draft forward at the drafter's share
    of the target's parameters of one target step (a block: one forward). On a CPU, where a
    verification of 16 tokens costs 2.5 steps, a flat cost drafted a block drafter's whole
    block at T=1 (0.73x the target alone against 1.52x for a block of 4).

    Args:
        max_draft: the most drafts per chain.
        tree: the tree shape to grow and trim (None: chains).
        costs: measured costs to start from (None: measured as rounds run); greedy rounds
            add to it.
        prior_weight: how many observations each prior is worth (a bin's pull toward its
            depth class's pooled rate, and the pooled rate's ``prior_acceptance``).
        prior_acceptance: the pooled chance of acceptance before any round, per depth class.
        initial: a sequential drafter's chain length until the verification's cost is known.
        forget: the weight old acceptance observations keep per round.
        explore: now and then verify a width next to the best, so that its cost stays measured
            (greedy rounds; off: always the best by the current estimates).
        clock: seconds since some origin (time.perf_counter; tests pass a fake one).

    Calibration: after each verification the confidence bins learn what the target made of
    every verified draft whose prefix was accepted (chains: drafts 1..a + 1; trees: the
    children of every node on the accepted path, which the engine hands over through
    :meth:`see_tree_path`), and a timed round's drafting and verification go into ``costs``.
    """

    uses_tree_paths = True  # the serial engine calls see_tree_path(path) after a tree round's verification
    RATE_FORGET = 0.8  # the weight the long-run rate's old rounds keep per round

    def __init__(self, max_draft: int = 10, tree: Tree | DynamicTree | None = None, costs: StepCosts | None = None,
                 prior_weight: float = 4.0, prior_acceptance: float = 0.8, initial: int = 4, forget: float = 0.99,
                 explore: bool = True, clock=time.perf_counter):
        if max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {max_draft}")
        if tree is not None and not isinstance(tree, (Tree, DynamicTree)):
            raise ValueError(f"tree: expected a Tree or a DynamicTree, got {tree!r}")
        if prior_weight <= 0 or not 0 < forget <= 1:
            raise ValueError(f"prior_weight, forget: need > 0 and in (0, 1], got {prior_weight}, {forget}")
        if not 0 < prior_acceptance < 1:
            raise ValueError(f"prior_acceptance: must be in (0, 1), got {prior_acceptance}")
        if initial < 1:
            raise ValueError(f"initial: must be >= 1, got {initial}")
        self.max_draft = max_draft
        self.tree = tree
        if isinstance(tree, Tree):
            self.branching, self.parents, self.levels = tree.branching, tree.parents, tree.levels
        elif isinstance(tree, DynamicTree):
            self.grows_dynamic_tree = True
            self.depth, self.top_k, self.nodes = tree.depth, tree.top_k, tree.nodes
        if tree is not None:
            self.max_draft = tree.max_draft
        self.costs = StepCosts() if costs is None else costs
        self._sampled: StepCosts | None = None  # what prices a sampled call's rounds (start; see the class)
        self.prior_weight, self.prior_acceptance, self.initial = prior_weight, prior_acceptance, initial
        self.forget, self.explore = forget, explore
        self._clock = clock
        # per depth class (0: a draft right after the root; 1: after an accepted draft) and confidence
        # bin: the drafts verified with every draft before them accepted, and of those the accepted
        # (observations only; the priors enter in _refresh)
        self._reached = [[0.0] * len(CENTRES) for _ in DEPTHS]
        self._passed = [[0.0] * len(CENTRES) for _ in DEPTHS]
        # the same drafts by depth (index d: depth d, 1 .. max_draft), for the chance at each depth
        self._depth_reached = [0.0] * (self.max_draft + 1)
        self._depth_passed = [0.0] * (self.max_draft + 1)
        self._depth_bins = [[0.0] * len(CENTRES) for _ in range(self.max_draft + 1)]  # reached, by depth and bin
        # the weight of the newest round's observations (1 / forget per round; the sums above are in its
        # units, so that forgetting touches no sum: a sum's decayed count is it over _unit)
        self._unit = 1.0
        self._refresh()
        self._size_ratio = 0.1
        self._step_seconds: dict[int, list[float]] = {}  # rows -> recent draft steps' seconds (low median: a step)

    # ------------------------------------------------------------------ protocol
    def bind(self, target, draft) -> None:
        size = sum(p.numel() for p in target.parameters())
        if size and draft is not None:
            self._size_ratio = max(0.02, sum(p.numel() for p in draft.parameters()) / size)
        self._per_forward = 1
        self._target = weakref.ref(target)

    def see_draft_shape(self, drafts_per_forward: int) -> None:
        self._per_forward = drafts_per_forward

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._timed = greedy
        target = getattr(self, "_target", lambda: None)()
        # (a tensor-parallel target's followers replay its forwards: nothing else may run one)
        self._sampled = None if greedy or self.costs.measured or target is None or split_size(target) > 1 else \
            verification_costs(target, batch_size, min(self._longest + 1, SAMPLED_WIDEST))
        self._sampled_rows = min(batch_size, SAMPLED_ROWS)  # the rows it timed
        self._round, self._mark, self._pending, self._tree_path = 0, self._clock(), None, None
        self._rate = [0.0, 0.0]  # weighted tokens, weighted seconds of this call's rounds (the first aside)
        self._bound = self._longest

    @property
    def _longest(self) -> int:
        """The longest chain: ``max_draft``, or a block drafter's block if shorter."""
        per_forward = getattr(self, "_per_forward", 1)
        return min(self.max_draft, per_forward) if per_forward > 1 else self.max_draft

    @property
    def rate(self) -> float | None:
        """R: the long-run tokens per second (untimed: per second as priced, or per target
        forward without a target to time) of this call's rounds so far, the first (which holds
        the prefill) aside; None before one was seen."""
        tokens, seconds = self._rate
        return tokens / seconds if seconds > 0 else None

    def acceptance(self, confidence: float, depth: int = 1) -> float:
        """The estimated chance that a draft of this confidence at this depth (1: right after
        the root) is accepted once the drafts before it were: its bin's observed rate at that
        depth class, shrunk toward the class's pooled rate (see the class docstring), past
        depth 1 scaled by how the depth's drafts fared against what their bins predicted
        (accepted over the sum of their bins' rates, ``prior_weight`` observations of 1), so
        that the trims price a block drafter's weaker later slots as ``plan`` does, without
        counting their lower confidences twice; at most 1."""
        depth = min(max(depth, 1), len(self._depth_scale) - 1)
        rate = self._table[min(depth, len(DEPTHS)) - 1][bisect.bisect_left(EDGES, confidence)]
        return min(1.0, rate * self._depth_scale[depth])

    def _refresh(self) -> None:
        """The acceptance table, the pooled rates and the rates by depth from the observations
        and the priors."""
        w = self.prior_weight * self._unit  # the priors in the sums' units
        self._pooled = [(sum(p) + w * self.prior_acceptance) / (sum(r) + w)
                        for r, p in zip(self._reached, self._passed)]
        self._table = [[(p + w * m) / (r + w) for r, p in zip(reached, passed)]
                       for reached, passed, m in zip(self._reached, self._passed, self._pooled)]
        self._by_depth = [self._pooled[0]] * 2 + [(p + w * self._pooled[1]) / (r + w) for r, p in
                                                  zip(self._depth_reached[2:], self._depth_passed[2:])]
        shrink = w * self._pooled[1]
        predicted = [sum(map(operator.mul, bins, self._table[1])) for bins in self._depth_bins[2:]]
        self._depth_scale = [1.0, 1.0] + [(p + shrink) / (e + shrink) for p, e in
                                          zip(self._depth_passed[2:], predicted)]

    def depth_acceptance(self, depth: int) -> float:
        """The estimated chance that a draft at ``depth`` (1: right after the root) is accepted
        once the drafts before it were, whatever its confidence: the first depth class's pooled
        rate at depth 1; past it, that depth's observed rate shrunk toward the later class's
        pooled rate. A block drafter's slots are drawn apart, so its later slots are accepted
        less often than its second (the bundled DFlash drafter: 0.61 at depth 2, 0.43 at 3), which
        one rate for every later depth prices alike."""
        return self._by_depth[min(max(depth, 1), len(self._by_depth) - 1)]

    def _pricing(self) -> StepCosts:
        """What prices the rounds: ``costs`` (timed, or holding measurements), else a sampled
        call's :func:`verification_costs` (unmeasured where no target was bound)."""
        return self.costs if self._timed or self.costs.measured or self._sampled is None else self._sampled

    def verify_cost(self, rows: int, width: int) -> float | None:
        """Seconds of verifying ``rows`` x ``width`` tokens (untimed: as priced, see the class;
        without a target to time, one target forward whatever the width)."""
        costs = self._pricing()
        if costs is self._sampled:  # the shapes timed (rows finishing read the call's first)
            return costs.verify(self._sampled_rows, width)
        if costs.measured:
            return costs.verify(rows, width)
        return None if self._timed else 1.0

    def draft_cost(self, steps: int) -> float | None:
        """Seconds of drafting ``steps`` drafts (untimed, unless measured costs were given: the
        draft forwards priced at the drafter's share of the target's parameters of a target
        step; a block is one forward)."""
        sequential = getattr(self, "_per_forward", 1) == 1
        seconds = self._pricing().draft(steps, sequential=sequential)
        if seconds is not None or self._timed:
            return seconds
        forwards = steps if sequential else 1
        return forwards * self._size_ratio * (self.verify_cost(self.batch_size, 1) or 1.0)

    def plan(self) -> list[int]:
        self._bound = self._draft_bound()
        return [self._bound] * self.batch_size

    def _draft_bound(self) -> int:
        """The chain length worth drafting from the acceptance at each depth
        (:meth:`depth_acceptance`; with ``explore``, one more every fourth timed round, to keep
        the next depth measured: a standing margin of two drafted 25-65% more steps than
        Fixed(2) at B=1 for no more accepted; ``keep_drafting`` stops sooner where the drafts
        are weak; ``initial`` while the costs are unknown). A block drafter computes the slots
        it is asked for, one forward whose cost grows a little with them (timed: measured by length; untimed: one forward
        whatever the length, so the whole block). The estimate is refreshed by every
        verification, so a length once judged too long is drafted again when acceptance rises."""
        B, best, best_value, tokens = self.batch_size, None, None, float(self.batch_size)
        R, alive = self.rate, self.depth_acceptance(1)
        for k in range(1, self._longest + 1):
            tokens += B * alive
            alive *= self.depth_acceptance(k + 1)
            cost = [self.draft_cost(k), self.verify_cost(B, k + 1)]
            if None in cost:
                return min(self.initial, self._longest)
            value = tokens - R * sum(cost) if R is not None else tokens / max(sum(cost), 1e-12)
            if best_value is None or value > best_value:
                best, best_value = k, value
        measures_next = self._timed and self.explore and self._round % 4 == 3
        return min(self._longest, best + measures_next)

    def keep_drafting(self, step: int, probs: Tensor, tokens: Tensor, hidden: Tensor | None = None) -> Tensor:
        """Go on while some longer chain is expected to pay for its steps and their
        verification: the batch's survivals after ``step`` drafts, the next drafts' chance of
        acceptance taken as their depths' (:meth:`depth_acceptance`), the verification's
        measured costs and a draft step's (timed: the low median of the recent steps, kept
        across rounds; with ``explore`` every eighth round drafts a second step, so that a
        stale high estimate cannot stop every chain at its first draft for good). One host
        sync per draft step (the drafts' confidences)."""
        confidence = probs.gather(1, tokens[:, None]).squeeze(1).tolist()
        chances = [self.acceptance(c, step) for c in confidence]
        if step == 1:  # a new chain: its first draft came from the catch-up, the next ones cost a step each
            self._alive, self._gained = chances, 0.0
        else:
            self._alive = [a * c for a, c in zip(self._alive, chances)]
        alive = sum(self._alive)
        self._gained += alive
        B = len(confidence)
        go = torch.ones(B, dtype=torch.bool, device=tokens.device)
        if self._timed:  # this round so far (the catch-up included), and a draft step: what the last ones took
            now_s = self._clock()
            drafted = now_s - self._mark
            recent = self._step_seconds.setdefault(B, [])
            if step > 1:
                recent.append(now_s - self._last_step)
                del recent[:-9]
            self._last_step = now_s
            if recent:
                per_step = sorted(recent)[(len(recent) - 1) // 2]
            else:
                fitted = [self.draft_cost(step), self.draft_cost(step + 1)]
                per_step = None if None in fitted else max(0.0, fitted[1] - fitted[0])
            if step == 1 and self.explore and self._round % 8 == 7:  # now and then a second step, measured
                return go
        else:
            drafted = self.draft_cost(step)
            per_step = self.draft_cost(step + 1) - drafted
        now = self.verify_cost(B, step + 1)
        if now is None or per_step is None:
            return go
        R = self.rate
        base = B + self._gained
        rate_now = base / max(drafted + now, 1e-12)
        gain = 0.0
        for m in range(1, max(self._bound, step) - step + 1):
            alive *= self.depth_acceptance(step + m)  # a further draft: its depth's chance, whatever its confidence
            gain += alive
            cost = self.verify_cost(B, step + m + 1)
            if cost is None:
                continue
            if R is not None:  # Dinkelbach: what the further drafts add beats what their seconds give on average
                if gain - R * (m * per_step + cost - now) > 0:
                    return go
            elif (base + gain) / max(drafted + m * per_step + cost, 1e-12) > rate_now:
                return go
        return ~go

    def select(self, proposal):
        """The proposal trimmed to each row's expected-best prefix (subtree); see the class
        docstring for when it is left whole. One host sync (the confidences)."""
        now = self._clock()
        self._round += 1
        B, tree = proposal.tokens.shape[0], proposal.is_tree
        width = proposal.tokens.shape[1] + (0 if tree else 1)  # verified tokens per row, the root included
        steps = proposal.max_depth if tree else proposal.tokens.shape[1]
        if getattr(self, "_per_forward", 1) > 1:  # a block: the slots its forward computed, however many kept
            steps = self._longest if tree else self._bound
        drafted = now - self._mark if self._timed else self.draft_cost(steps)
        if self._timed and self._round > 1:  # the first round's time holds the prefill
            self.costs.record_draft(steps, drafted)
        self._pending = (B, width, None, now, drafted)
        if proposal.confidence is None or proposal.explores:
            return proposal
        if tree:
            return self._select_tree(proposal, drafted, now) if proposal.q is None else proposal
        return self._select_chain(proposal, drafted, now)

    def see_tree_path(self, path: Tensor) -> None:
        """(The serial engine, after a tree round's verification, before :meth:`observe`.)
        ``path`` [B,D+1]: each row's accepted node ids from the root (0), in the verified
        tree's numbering; the first ``num_accepted[b]`` after the root are read."""
        self._tree_path = path

    def observe(self, num_draft, num_accepted) -> None:
        now = self._clock()
        path, self._tree_path = self._tree_path, None
        if self._pending is not None:
            B, width, verified, started, drafted = self._pending
            if self._timed:
                self.costs.record_verify(B, width, now - started)
                seconds = now - self._mark
            else:
                seconds = (drafted or 0.0) + (self.verify_cost(B, width) or 0.0)
            if self._round > 1:  # the long-run rate: the first round holds the prefill
                keep = self.RATE_FORGET
                self._rate = [keep * self._rate[0] + sum(a + 1 for a in num_accepted),
                              keep * self._rate[1] + seconds]
            if isinstance(verified, _VerifiedTree):  # the tree's reached nodes (None: no path handed over)
                events = None if path is None else verified.reached(path.tolist(), num_accepted)
            elif verified is not None:  # a chain: drafts 0..a-1 passed, draft a (if verified) failed
                events = [[(confidences[j], j + 1, j < a) for j in range(min(a + 1, n))]
                          for confidences, n, a in zip(verified, num_draft, num_accepted)]
            else:
                events = None
            if events is not None:  # what the target made of each reached draft's confidence
                if self.forget < 1:  # older observations weigh forget x less than this round's
                    self._unit /= self.forget
                    if self._unit > 1e100:
                        self._rescale()
                unit = self._unit
                for row in events:
                    for confidence, depth, passed in row:
                        d, i = min(depth, len(DEPTHS)) - 1, bisect.bisect_left(EDGES, confidence)
                        self._reached[d][i] += unit
                        self._passed[d][i] += unit * passed
                        at = min(depth, self.max_draft)
                        self._depth_reached[at] += unit
                        self._depth_passed[at] += unit * passed
                        self._depth_bins[at][i] += unit
                self._refresh()
        self._pending, self._mark = None, now

    def _rescale(self) -> None:
        """The sums back in units of one observation (:attr:`_unit` 1)."""
        u = self._unit
        self._reached = [[x / u for x in row] for row in self._reached]
        self._passed = [[x / u for x in row] for row in self._passed]
        self._depth_reached = [x / u for x in self._depth_reached]
        self._depth_passed = [x / u for x in self._depth_passed]
        self._depth_bins = [[x / u for x in row] for row in self._depth_bins]
        self._unit = 1.0

    # ------------------------------------------------------------------ choosing
    def best_width(self, survival: list[list[float]], drafted: float) -> int | None:
        """The number of drafts per row W (0: the roots alone) that maximises the batch's
        expected tokens, sum over rows of 1 + the sum of its first W ``survival`` values (each
        row's, best first), less R x verify(rows, W + 1) (:attr:`rate`; before it is known:
        the expected tokens per second of ``drafted`` + verify(rows, W + 1)); None while the
        verification's cost is unknown."""
        B, K = len(survival), max(map(len, survival), default=0)
        best, best_value, tokens, R = None, None, float(B), self.rate
        for W in range(K + 1):
            if W:
                tokens += sum(s[W - 1] for s in survival if len(s) >= W)
            cost = self.verify_cost(B, W + 1)
            if cost is None:
                return None
            value = tokens - R * cost if R is not None else tokens / max(drafted + cost, 1e-12)
            if best_value is None or value > best_value + 1e-12 * abs(value):
                best, best_value = W, value
        return best

    def _explored(self, W: int | None, K: int) -> int:
        """The width chosen, or a neighbour now and then so the costs of both stay measured:
        while fewer than 3 widths are measured the rounds verify K, K - 1, K - 2 in turn (not
        again at each call of a policy kept across calls); then every fourth round one more,
        every fourth one fewer (untimed or not ``explore``: the width chosen)."""
        if not self._timed or not self.explore:
            return K if W is None else W
        if W is None or self.costs.measured < 3:
            return max(0, K - (self._round - 1) % 3)
        return min(K, max(0, W + {1: 1, 3: -1}.get(self._round % 4, 0)))

    def _select_chain(self, proposal, drafted: float, now: float):
        confidence = proposal.confidence
        host = torch.cat([proposal.num_draft[:, None].to(confidence.dtype), confidence], 1).tolist()
        counts = [int(row[0]) for row in host]
        survival = []
        for row, n in zip(host, counts):
            alive, chain = 1.0, []
            for depth, c in enumerate(row[1:n + 1], 1):
                alive *= self.acceptance(c, depth)
                chain.append(alive)
            survival.append(chain)
        K = proposal.tokens.shape[1]
        # sampled drafts (q) are verified whole: only deterministic ones may be cut by what they are
        W = K if proposal.q is not None else self._explored(self.best_width(survival, drafted), K)
        kept = [min(W, n) for n in counts]
        W = max(kept, default=0)
        self._pending = (len(counts), W + 1, [row[1:k + 1] for row, k in zip(host, kept)], now, drafted)
        return proposal if W == K and kept == counts else trim_chain(proposal, kept)

    def _select_tree(self, proposal, drafted: float, now: float):
        B, T = proposal.tokens.shape
        parents = proposal.parents.expand(B, T)
        host = torch.stack([proposal.confidence.float(), parents.float(), (proposal.tokens >= 0).float()], 1).tolist()
        order, survival = [], []
        for confidences, row_parents, present in host:
            alive, depth = [1.0] + [0.0] * (T - 1), [0] * T
            for i in range(1, T):
                if present[i]:
                    depth[i] = depth[int(row_parents[i])] + 1
                    alive[i] = alive[int(row_parents[i])] * self.acceptance(confidences[i], depth[i])
            nodes = sorted((i for i in range(1, T) if present[i] and alive[i] > 0), key=lambda i: (-alive[i], i))
            order.append(nodes)
            survival.append([alive[i] for i in nodes])
        W = self._explored(self.best_width(survival, drafted), T - 1)
        kept = [sorted(nodes[:W]) for nodes in order]
        every = [[i for i in range(1, T) if present[i]] for _, _, present in host]
        untrimmed = kept == every
        index = [[0] + (list(range(1, T)) if untrimmed else nodes) for nodes in kept]
        verified = _VerifiedTree(index, [[c for c in row[0]] for row in host],
                                 [[int(p) for p in row[1]] for row in host], every if untrimmed else kept)
        if untrimmed:
            self._pending = (B, T, verified, now, drafted)
            return proposal
        self._pending = (B, 1 + max(map(len, kept)), verified, now, drafted)
        return trim_tree(proposal, kept, verified.parents)


@dataclasses.dataclass
class _VerifiedTree:
    """What :meth:`Adaptive.observe` needs of a verified tree, on the host, per row:
    ``index[j]`` the proposal's node id of verified node j (0: the root; ids past a row's
    nodes, padding, are not read), the proposal's ``confidence`` and ``parents`` by its node
    ids, and ``nodes`` the ids verified (below the root)."""
    index: list[list[int]]
    confidence: list[list[float]]
    parents: list[list[int]]
    nodes: list[list[int]]

    def reached(self, path: list[list[int]], num_accepted) -> list[list[tuple[float, int, bool]]]:
        """Per row, (confidence, depth, accepted) of every verified node the target reached: the
        children of the root and of each accepted node (``path[b][1:a + 1]``, ids of the
        verified tree): the path's nodes were accepted, their siblings and the last accepted
        node's children were not."""
        out = []
        for index, confidence, parents, nodes, row_path, a in zip(self.index, self.confidence, self.parents,
                                                                   self.nodes, path, num_accepted):
            accepted = [index[j] for j in row_path[1:a + 1]]  # the proposal's ids
            on_path = set(accepted) | {0}
            depth = {0: 0}
            for i in sorted(nodes):  # parents before children
                depth[i] = depth[parents[i]] + 1
            out.append([(confidence[i], depth[i], i in on_path) for i in nodes if parents[i] in on_path])
        return out


def trim_chain(proposal, kept: list[int]):
    """``proposal`` (a chain) verifying the first ``kept[b]`` drafts of each row b (at most
    its own): tokens past them -1, the width cut to the longest, q and confidence cut alike."""
    device = proposal.tokens.device
    W = max(kept, default=0)
    counts = torch.tensor(kept, device=device)
    tokens, confidence = proposal.tokens[:, :W], proposal.confidence
    confidence = None if confidence is None else confidence[:, :W]
    if min(kept, default=W) < W:  # rows cut shorter than the widest
        cut = torch.arange(W, device=device) >= counts[:, None]
        tokens = tokens.masked_fill(cut, -1)
        confidence = None if confidence is None else confidence.masked_fill(cut, 0.0)
    return dataclasses.replace(proposal, tokens=tokens, num_draft=counts,
                               q=None if proposal.q is None else proposal.q[:, :W], confidence=confidence)


def trim_tree(proposal, kept: list[list[int]], parents: list[list[int]]):
    """``proposal`` (a tree) verifying of each row b its root and the nodes ``kept[b]``
    (ascending node ids, each node's parent kept or the root; ``parents[b]`` the row's
    parents on the host), renumbered in their order; rows with fewer nodes than the widest
    are padded with absent nodes (-1) under the root."""
    device = proposal.tokens.device
    B, T = len(kept), 1 + max(map(len, kept), default=0)
    index, new_parents, depths = [], [], []
    for nodes, row_parents in zip(kept, parents):
        renumber = {0: 0}
        row_index, row_new, row_depth = [0], [-1], [0]
        for i in nodes:
            renumber[i] = len(row_index)
            row_index.append(i)
            row_new.append(renumber[row_parents[i]])
            row_depth.append(row_depth[row_new[-1]] + 1)
        pad = T - len(row_index)
        index.append(row_index + [0] * pad)
        new_parents.append(row_new + [0] * pad)
        depths.append(max(row_depth))
    index_t = torch.tensor(index, device=device)
    present = torch.tensor([[True] * (1 + len(n)) + [False] * (T - 1 - len(n)) for n in kept], device=device)
    parents_t = torch.tensor(new_parents, device=device)
    depth, mask = ops.tree_mask(parents_t, validate=False)
    q = proposal.q
    if q is not None:
        q = q.gather(1, index_t[..., None].expand(-1, -1, q.shape[-1]))
    confidence = proposal.confidence
    if confidence is not None:
        confidence = confidence.gather(1, index_t).masked_fill(~present, 0.0)
    return dataclasses.replace(
        proposal, tokens=proposal.tokens.gather(1, index_t).masked_fill(~present, -1),
        num_draft=torch.tensor([len(n) for n in kept], device=device), q=q, parents=parents_t, depth=depth,
        mask=mask, max_depth=max(depths), confidence=confidence)
