"""A static draft tree: the draft model grows it by top-k and the target verifies it in one pass."""
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
