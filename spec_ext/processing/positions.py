"""Which prefix each processed position continues: a row's committed tokens, then a path of
drafts (none for the position right after the committed tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Positions:
    """B rows x T positions whose logits are processed in one call: position (b, t) continues
    row b's committed tokens with ``path[b, t, D - depth[b, t]:]``.

    ``path`` [B,T,D] int64, right-aligned (the position's last path token at ``D - 1``), -1
    before the path; ``depth`` [B,T] int64 its length; ``valid`` [B,T] bool: the positions
    whose logits are used (the others, past a row's drafts or absent tree nodes, are left
    as they are and never call back into user code).
    """
    path: Tensor
    depth: Tensor
    valid: Tensor

    @staticmethod
    def after(drafts: Tensor) -> "Positions":
        """One position per row, after the drafts [B,n] so far (a draft step of a chain)."""
        B, n = drafts.shape
        device = drafts.device
        return Positions(drafts[:, None, :], torch.full((B, 1), n, dtype=torch.int64, device=device),
                         torch.ones(B, 1, dtype=torch.bool, device=device))

    @staticmethod
    def chain(drafts: Tensor, num_draft: Tensor) -> "Positions":
        """The K + 1 positions that verify a chain: position j after ``drafts[b, :j]`` (drafts
        [B,K], -1 padded; num_draft [B]); positions past a row's drafts are not valid."""
        B, K = drafts.shape
        steps = torch.arange(K + 1, device=drafts.device)
        source = torch.arange(K, device=drafts.device)[None, :] - K + steps[:, None]  # [K+1, K]
        path = drafts[:, source.clamp_min(0)].masked_fill(source < 0, -1)
        return Positions(path, steps.expand(B, K + 1), steps[None, :] <= num_draft[:, None])

    @staticmethod
    def tree(tokens: Tensor, parents: Tensor, depth: Tensor, max_depth: int) -> "Positions":
        """Every node of a tree (tokens [B,T] with node 0 the root, -1 for absent nodes;
        parents and depth [T] or [B,T]): a node's path is its ancestors' tokens below the
        root, then its own."""
        B, T = tokens.shape
        parents, depth = parents.expand(B, T), depth.expand(B, T)
        path = torch.full((B, T, max_depth), -1, dtype=torch.int64, device=tokens.device)
        node = torch.arange(T, device=tokens.device).expand(B, T)
        for s in range(max_depth):  # s steps up from the node
            path[:, :, max_depth - 1 - s] = torch.where(s < depth, tokens.gather(1, node), -1)
            node = parents.gather(1, node).clamp_min(0)
        valid = tokens >= 0
        valid[:, 0] = True
        return Positions(path, depth, valid)
