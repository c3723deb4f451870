"""Draft trees: a static shape grown by top-k (:class:`Tree`) and EAGLE-2's dynamic tree
(:class:`DynamicTree`); the target verifies either in one pass."""
from __future__ import annotations

from typing import Sequence

from spec_ext.policies.base import Policy, register


@register
class Tree(Policy):
    """A static draft tree expanded by top-k of the draft: ``branching[d]`` children for
    every node at depth d. Verified in one target pass with tree attention and (when
    sampling) recursive rejection sampling with deterministic drafts."""

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


@register
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

    grows_dynamic_tree = True

    def __init__(self, depth: int = 6, top_k: int = 10, nodes: int = 60):
        if depth < 1 or top_k < 1 or nodes < 2:
            raise ValueError(f"depth, top_k, nodes: need >= 1, >= 1 and >= 2, got {depth}, {top_k}, {nodes}")
        self.depth, self.top_k, self.nodes = depth, top_k, nodes
        # the verification's width, and the draft's cache while it re-feeds the expanded tree
        self.max_draft = max(nodes - 1, top_k * (depth - 1) + 1)
