"""Draft trees: a static shape grown by top-k (:class:`Tree`) and EAGLE-2's dynamic tree
(:class:`DynamicTree`); the target verifies either in one pass."""
from __future__ import annotations

from dataclasses import dataclass

from spec_ext.policies.base import Call, Controller, Policy, RoundPlan, RoundState, TreeShape, check, register


class _Growing(Controller):
    """Every round the model grows the policy's tree for every row."""

    def plan(self, state: RoundState) -> RoundPlan:
        return RoundPlan([0] * state.rows, tree=self.policy.tree_shape())


@register
@dataclass(frozen=True)
class Tree(Policy):
    """A static draft tree expanded by top-k of the draft: ``branching[d]`` children for
    every node at depth d. Verified in one target pass with tree attention and (when
    sampling) recursive rejection sampling with deterministic drafts."""
    branching: tuple[int, ...] = (3, 2, 1, 1)

    def __post_init__(self):
        check(isinstance(self.branching, (tuple, list)) and len(self.branching) > 0
              and all(isinstance(b, int) and b >= 1 for b in self.branching), "branching",
              f"need one or more positive counts, got {self.branching!r}")
        object.__setattr__(self, "branching", tuple(self.branching))

    def tree_shape(self) -> TreeShape:
        return TreeShape(branching=self.branching)

    @property
    def max_draft(self) -> int:
        return self.tree_shape().room

    def start(self, call: Call) -> Controller:
        return _Growing(self, call)


@register
@dataclass(frozen=True)
class DynamicTree(Policy):
    """EAGLE-2's dynamic draft tree, grown by draft models and feature heads: from the root,
    every node on the frontier proposes its ``top_k`` most likely tokens, each scored by its
    cumulative draft log-probability (the product of the draft's probabilities along its
    path); all of them are candidates and the best ``top_k`` form the next frontier, for
    ``depth`` levels; the ``nodes`` best candidates (the root included) are verified in one
    target forward. A child never outscores its parent, so the kept nodes hold their
    ancestors. Defaults as EAGLE-2's published runs: 6 levels, top-10, 60 tokens.

    Exact at every temperature: the tree is a deterministic function of the text (top-k of
    the draft's logits, no coin), so each child is a one-hot draft and siblings are distinct
    tokens: the multi-draft sampler accepts child x with probability residual(x) and, on a
    rejection, removes x from the residual (siblings without replacement), which leaves the
    emitted token distributed as the target's (tests chi-square it against the enumerated law).
    """
    depth: int = 6
    top_k: int = 10
    nodes: int = 60

    def __post_init__(self):
        check(self.depth >= 1 and self.top_k >= 1 and self.nodes >= 2, "depth, top_k, nodes",
              f"need >= 1, >= 1 and >= 2, got {self.depth}, {self.top_k}, {self.nodes}")

    def tree_shape(self) -> TreeShape:
        return TreeShape(depth=self.depth, top_k=self.top_k, nodes=self.nodes)

    @property
    def max_draft(self) -> int:
        return self.tree_shape().room

    def start(self, call: Call) -> Controller:
        return _Growing(self, call)
