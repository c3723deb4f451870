"""Adaptive verification (vLLM's confidence-scheduled verification, DSpark's D-Cut): each
round the target verifies, of every row's drafts, the prefix of its chain (the subtree of its
tree) worth its cost. A draft's survival (the chance that it and every draft before it on its
path are accepted) is the product of its path's acceptance chances by confidence and depth
(:class:`~spec_ext.policies.estimates.Acceptance`); one budget over the batch: every row keeps
its best ``W`` drafts, ``W`` maximising (sum over rows of 1 + their kept survivals) - R x
verify(rows, W + 1), R the call's long-run tokens per second (Dinkelbach's rule: it maximises
the call's tokens per second), the verification's cost as measured
(:class:`~spec_ext.policies.estimates.Costs`). Sequential drafters also stop drafting where no
longer chain is expected to pay for its steps. The guide, with the cost model and a runnable
example: ``docs/adaptive.md``.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.policies.base import Call, Controller, Policy, Report, RoundPlan, RoundState, check, node_depths, \
    register, renumbered
from spec_ext.policies.estimates import Acceptance, Costs, call_pricing
from spec_ext.policies.tree import DynamicTree, Tree


@register
@dataclass(frozen=True)
class Adaptive(Policy):
    """Adaptive verification (see the module docstring) of chains up to ``max_draft`` drafts,
    or of the trees that ``tree`` (a :class:`Tree` or :class:`DynamicTree`) grows.

    Each round's trim (and a sequential drafter's choice to draft one more step) follows
    Dinkelbach's rule against the call's long-run tokens per second ``R`` (before ``R`` is
    known, the round's own ratio); a draft's chance is its confidence bin's rate shrunk toward
    its depth class's pooled rate, which starts at ``prior_acceptance`` (``docs/adaptive.md``).

    Exactness: greedy, any trim is exact. Sampling: a draft's inclusion must not depend on
    the draft itself (the rejection sampler assumes each verified draft was drawn from its
    q), so sampled chains are never trimmed after drafting: only ``keep_drafting`` stops
    them, which decides on draft n + 1 from drafts 1..n. Deterministic drafts (trees, any
    drafter's one-hot drafts) are trimmed at every temperature. When sampling, the rounds are
    not timed (the output then depends on the seed alone): they are priced by ``costs`` if it
    holds measurements (:func:`spec_ext.policies.estimates.calibrate`), else by the engine's
    rounds timed once per process (:func:`~spec_ext.policies.estimates.round_costs`).

    Across calls (``accelerate`` keeps a memory): greedy calls start from the costs, the
    acceptance and the draft steps' seconds the earlier greedy calls measured.

    Args:
        max_draft: the most drafts per chain.
        tree: the tree shape to grow and trim (None: chains).
        costs: measured costs to start from (copied: the policy stays a value).
        prior_weight: how many observations each prior is worth.
        prior_acceptance: the pooled chance of acceptance before any round.
        initial: a sequential drafter's chain length until the verification's cost is known.
        forget: the weight old acceptance observations keep per round.
        explore: now and then verify a width next to the best, so that its cost stays measured
            (greedy rounds; off: always the best by the current estimates).
        clock: seconds since some origin, read while drafting (tests pass a fake one).
    """
    RATE_FORGET = 0.8  # the weight the long-run rate's old rounds keep per round
    max_draft: int = 10
    tree: Tree | DynamicTree | None = None
    costs: Costs | None = dataclasses.field(default=None, compare=False)
    prior_weight: float = 4.0
    prior_acceptance: float = 0.8
    initial: int = 4
    forget: float = 0.99
    explore: bool = True
    clock: object = dataclasses.field(default=time.perf_counter, repr=False, compare=False)

    def __post_init__(self):
        check(self.max_draft >= 1, "max_draft", f"must be >= 1, got {self.max_draft}")
        check(self.tree is None or isinstance(self.tree, (Tree, DynamicTree)), "tree",
              f"expected a Tree or a DynamicTree, got {self.tree!r}")
        check(self.prior_weight > 0 and 0 < self.forget <= 1, "prior_weight, forget",
              f"need > 0 and in (0, 1], got {self.prior_weight}, {self.forget}")
        check(0 < self.prior_acceptance < 1, "prior_acceptance", f"must be in (0, 1), got {self.prior_acceptance}")
        check(self.initial >= 1, "initial", f"must be >= 1, got {self.initial}")

    def tree_shape(self):
        return None if self.tree is None else self.tree.tree_shape()

    def fitted(self, max_depth: int | None, chain: int | None, drafter: str = "the drafter") -> Policy:
        if self.tree is None:
            return self
        return dataclasses.replace(self, tree=self.tree.fitted(max_depth, chain, drafter))

    @property
    def depth_limit(self) -> int:
        """The most drafts in a line (a chain's length, a tree's depth)."""
        return self.max_draft if self.tree is None else self.tree_shape().max_depth

    @property
    def lookahead(self) -> int:
        return self.max_draft if self.tree is None else self.tree_shape().room

    def start(self, call: Call) -> Controller:
        return AdaptiveController(self, call)


@dataclass
class _Round:
    """One round of :class:`AdaptiveController`: when it began, its drafting so far (the
    chances of the rows' chains alive, the tokens they add, the last step's clock), and what
    the selection verified (rows, width, the verified drafts' confidences, the drafting's
    seconds)."""
    started: float
    bound: int
    alive: list = dataclasses.field(default_factory=list)
    gained: float = 0.0
    last_step: float = 0.0
    rows: int = 0
    width: int = 0
    verified: object = None
    drafted: float | None = None


class AdaptiveController(Controller):
    def __init__(self, policy: Adaptive, call: Call):
        super().__init__(policy, call)
        self.costs, self.accept = self.recall(
            costs=lambda: copy.deepcopy(policy.costs) if policy.costs is not None else Costs(),
            acceptance=lambda: Acceptance(max(policy.max_draft, policy.depth_limit), policy.prior_acceptance,
                                          policy.prior_weight, policy.forget, bins=True))
        self.per_forward = call.drafts_per_forward
        self.longest = min(policy.depth_limit, self.per_forward) if self.per_forward > 1 else policy.depth_limit
        self.pricing = call_pricing(call, self.costs, self.longest, self.per_forward)
        self.round = 0
        self.rate_sums = [0.0, 0.0]  # weighted tokens, weighted seconds of this call's rounds (the first aside)

    # ------------------------------------------------------------------ estimates
    @property
    def rate(self) -> float | None:
        """R: the long-run tokens per second (untimed: per second as priced) of this call's
        rounds so far, the first (which holds the drafter's catch-up over the prompt) aside;
        None before one was seen."""
        tokens, seconds = self.rate_sums
        return tokens / seconds if seconds > 0 else None

    def verify_cost(self, rows: int, width: int) -> float | None:
        return self.pricing.verify(rows, width)

    # ------------------------------------------------------------------ the round
    def plan(self, state: RoundState) -> RoundPlan:
        self.round += 1
        bound = self._draft_bound(state.rows)
        record = _Round(self.policy.clock(), bound)
        tree = self.policy.tree_shape()
        stop = None if tree is not None else lambda *step: self._keep_drafting(record, *step)
        return RoundPlan([bound] * state.rows, tree=tree, stop=stop, trim=lambda p: self._select(record, p),
                         record=record)

    def _draft_bound(self, B: int) -> int:
        """The chain length worth drafting from the acceptance at each depth (with ``explore``,
        one more every fourth timed round, to keep the next depth measured; ``keep_drafting``
        stops sooner where the drafts are weak; ``initial`` while the costs are unknown). A
        block drafter computes the slots it is asked for, one forward whose cost grows a little
        with them."""
        best, best_value, tokens = None, None, float(B)
        R, alive = self.rate, self.accept.chance(1)
        for k in range(1, self.longest + 1):
            tokens += B * alive
            alive *= self.accept.chance(k + 1)
            cost = [self.pricing.draft(k, self.rows), self.verify_cost(B, k + 1)]
            if None in cost:
                return min(self.policy.initial, self.longest)
            value = tokens - R * sum(cost) if R is not None else tokens / max(sum(cost), 1e-12)
            if best_value is None or value > best_value:
                best, best_value = k, value
        measures_next = self.pricing.timed and self.policy.explore and (self.round - 1) % 4 == 3
        return min(self.longest, best + measures_next)

    def _keep_drafting(self, record: _Round, step: int, probs: Tensor, tokens: Tensor, hidden=None) -> Tensor:
        """Go on while some longer chain is expected to pay for its steps and their
        verification: the batch's survivals after ``step`` drafts, the next drafts' chance of
        acceptance taken as their depths', the verification's measured costs and a draft
        step's (timed: the low median of the recent steps; with ``explore`` every eighth round
        drafts a second step, so that a stale high estimate cannot stop every chain at its first
        draft for good). One host sync per draft step (the drafts' confidences)."""
        confidence = probs.gather(1, tokens[:, None]).squeeze(1).tolist()
        chances = [self.accept.acceptance(c, step) for c in confidence]
        record.alive = chances if step == 1 else [a * c for a, c in zip(record.alive, chances)]
        alive = sum(record.alive)
        record.gained = (0.0 if step == 1 else record.gained) + alive
        B = len(confidence)
        go = torch.ones(B, dtype=torch.bool, device=tokens.device)
        if self.pricing.timed:
            now_s = self.policy.clock()
            drafted = now_s - record.started
            if step > 1:
                self.costs.record_step(B, now_s - record.last_step)
            record.last_step = now_s
            per_step = self.costs.step(B)
            if per_step is None:
                fitted = [self.pricing.draft(step, self.rows), self.pricing.draft(step + 1, self.rows)]
                per_step = None if None in fitted else max(0.0, fitted[1] - fitted[0])
            if step == 1 and self.policy.explore and (self.round - 1) % 8 == 7:  # now and then a second step, measured
                return go
        else:
            drafted = self.pricing.draft(step, self.rows)
            per_step = self.pricing.draft(step + 1, self.rows) - drafted
        now = self.verify_cost(B, step + 1)
        if now is None or per_step is None:
            return go
        R = self.rate
        base = B + record.gained
        rate_now = base / max(drafted + now, 1e-12)
        gain = 0.0
        for m in range(1, max(record.bound, step) - step + 1):
            alive *= self.accept.chance(step + m)  # a further draft: its depth's chance, whatever its confidence
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

    def _select(self, record: _Round, proposal):
        """The proposal trimmed to each row's expected-best prefix (subtree); see the class
        docstring for when it is left whole. One host sync (the confidences)."""
        now = self.policy.clock()
        B, tree = proposal.tokens.shape[0], proposal.is_tree
        width = proposal.tokens.shape[1] + (0 if tree else 1)  # verified tokens per row, the root included
        record.rows, record.width = B, width
        record.drafted = now - record.started if self.pricing.timed else \
            self.pricing.draft(proposal.max_depth if tree else proposal.tokens.shape[1], self.rows)
        if proposal.confidence is None or proposal.explores:
            return proposal
        if tree:
            return self._select_tree(record, proposal) if proposal.q is None else proposal
        return self._select_chain(record, proposal)

    def observe(self, report: Report) -> None:
        record: _Round = report.plan.record
        if report.explores or record is None:
            return
        if self.pricing.timed and report.timed:
            self.costs.record_verify(record.rows, record.width, report.verify_seconds)
            if report.warm and report.draft_forwards:
                self.costs.record_draft(report.draft_steps, report.seconds - report.verify_seconds,
                                        record.rows)
            seconds = report.seconds
        else:
            seconds = (record.drafted or 0.0) + (self.verify_cost(record.rows, record.width) or 0.0)
        if self.round > 1:  # the long-run rate: the first round holds the drafter's catch-up over the prompt
            keep = self.policy.RATE_FORGET
            self.rate_sums = [keep * self.rate_sums[0] + sum(a + 1 for a in report.accepted),
                              keep * self.rate_sums[1] + seconds]
        verified = record.verified
        if isinstance(verified, _VerifiedTree):  # the tree's reached nodes (None: no path handed over)
            events = None if report.path is None else verified.reached(report.path.tolist(), report.accepted)
        elif verified is not None:  # a chain: drafts 0..a-1 passed, draft a (if verified) failed
            events = [[(confidences[j], j + 1, j < a) for j in range(min(a + 1, n))]
                      for confidences, n, a in zip(verified, report.drafted, report.accepted)]
        else:
            events = None
        if events is not None:  # what the target made of each reached draft's confidence
            self.accept.new_round()
            for row in events:
                for confidence, depth, passed in row:
                    self.accept.add(depth, passed, confidence)

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
        while fewer than 3 widths are measured the rounds verify K, K - 1, K - 2 in turn; then
        every fourth round one more, every fourth one fewer (untimed or not ``explore``: the
        width chosen)."""
        if not self.pricing.timed or not self.policy.explore:
            return K if W is None else W
        if W is None or self.costs.measured < 3:
            return max(0, K - (self.round - 1) % 3)
        return min(K, max(0, W + {1: 1, 3: -1}.get(self.round % 4, 0)))

    def _select_chain(self, record: _Round, proposal):
        confidence = proposal.confidence
        host = torch.cat([proposal.num_draft[:, None].to(confidence.dtype), confidence], 1).tolist()
        counts = [int(row[0]) for row in host]
        survival = []
        for row, n in zip(host, counts):
            alive, chain = 1.0, []
            for depth, c in enumerate(row[1:n + 1], 1):
                alive *= self.accept.acceptance(c, depth)
                chain.append(alive)
            survival.append(chain)
        K = proposal.tokens.shape[1]
        # sampled drafts (q) are verified whole: only deterministic ones may be cut by what they are
        W = K if proposal.q is not None else self._explored(self.best_width(survival, record.drafted), K)
        kept = [min(W, n) for n in counts]
        W = max(kept, default=0)
        record.width, record.verified = W + 1, [row[1:k + 1] for row, k in zip(host, kept)]
        return proposal if W == K and kept == counts else trim_chain(proposal, kept)

    def _select_tree(self, record: _Round, proposal):
        B, T = proposal.tokens.shape
        parents = proposal.parents.expand(B, T)
        host = torch.stack([proposal.confidence.float(), parents.float(), (proposal.tokens >= 0).float()], 1).tolist()
        order, survival = [], []
        for confidences, row_parents, present in host:
            alive, depth = [1.0] + [0.0] * (T - 1), [0] * T
            for i in range(1, T):
                if present[i]:
                    depth[i] = depth[int(row_parents[i])] + 1
                    alive[i] = alive[int(row_parents[i])] * self.accept.acceptance(confidences[i], depth[i])
            nodes = sorted((i for i in range(1, T) if present[i] and alive[i] > 0), key=lambda i: (-alive[i], i))
            order.append(nodes)
            survival.append([alive[i] for i in nodes])
        W = self._explored(self.best_width(survival, record.drafted), T - 1)
        kept = [sorted(nodes[:W]) for nodes in order]
        every = [[i for i in range(1, T) if present[i]] for _, _, present in host]
        untrimmed = kept == every
        index = [[0] + (list(range(1, T)) if untrimmed else nodes) for nodes in kept]
        verified = _VerifiedTree(index, [list(row[0]) for row in host], [[int(p) for p in row[1]] for row in host],
                                 every if untrimmed else kept)
        record.verified = verified
        if untrimmed:
            return proposal
        record.width = 1 + max(map(len, kept))
        return trim_tree(proposal, kept, verified.parents)


@dataclass
class _VerifiedTree:
    """What :meth:`AdaptiveController.observe` needs of a verified tree, on the host, per row:
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
            depth = node_depths(parents)
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
    T = 1 + max(map(len, kept), default=0)
    index, new_parents, depths = [], [], []
    for nodes, row_parents in zip(kept, parents):
        row_index, row_new = [0] + list(nodes), renumbered(row_parents, nodes)
        pad = T - len(row_index)
        index.append(row_index + [0] * pad)
        new_parents.append(row_new + [0] * pad)
        depths.append(max(node_depths(row_new)))
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
