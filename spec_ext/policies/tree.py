"""Draft trees: a static shape grown by top-k (:class:`Tree`) and EAGLE-2's dynamic tree
(:class:`DynamicTree`); the target verifies either in one pass."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from spec_ext.policies.base import Policy, TreeShape, check, register


class _TreePolicy(Policy):
    """A policy whose model grows the same tree every round."""

    @property
    def max_draft(self) -> int:
        return self.tree_shape().room


@register
@dataclass(frozen=True)
class Tree(_TreePolicy):
    """A static draft tree expanded by top-k of the draft: ``branching[d]`` children for
    every node at depth d (None: :attr:`DEFAULT`, cut to the levels the drafter drafts).
    Verified in one target pass with tree attention and (when sampling) recursive rejection
    sampling with deterministic drafts."""
    branching: tuple[int, ...] | None = None

    DEFAULT: ClassVar[tuple[int, ...]] = (3, 2, 1, 1)

    def __post_init__(self):
        check(self.branching is None or isinstance(self.branching, (tuple, list)) and len(self.branching) > 0
              and all(isinstance(b, int) and b >= 1 for b in self.branching), "branching",
              f"need one or more positive counts, got {self.branching!r}")
        if self.branching is not None:
            object.__setattr__(self, "branching", tuple(self.branching))

    def tree_shape(self) -> TreeShape:
        return TreeShape(branching=self.DEFAULT if self.branching is None else self.branching)

    def fitted(self, max_depth: int | None, chain: int | None, drafter: str = "the drafter") -> Policy:
        if self.branching is None:
            return Tree(self.DEFAULT[:max_depth])
        return super().fitted(max_depth, chain, drafter)


@register
@dataclass(frozen=True)
class DynamicTree(_TreePolicy):
    """EAGLE-2's dynamic draft tree, grown by draft models and feature heads: from the root,
    every node on the frontier proposes its ``top_k`` most likely tokens, each scored by its
    cumulative draft log-probability (the product of the draft's probabilities along its
    path); all of them are candidates and the best ``top_k`` form the next frontier, for
    ``depth`` levels; the ``nodes`` best candidates (the root included) are verified in one
    target forward. A child never outscores its parent, so the kept nodes hold their
    ancestors. Defaults as EAGLE-2's published runs: 6 levels, top-10, 60 tokens (``depth``
    None: 6, or the levels the drafter drafts where fewer).

    Exact at every temperature: the tree is a deterministic function of the text (top-k of
    the draft's logits, no coin), so each child is a one-hot draft and siblings are distinct
    tokens: the multi-draft sampler accepts child x with probability residual(x) and, on a
    rejection, removes x from the residual (siblings without replacement), which leaves the
    emitted token distributed as the target's (tests chi-square it against the enumerated law).
    """
    depth: int | None = None
    top_k: int = 10
    nodes: int = 60

    DEFAULT_DEPTH: ClassVar[int] = 6

    def __post_init__(self):
        check((self.depth is None or self.depth >= 1) and self.top_k >= 1 and self.nodes >= 2, "depth, top_k, nodes",
              f"need >= 1 (or None), >= 1 and >= 2, got {self.depth}, {self.top_k}, {self.nodes}")

    def tree_shape(self) -> TreeShape:
        return TreeShape(depth=self.DEFAULT_DEPTH if self.depth is None else self.depth, top_k=self.top_k,
                         nodes=self.nodes)

    def fitted(self, max_depth: int | None, chain: int | None, drafter: str = "the drafter") -> Policy:
        if self.depth is None:
            return replace(self, depth=min(self.DEFAULT_DEPTH, max_depth or self.DEFAULT_DEPTH))
        return super().fitted(max_depth, chain, drafter)
