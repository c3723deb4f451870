"""Draft trees: parents -> depth, packed attention bits (the ``tree_mask`` op), root-to-leaf
paths and children (:func:`build_tree`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.checks import check_parents, check_tensor


def tree_mask(parents: Tensor, backend: str = "auto", validate: bool | None = None) -> tuple[Tensor, Tensor]:
    """Depth and packed attention bits of a batch of trees.

    Args:
        parents: [B,T] or [T] int64; ``parents[..., 0] == -1`` (the root), ``0 <= parents[i] < i``.
    Returns:
        depth [B,T] int64 and mask [B,T,ceil(T/32)] int32 (bit j of mask[b,i]: node i attends node j).

    Example:
        >>> depth, mask = tree_mask(torch.tensor([-1, 0, 0, 1]))
        >>> depth.tolist(), mask[0, :, 0].tolist()
        ([[0, 1, 1, 2]], [1, 3, 5, 11])
    """
    if registry.checking(validate):
        check_tensor("parents", parents, (1, 2), (torch.int64,))
    parents = parents if parents.dim() == 2 else parents.unsqueeze(0)
    if registry.checking(validate):
        check_parents(parents)
    return registry.kernel("tree_mask", backend, parents.device)(parents)


@dataclass(frozen=True)
class Tree:
    """A batch of trees of T nodes each (node 0 the root, nodes in topological order).

    parents [B,T] int64, depth [B,T] int64 (also each node's position offset after the
    prefix), mask [B,T,ceil(T/32)] int32 bits (node i attends node j), and, on the host,
    children[b][i] (node ids, ascending) and paths[b] (root-to-leaf node-id lists).
    """
    parents: Tensor
    depth: Tensor
    mask: Tensor
    children: list[list[list[int]]]
    paths: list[list[list[int]]]

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def positions(self, prefix_lens: Tensor) -> Tensor:
        """[B,T] absolute positions of the nodes after per-row prefixes of ``prefix_lens`` [B]."""
        return prefix_lens.view(-1, 1).to(self.depth.dtype) + self.depth


def build_tree(parents: Tensor | list[int], backend: str = "auto") -> Tree:
    """Validate and describe a batch of trees.

    Args:
        parents: [T] or [B,T] int64 (or a list); ``parents[0] == -1``, ``0 <= parents[i] < i``.

    Example:
        >>> tree = build_tree([-1, 0, 0, 1])
        >>> tree.depth.tolist(), tree.children[0][0], tree.paths[0]
        ([[0, 1, 1, 2]], [1, 2], [[0, 1, 3], [0, 2]])
    """
    if not isinstance(parents, Tensor):
        parents = torch.tensor(parents, dtype=torch.int64)
    depth, mask = tree_mask(parents, backend=backend)
    parents = parents if parents.dim() == 2 else parents.unsqueeze(0)
    children, paths = [], []
    for row in parents.tolist():
        kids: list[list[int]] = [[] for _ in row]
        for node, parent in enumerate(row[1:], start=1):
            kids[parent].append(node)
        row_paths, stack = [], [[0]]
        while stack:
            path = stack.pop()
            below = kids[path[-1]]
            if not below:
                row_paths.append(path)
            stack.extend(path + [c] for c in reversed(below))
        children.append(kids)
        paths.append(row_paths)
    return Tree(parents, depth, mask, children, paths)
